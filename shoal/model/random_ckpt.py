"""`random:<shape>[@<layers>]`: a random-weight checkpoint of a real model's shape, for
benchmarks.

Built once with transformers (the reference implementation, so both engines load the very
same files), saved as an HF directory under `$SHOAL_CACHE/random/<shape>[@<layers>]-<dtype>/`
and reused. No weights are downloaded; the outputs are meaningless tokens, the speed is real.
`@<layers>` keeps only the first layers of the shape (every layer of a shape is the same
size, or for DeepSeek the first dense ones): for models whose whole checkpoint would not fit
a disk (Qwen3-30B-A3B, 61 GB in bf16; Mixtral 8x7B, 93 GB), measured per layer.
"""

from __future__ import annotations

import json
from pathlib import Path

from shoal.model.presets import cache_dir

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES = {  # name -> (transformers config class, its fields for the real model)
    "smollm2-135m": ("LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
        rope_theta=100000.0, max_position_embeddings=8192)),
    "llama-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0})),
    "llama-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0})),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False, rope_theta=1000000.0,
        max_position_embeddings=40960)),
    "mixtral-8x7b": ("MixtralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1000000.0,
        max_position_embeddings=32768, sliding_window=None)),
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, tie_word_embeddings=False, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096})),
}


def parse_shape(name: str) -> tuple[str, int | None]:
    """`<shape>[@<layers>]` -> (shape, layers or None); ValueError naming what is wrong."""
    shape, _, layers = name.partition("@")
    if shape not in SHAPES:
        raise ValueError(f"unknown random shape {shape!r} (known: {', '.join(SHAPES)})")
    if not layers:
        return shape, None
    full = SHAPES[shape][1]["num_hidden_layers"]
    if not layers.isdigit() or not 1 <= int(layers) <= full:
        raise ValueError(f"random:{name}: the layer count must be in [1, {full}], got {layers!r}")
    return shape, int(layers)


def random_config(name: str):
    """The transformers config of `<shape>[@<layers>]`."""
    import transformers

    shape, layers = parse_shape(name)
    class_name, fields = SHAPES[shape]
    fields = {**fields, **({"num_hidden_layers": layers} if layers else {})}
    return getattr(transformers, class_name)(**fields, rms_norm_eps=1e-5, bos_token_id=1,
                                             eos_token_id=2, initializer_range=0.02)


def random_checkpoint(name: str, dtype: str = "bfloat16") -> Path:
    """The directory of the `<shape>[@<layers>]` checkpoint (built on the first call; on a
    GPU if one is there, since initialising billions of parameters on a CPU takes minutes)."""
    config = random_config(name)
    path = cache_dir() / "random" / f"{name}-{dtype}"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "shoal_random.json").write_text(json.dumps({"shape": name, "dtype": dtype}))
    tmp.rename(path)  # a crashed build leaves only the .tmp directory
    return path
