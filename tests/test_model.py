"""Greedy outputs equal transformers' token for token (the obviously-correct reference)."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from tests.conftest import TINY_CONFIGS, hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("max_num_tokens", [2048, 7])
def test_tiny_llama_matches_transformers(tiny_models, name, max_num_tokens):
    from transformers import AutoModelForCausalLM

    path = tiny_models[name]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # lengths span several blocks of 4 and (llama3 config) past the original 64 positions
    prompts = random_prompts(512, [1, 5, 17, 40, 90])
    expected = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    with LLM(str(path), block_size=4, max_num_tokens=max_num_tokens, num_kv_blocks=128) as llm:
        outs = llm.generate(prompts, GREEDY)
        llm.check_integrity()
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)


def _smollm2_prompts(llm) -> list[list[int]]:
    tok = llm.tokenizer
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Explain in one sentence what a CPU does.", "What is 12 times 12?"]
    chats = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    story = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
             "as his father had taught him, and wrote the weather in a leather book. ") * 6
    long_prompt = tok.encode(story + "Summarize the story in one sentence:")
    assert len(long_prompt) > 8 * 16, "the long prompt must span several blocks"
    return chats + [long_prompt]


@pytest.mark.slow
@pytest.mark.parametrize("max_num_tokens", [2048, 24])
def test_smollm2_gguf_matches_transformers(smollm2_path, smollm2_hf, max_num_tokens):
    with LLM(smollm2_path, max_num_tokens=max_num_tokens, num_kv_blocks=256,
             overlap_scheduler=max_num_tokens == 24) as llm:
        prompts = _smollm2_prompts(llm)
        sampling = SamplingParams(max_tokens=20)
        outs = llm.generate(prompts, sampling)
        llm.check_integrity()
        texts = [o.text for o in outs]
    expected = [hf_greedy(smollm2_hf, p, 20, eos_token_id=2) for p in prompts]
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in texts[0]
