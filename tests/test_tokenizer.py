"""shoal.model.tokenizer: the ids are the HF tokenizer's own, and threads tokenize at once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from shoal.model.tokenizer import Tokenizer

TEXTS = ["", "hello", " Hello, world!\n\n", "<|im_start|>user\nhi<|im_end|>", "naïve café 東京 🙂",
         "def f(x):\n    return x ** 2  # tabs\tand  spaces", "word " * 3000]
CHATS = [[{"role": "user", "content": "hi"}],
         [{"role": "system", "content": "Be brief. <|im_end|> is text here."},
          {"role": "user", "content": "What is 2+2?"},
          {"role": "assistant", "content": "4"},
          {"role": "user", "content": "And 3+3? " * 200}]]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2) -> Tokenizer:
    return smollm2.tokenizer


def _hf_chat_ids(hf, messages) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "input_ids") else out)


def test_ids_are_the_hf_tokenizer_s_own(smollm2_tokenizer):
    """Through the Rust tokenizer's batch call: the same ids as the HF wrapper's encode and
    chat template (special tokens written in a text included)."""
    tok = smollm2_tokenizer
    hf = tok.hf
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=True), text[:40]
    for chat in CHATS:
        assert tok.apply_chat_template(chat) == _hf_chat_ids(hf, chat)


def test_threads_tokenize_at_once_and_get_the_same_ids(smollm2_tokenizer):
    """Eight threads encoding, applying the template and decoding at once (as a server's
    requests do) get what one at a time gets; none fails on the tokenizer being borrowed."""
    tok = smollm2_tokenizer
    want = [tok.encode(t) for t in TEXTS] + [tok.apply_chat_template(c) for c in CHATS]
    want = (want, tok.decode(want[-1]))
    got, errors = [], []
    start = threading.Barrier(8)

    def work() -> None:
        try:
            start.wait(timeout=30)
            for _ in range(5):
                ids = [tok.encode(t) for t in TEXTS] + [tok.apply_chat_template(c) for c in CHATS]
                got.append((ids, tok.decode(ids[-1])))
        except Exception as e:  # (reported below: a thread's failure fails the test)
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(got) == 40 and all(out == want for out in got)


def test_a_tokenizer_file_that_truncates_gives_the_whole_text_s_ids(smollm2_tokenizer,
                                                                    tmp_path):
    """A tokenizer.json with truncation set: the Rust tokenizer alone would cut the text; the
    HF wrapper turns truncation off in every call, and so does Shoal, once at load."""
    from tokenizers import Tokenizer as RustTokenizer
    tok = smollm2_tokenizer
    tok.hf.save_pretrained(str(tmp_path))
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                          "stride": 0}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert RustTokenizer.from_file(str(tmp_path / "tokenizer.json")).truncation is not None
    truncating = Tokenizer(Path(tmp_path), None, "test-truncation")
    text = TEXTS[-1]
    assert truncating.encode(text) == tok.encode(text) and len(tok.encode(text)) > 8
    assert truncating.encode(text) == truncating.hf.encode(text, add_special_tokens=True)
    assert truncating.apply_chat_template(CHATS[1]) == tok.apply_chat_template(CHATS[1])
