"""Text <-> token ids and chat templates, through `transformers` tokenizers."""

from __future__ import annotations

import logging
from pathlib import Path

from shoal.model.presets import cache_dir

log = logging.getLogger(__name__)


class Tokenizer:
    """Thin wrapper; GGUF tokenizers are converted once and cached as HF files."""

    def __init__(self, tokenizer_dir: Path, gguf_file: str | None, checksum: str):
        from transformers import AutoTokenizer

        if gguf_file is None:
            self._tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        else:
            converted = cache_dir() / "tokenizers" / checksum
            try:
                self._tok = AutoTokenizer.from_pretrained(str(converted))
            except (OSError, ValueError):
                self._tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), gguf_file=gguf_file)
                try:
                    self._tok.save_pretrained(str(converted))
                except OSError as e:
                    log.warning("could not cache the converted tokenizer in %s: %s", converted, e)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation followed by the assistant's generation prompt."""
        out = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)
