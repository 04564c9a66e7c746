"""A GPU engine compiles its Triton kernels at bring-up (ModelRunner._warm_up), not in the
requests: one without decode graphs (enforce_eager, as every TP or ADP rank) met the MoE's
small tiles in its first short prefill, 1.8 s with a cold Triton cache (skipped without a
GPU)."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def compiled_variants() -> dict[str, int]:
    """Compiled variants of each Triton kernel the model launches (Triton keeps one per
    specialization: argument dtypes, constexprs, integers equal to 1 or multiples of 16)."""
    from shoal.model import fused_moe, fused_ops, paged_attention, paged_mla
    counts = {}
    for module in (fused_moe, fused_ops, paged_attention, paged_mla):
        for name, fn in vars(module).items():
            caches = getattr(fn, "device_caches", None)
            if name.endswith("_kernel") and caches is not None:
                counts[f"{module.__name__}.{name}"] = sum(len(c[0]) for c in caches.values())
    assert counts, "no Triton kernel found (this Triton keeps its variants elsewhere)"
    return counts


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2"])
def test_an_eager_engine_compiles_no_kernel_in_its_requests(tiny_moe_models, name):
    """Batches of 1 to 40 rows (MLA's decode splits a context 8, 4 or 2 ways by batch size)
    and prompts on and off multiples of 16 tokens (the MoE's counts of assignments)."""
    with LLM(str(tiny_moe_models[name]), device="cuda", dtype="bfloat16", enforce_eager=True,
             block_size=16, num_kv_blocks=512, max_num_tokens=256) as llm:
        after_bring_up = compiled_variants()
        sp = SamplingParams(max_tokens=4, ignore_eos=True)
        llm.generate(random_prompts(512, [16]), sp)
        llm.generate(random_prompts(512, [1, 3, 17, 32, 100, 250], seed=2), sp)
        llm.generate(random_prompts(512, [5] * 40, seed=3), sp)
        llm.check_integrity()
        assert compiled_variants() == after_bring_up
    from shoal.model.fused_moe import TILES
    # the experts' kernels were compiled at bring-up, at every tile size
    assert after_bring_up["shoal.model.fused_moe._gate_up_kernel"] >= len(TILES)


def test_bring_up_runs_a_hits_last_chunk_after_a_long_context(tiny_moe_models, monkeypatch):
    """A pool hit ends with a block's tokens after a long context; on DeepSeek-V2-Lite's
    shape the first such forward in a process cost 40 ms (kernels met for the first time).
    Bring-up runs one, after a context at least as long as its probes'."""
    from shoal.engine.model_runner import ModelRunner

    calls = []
    time_prefill = ModelRunner.time_prefill

    def recorded(self, num_tokens, context=0):
        calls.append((num_tokens, context))
        return time_prefill(self, num_tokens, context)

    monkeypatch.setattr(ModelRunner, "time_prefill", recorded)
    with LLM(str(tiny_moe_models["deepseek_v2"]), device="cuda", dtype="bfloat16",
             block_size=16, num_kv_blocks=512, max_num_tokens=256) as llm:
        longest = max(n for n, context in calls if context == 0)  # the bring-up's probes
        assert any(n == 16 and n + context >= longest for n, context in calls if context)
        outs = llm.generate(random_prompts(512, [40, 100]), SamplingParams(max_tokens=4))
        llm.check_integrity()
    assert all(len(o.token_ids) == 4 for o in outs)
