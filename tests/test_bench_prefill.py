"""`shoal bench prefill`: the FLOPs it counts are the ones the engine's prefill runs (torch's
own counter, on dense, mixture-of-experts and latent-attention models), and the command runs
end to end with every option."""

from __future__ import annotations

import json

import pytest
from torch.utils.flop_counter import FlopCounterMode

from shoal.bench.prefill import prefill_flops
from shoal.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.request import NewRequest
from shoal.sampling import SamplingParams
from tests.test_cli import shoal

L = 40  # prompt tokens


def _counted(path: str) -> tuple[float, dict[str, int]]:
    """(prefill_flops of one L-token prompt, torch's FLOP counts of the engine computing it)."""
    engine = Engine(EngineConfig(model=path, overlap_scheduler=False))  # (this thread's ops)
    engine.add(NewRequest(list(range(3, 3 + L)), SamplingParams(max_tokens=1)))
    with FlopCounterMode(display=False) as counter:
        while engine.has_work:
            engine.step()
    engine.shutdown()
    counts = counter.get_flop_counts()["Global"]
    counts = {str(op).removeprefix("aten."): n for op, n in counts.items()}
    return prefill_flops(engine.model, L), counts


def test_a_dense_prefill_is_its_matmuls_and_causal_attention(tiny_model):
    """torch counts the matmuls (the attention runs in SDPA, which it does not count); the
    tiny Llama's attention: 3 layers x 4 heads x (16 + 16) dims x L (L + 1)."""
    flops, counts = _counted(tiny_model)
    assert counts == {"mm": flops - 3 * 4 * (16 + 16) * L * (L + 1)}


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2"])
def test_experts_count_their_routed_share_and_latent_attention_its_heads(tiny_moe_models, name):
    """Each token meets its top 2 of 8 experts (the matmuls torch counts, as the engine
    routes them); DeepSeek-V2's expanded attention (batched matmuls, every key counted)
    is twice the causal count: 3 layers x 4 heads x (24 + 16) dims, L (L + 1) against 2 L^2."""
    flops, counts = _counted(str(tiny_moe_models[name]))
    attention = 3 * 4 * (24 + 16 if name == "deepseek_v2" else 16 + 16) * L * (L + 1)
    assert counts["mm"] == flops - attention
    if name == "deepseek_v2":
        assert counts["bmm"] == 3 * 4 * (24 + 16) * 2 * L * L
    else:
        assert set(counts) == {"mm"}


def test_bench_prefill_end_to_end(tiny_model):
    """Every option: 2 prompts of 24 tokens in steps of 16 tokens take 3 forwards; the
    figures agree with one another; a prompt the context cannot hold is refused naming it."""
    r = shoal("bench", "prefill", "--model", tiny_model, "--num-prompts", "2", "--prompt-len",
              "24", "--rounds", "1", "--max-num-tokens", "16", "--dtype", "float32",
              "--enforce-eager", "--device", "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["bench"] == "prefill" and result["dtype"] == "torch.float32"
    assert (result["num_prompts"], result["prompt_len"], result["max_num_tokens"],
            result["rounds"], result["enforce_eager"]) == (2, 24, 16, 1, True)
    assert result["steps_per_round"] == 3
    assert result["tokens_per_s"] == pytest.approx(48 / result["prefill_s"])
    assert result["achieved_tflops"] == pytest.approx(result["tflop"] / result["prefill_s"])
    assert result["mfu"] == pytest.approx(result["achieved_tflops"]
                                          / result["matmul_peak_tflops"])
    r = shoal("bench", "prefill", "--model", tiny_model, "--prompt-len", "1024")
    assert r.returncode == 2 and "--prompt-len 1024" in r.stderr
    r = shoal("bench", "prefill", "--model", tiny_model, "--rounds", "0")
    assert r.returncode == 2 and "--rounds must be at least 1" in r.stderr
