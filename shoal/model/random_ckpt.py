"""`random:<shape>`: a random-weight checkpoint of a real model's shape, for benchmarks.

Built once with transformers (the reference implementation, so both engines load the very
same files), saved as an HF directory under `$SHOAL_CACHE/random/<shape>-<dtype>/` and
reused. No weights are downloaded; the outputs are meaningless tokens, the speed is real.
"""

from __future__ import annotations

import json
from pathlib import Path

from shoal.model.presets import cache_dir

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES = {  # name -> LlamaConfig fields of the real model
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=131072, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, tie_word_embeddings=False, rope_theta=500000.0,
                     max_position_embeddings=131072, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
}


def random_checkpoint(shape: str, dtype: str = "bfloat16") -> Path:
    """The directory of the `shape` checkpoint (built on the first call; on a GPU if one is
    there, since initialising 8B parameters on a CPU takes minutes)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown random shape {shape!r} (known: {', '.join(SHAPES)})")
    path = cache_dir() / "random" / f"{shape}-{dtype}"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.02)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "shoal_random.json").write_text(json.dumps({"shape": shape, "dtype": dtype}))
    tmp.rename(path)  # a crashed build leaves only the .tmp directory
    return path
