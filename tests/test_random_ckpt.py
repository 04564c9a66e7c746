"""`random:<shape>[@<layers>]`: the real shapes, and fewer layers of them."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams
from shoal.model.config import ModelConfig
from shoal.model.random_ckpt import SHAPES, random_config

# shape -> (family, layers, KV bytes per token in bf16, experts)
REAL = {
    "smollm2-135m": ("llama", 30, 30 * 2 * 3 * 64 * 2, 0),
    "llama-1b": ("llama", 16, 16 * 2 * 8 * 64 * 2, 0),
    "llama-8b": ("llama", 32, 32 * 2 * 8 * 128 * 2, 0),
    "qwen3-30b-a3b": ("qwen3_moe", 48, 48 * 2 * 4 * 128 * 2, 128),
    "mixtral-8x7b": ("mixtral", 32, 32 * 2 * 8 * 128 * 2, 8),
    "deepseek-v2-lite": ("deepseek_v2", 27, 27 * (512 + 64) * 2, 64),  # 31 KB a token
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shapes_are_the_real_models(shape):
    cfg = ModelConfig.from_hf(random_config(shape).to_dict())
    family, layers, kv_bytes, experts = REAL[shape]
    parts, heads, dim = cfg.kv_token_shape()
    assert (cfg.family, cfg.num_layers, cfg.num_experts) == (family, layers, experts)
    assert cfg.num_layers * parts * heads * dim * 2 == kv_bytes


def test_fewer_layers_of_a_shape():
    cfg = ModelConfig.from_hf(random_config("deepseek-v2-lite@3").to_dict())
    assert cfg.num_layers == 3 and cfg.moe_layers == (1, 2) and cfg.kv_lora_rank == 512
    for bad in ("deepseek-v2-lite@0", "deepseek-v2-lite@28", "deepseek-v2-lite@x", "gpt-5"):
        with pytest.raises(ValueError, match="layer count|unknown random shape"):
            random_config(bad)


@pytest.mark.extended
def test_a_layer_of_deepseek_v2_lite_runs(tmp_path, monkeypatch):
    """Built by transformers at its real width (one dense layer), loaded and run."""
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path))
    with LLM("random:deepseek-v2-lite@1", num_kv_blocks=8) as llm:
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    assert (tmp_path / "random" / "deepseek-v2-lite@1-bfloat16" / "config.json").is_file()
