"""Half precision (bfloat16, float16) and dtype="auto": greedy output against transformers
in the same dtype, on CPU with tiny models (an argmax tie may flip a token: checked there)."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from tests.conftest import random_prompts

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_TOKENS = 8


def hf_model(path, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def hf_greedy_logits(model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers greedy tokens, and the float32 logits each was chosen from."""
    tokens, logits = [], []
    with torch.inference_mode():
        for _ in range(n):
            out = model(torch.tensor([ids + tokens], device=model.device)).logits[0, -1].float()
            logits.append(out)
            tokens.append(int(out.argmax()))
    return tokens, logits


def assert_greedy_matches(model, prompt, ours, ref, ref_logits, tol):
    """Equal, or equal up to a step where transformers' own top two were a near tie."""
    if ours == ref:
        return True
    i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
    gap = float(ref_logits[i][ref[i]] - ref_logits[i][ours[i]])
    scale = float(ref_logits[i].abs().max())
    assert 0 <= gap <= tol * scale, (i, ours, ref, gap, scale)
    return False


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied", "llama3_rope"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_half_precision_matches_transformers(tiny_models, name, dtype):
    path = tiny_models[name]
    prompts = random_prompts(512, [5, 17, 40, 70], seed=11)
    ref = hf_model(path, DTYPES[dtype])
    with LLM(str(path), dtype=dtype, block_size=4, num_kv_blocks=128,
             max_num_tokens=32) as llm:  # chunked prefill for the longer prompts
        assert llm.engine.kv_cache.tensor.dtype == DTYPES[dtype]
        assert next(llm.engine.model.parameters()).dtype == DTYPES[dtype]
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    exact = 0
    for prompt, out in zip(prompts, outs):
        tokens, logits = hf_greedy_logits(ref, prompt, MAX_TOKENS)
        exact += assert_greedy_matches(ref, prompt, out.token_ids, tokens, logits, tol=0.02)
    assert exact >= len(prompts) - 1  # a tie is rare: at most one prompt may take it


def test_float32_is_exact_and_auto_is_float32_on_cpu(tiny_model):
    prompts = random_prompts(512, [9, 33], seed=12)
    ref = hf_model(tiny_model, torch.float32)
    with LLM(tiny_model, block_size=4, num_kv_blocks=64) as llm:  # dtype="auto"
        assert llm.config.dtype == "auto" and llm.engine.kv_cache.tensor.dtype == torch.float32
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy_logits(ref, prompt, MAX_TOKENS)[0]


def test_half_precision_keys_differ_from_float32(tiny_model, tmp_path):
    """The pool namespace includes the dtype: a bfloat16 engine never loads float32 KV."""
    prompt = random_prompts(512, [40], seed=13)[0]
    sp = SamplingParams(max_tokens=2)
    with LLM(tiny_model, block_size=4, num_kv_blocks=64, kv_pool=str(tmp_path)) as llm:
        llm.generate([prompt], sp)
    with LLM(tiny_model, block_size=4, num_kv_blocks=64, kv_pool=str(tmp_path),
             dtype="bfloat16") as llm:
        assert llm.generate([prompt], sp)[0].num_connector_tokens == 0
        assert llm.generate([prompt + [1]], sp)[0].num_local_prefix_tokens > 0


def test_cli_dtype_flag_reaches_the_engine_config():
    from shoal.cli import _engine_kwargs, build_parser
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        args = build_parser().parse_args(["generate", "--prompt", "x", "--dtype", dtype])
        assert _engine_kwargs(args)["dtype"] == dtype
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "int8"])
    args = build_parser().parse_args(["generate", "--prompt", "x", "--enforce-eager"])
    assert _engine_kwargs(args)["enforce_eager"] is True
    assert _engine_kwargs(build_parser().parse_args(["generate", "--prompt", "x"]))[
        "enforce_eager"] is False


def test_bad_dtype_names_the_field(tiny_model):
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_model, dtype="float64")


def test_deepseek_in_bfloat16_keeps_its_router_in_float32(tiny_moe_models):
    """MLA and the biased sigmoid router in bfloat16 against transformers in bfloat16, which
    keeps the router's weight (and Shoal its expert bias) in float32. Compared on the token
    each prompt's prefill picks: later tokens come from the absorbed decode, whose bfloat16
    rounding differs from transformers' expanded form (as accurate: tests/test_mla.py), and
    one flipped expert choice in a tiny random model moves the logits far."""
    path = tiny_moe_models["deepseek_v3"]
    prompts = random_prompts(512, [5, 17, 40, 33], seed=12)
    ref = hf_model(path, torch.bfloat16)
    assert ref.model.layers[1].mlp.gate.weight.dtype == torch.float32
    with LLM(str(path), dtype="bfloat16", block_size=4, num_kv_blocks=128,
             max_num_tokens=16) as llm:  # chunked prefill for the longer prompts
        moe = llm.engine.model.layers[1].mlp
        assert moe.gate.weight.dtype == moe.score_bias.dtype == torch.float32
        assert moe.gate_up.dtype == llm.engine.kv_cache.tensor.dtype == torch.bfloat16
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    exact = 0
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == MAX_TOKENS
        tokens, logits = hf_greedy_logits(ref, prompt, 1)
        exact += assert_greedy_matches(ref, prompt, out.token_ids[:1], tokens, logits, tol=0.02)
    assert exact >= len(prompts) - 1
