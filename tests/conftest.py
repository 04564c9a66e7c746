"""Shared fixtures: tiny random Llama checkpoints, the real SmolLM2, transformers references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CONFIGS = {
    # name -> LlamaConfig overrides; every config is small enough to build in a second
    "gqa_tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                        max_position_embeddings=512,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}),
}


def make_tiny_llama(path: Path, name: str, seed: int = 0) -> Path:
    """Save a random Llama checkpoint (config.json + safetensors) under `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  rope_theta=10000.0, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                  initializer_range=0.15)
    cfg = LlamaConfig(**{**fields, **TINY_CONFIGS[name]})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


TINY_MOE = {
    # name -> (transformers config class, its fields): Qwen3-MoE with one dense layer, Mixtral
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        intermediate_size=160, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2, eos_token_id=None, bos_token_id=None)),
    # MLA (q straight, no q_lora) with V2's group-limited softmax router and one dense layer
    "deepseek_v2": ("DeepseekV2Config", dict(
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, eos_token_id=None, bos_token_id=None, num_key_value_heads=4, head_dim=8,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "mscale": 0.9, "mscale_all_dim": 0.9, "rope_theta": 10000.0})),
    # MLA with q_lora, V3's biased sigmoid router over groups, scaled weights, yarn's mscale
    "deepseek_v3": ("DeepseekV3Config", dict(
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, eos_token_id=None, bos_token_id=None, num_key_value_heads=4, head_dim=8,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0})),
}


def make_tiny_moe(path: Path, name: str, seed: int = 0) -> Path:
    """Save a random mixture-of-experts checkpoint (the hub's layout: one tensor per expert)."""
    import transformers

    class_name, fields = TINY_MOE[name]
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-5, initializer_range=0.15, tie_word_embeddings=False)
    cfg = getattr(transformers, class_name)(**{**common, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # decisive routers: float32 noise cannot
                t.mul_(4)  # flip a top-k choice
        for name, t in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a bias that changes choices
                t.copy_(torch.randn_like(t) * 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-moe")
    return {name: make_tiny_moe(root / name, name) for name in TINY_MOE}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_llama(root / name, name) for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> str:
    return str(tiny_models["gqa_tied"])


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int,
              eos_token_id: int | None = None) -> list[int]:
    """transformers greedy generation for one prompt (no padding involved)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                             pad_token_id=0 if eos_token_id is None else eos_token_id,
                             temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist()


def count_lookups(monkeypatch) -> dict[str, int]:
    """Count the fs pool's file lookups by block path (filled as the engine looks)."""
    from shoal.connectors.fs import format as pf

    looked: dict[str, int] = {}
    real = pf.is_block_file

    def counting(path: str) -> bool:
        looked[path] = looked.get(path, 0) + 1
        return real(path)
    monkeypatch.setattr(pf, "is_block_file", counting)
    return looked


def random_prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real default model's GGUF (fetched into the cache on first use)."""
    from shoal.model.presets import fetch_preset
    return str(fetch_preset("smollm2"))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own GGUF loader: an independent dequantization of the same file."""
    from transformers import AutoModelForCausalLM
    p = Path(smollm2_path)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """One shared SmolLM2 engine (plain loop) for tests that do not care about the knobs."""
    from shoal import LLM
    llm = LLM(smollm2_path, overlap_scheduler=False, num_kv_blocks=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def redis_session_url(tmp_path_factory):
    """A real Redis for the session: the one `.ci/run` started (SHOAL_TEST_REDIS_URL), or
    one started here (tests/redis_server.py); skips where no server binary exists."""
    from tests.redis_server import RedisServer, require_redis, shared_url
    url = shared_url()
    if url is not None:
        pytest.importorskip("redis", reason="the redis package is not installed")
        # pytest-xdist's workers (gw0, gw1, ...) each take a database of their own: each
        # test empties its database first
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        yield url.rsplit("/", 1)[0] + f"/{int(worker[2:]) + 1}" if worker else url
        return
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture
def redis_url(redis_session_url) -> str:
    """The session's Redis, its database emptied for this test."""
    import redis
    client = redis.Redis.from_url(redis_session_url)
    client.flushdb()
    client.close()
    return redis_session_url
