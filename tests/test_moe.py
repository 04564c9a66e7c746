"""Mixture-of-experts models (Qwen3-MoE, Mixtral, DeepSeek-V2/V3): greedy outputs equal
transformers' on one rank, under TP 2 and under ADP 2 (experts split over the ranks, no
rank holding them all; an idle owner's padding batch joins every MoE layer)."""

from __future__ import annotations

import json

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.model.config import ModelConfig
from shoal.model.llama import LlamaModel
from shoal.model.shard import Shard
from tests.conftest import TINY_MOE, hf_greedy, random_prompts

SP = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_moe_models):
    """transformers' greedy tokens per model for the prompts of these tests."""
    from transformers import AutoModelForCausalLM
    prompts = random_prompts(512, [1, 5, 17, 40], seed=3)
    out = {}
    for name, path in tiny_moe_models.items():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = (prompts, [hf_greedy(ref, p, SP.max_tokens) for p in prompts])
    return out


@pytest.mark.parametrize("name", sorted(TINY_MOE))
@pytest.mark.parametrize("max_num_tokens", [2048, 7])
def test_one_rank_matches_transformers(tiny_moe_models, expected, name, max_num_tokens):
    prompts, want = expected[name]
    with LLM(str(tiny_moe_models[name]), block_size=4, num_kv_blocks=128,
             max_num_tokens=max_num_tokens) as llm:
        outs = llm.generate(prompts, SP)
        llm.check_integrity()
    assert [o.token_ids for o in outs] == want
    assert len({tuple(t) for t in want}) == len(want)  # the model is not degenerate


@pytest.mark.parametrize("name, kw", [("qwen3_moe", dict(tp_size=2)), ("qwen3_moe", dict(dp_size=2)),
                                      ("mixtral", dict(dp_size=2)),
                                      ("deepseek_v2", dict(tp_size=2)),
                                      ("deepseek_v3", dict(dp_size=2))])
def test_experts_split_over_two_ranks_match_transformers(tiny_moe_models, expected, name, kw):
    prompts, want = expected[name]
    with LLM(str(tiny_moe_models[name]), block_size=4, num_kv_blocks=128, **kw) as llm:
        outs = llm.generate(prompts, SP)
        # one request: the other owner is idle, its padding batch joins every layer
        alone = llm.generate(prompts[2:3], SP)[0]
        llm.check_integrity()
    assert [o.token_ids for o in outs] == want and alone.token_ids == want[2]


def test_a_rank_holds_only_its_experts(tiny_moe_models):
    """Rank 1 of 2 holds experts 4-7 of 8, equal to the checkpoint's; the router is whole."""
    from safetensors.torch import load_file
    path = tiny_moe_models["qwen3_moe"]
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    weights = load_file(path / "model.safetensors")
    model = LlamaModel(cfg, Shard(rank=1, size=2, reduce=lambda t: t, gather=lambda t: t))
    model.load_hf_state_dict(weights)
    moe = model.layers[0].mlp
    assert moe.gate_up.shape[0] == moe.down.shape[0] == 4 and moe.first == 4
    hf = "model.layers.0.mlp."
    assert torch.equal(moe.gate.weight, weights[hf + "gate.weight"])
    for local, e in enumerate(range(4, 8)):
        assert torch.equal(moe.gate_up[local], torch.cat([weights[f"{hf}experts.{e}.gate_proj.weight"],
                                                          weights[f"{hf}experts.{e}.up_proj.weight"]]))
        assert torch.equal(moe.down[local], weights[f"{hf}experts.{e}.down_proj.weight"])
    assert not hasattr(model.layers[1].mlp, "gate_up")  # mlp_only_layers: the dense MLP


def test_moe_fields_from_a_hub_config():
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=100, hidden_size=32,
                intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True)
    cfg = ModelConfig.from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe_layers == (1, 5) and cfg.num_experts == 8 and cfg.qk_norm
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="dp_size=3 must divide the model's num_experts"):
        LlamaModel(ModelConfig.from_hf(base), Shard(rank=0, size=3, gather=lambda t: t))


def test_pool_hits_under_adp_give_the_same_tokens(tiny_moe_models, expected, tmp_path):
    """The KV pool with experts split over two owners: a restarted fleet loads the prompts'
    blocks from the pool and answers as transformers does."""
    prompts, want = expected["qwen3_moe"]
    model, pool = str(tiny_moe_models["qwen3_moe"]), str(tmp_path / "pool")
    for run in range(2):
        with LLM(model, block_size=4, num_kv_blocks=128, dp_size=2, kv_pool=pool) as llm:
            outs = llm.generate(prompts, SP)
            loaded = sum(s["connector_tokens_loaded"] for s in llm.stats()["per_rank"])
        assert [o.token_ids for o in outs] == want
        assert (loaded > 0) == (run == 1), loaded
