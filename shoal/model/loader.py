"""Turn a model name (preset, HF directory or .gguf file) into config + HF-named weights."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.model.config import FAMILIES, ModelConfig
from shoal.model.gguf_file import GGUFFile
from shoal.model.rope_scaling import RopeScaling
from shoal.model.presets import PRESETS, cache_dir, fetch_preset


@dataclass
class ModelSource:
    """What a loader found: everything the engine needs to build the model and tokenizer."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF Llama names, float32, on CPU
    checksum: str  # hex digest of the weight files: part of the model identity
    tokenizer_dir: Path  # where transformers finds the tokenizer
    gguf_file: str | None  # tokenizer file name inside tokenizer_dir, for GGUF models


def resolve_model_path(model: str) -> Path:
    """Preset names are fetched into the cache; `random:<shape>` checkpoints are built into
    it (shoal.model.random_ckpt); anything else must exist on disk."""
    if model in PRESETS:
        return fetch_preset(model)
    if model.startswith("random:"):
        from shoal.model.random_ckpt import random_checkpoint
        return random_checkpoint(model.removeprefix("random:"))
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor an existing HF directory or .gguf file")
    return path


def load_model_source(model: str) -> ModelSource:
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _load_hf_dir(path)
    raise ValueError(f"model path {str(path)!r} is not a .gguf file or a directory with config.json")


def file_checksum(paths: list[Path]) -> str:
    """blake2b over the files' bytes, remembered per (path, size, mtime) in the cache dir."""
    memo_path = cache_dir() / "checksums.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    digest = hashlib.blake2b(digest_size=16)
    changed = False
    for p in sorted(paths):
        st = p.stat()
        memo_key = f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if memo_key not in memo:
            h = hashlib.blake2b(digest_size=16)
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
            memo[memo_key] = h.hexdigest()
            changed = True
        digest.update(memo[memo_key].encode())
    if changed:
        try:
            memo_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = memo_path.with_suffix(f".{id(memo)}.tmp")
            tmp.write_text(json.dumps(memo))
            tmp.replace(memo_path)
        except OSError:
            pass  # the memo only saves time; a read-only cache is fine
    return digest.hexdigest()


def _load_hf_dir(path: Path) -> ModelSource:
    from safetensors.torch import load_file

    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    files = _safetensors_files(path)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update({k: v.float() for k, v in load_file(str(f)).items()})
    return ModelSource(config, weights, file_checksum(files), path, None)


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files of a HF directory: the shards its index names, else
    model.safetensors, else every *.safetensors. The index comes first because some
    repositories (Mistral's) also ship the same weights under other names
    (consolidated.safetensors), which would be loaded twice."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are not in {path}: {missing[:3]}")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    return files


_GGUF_NAMES = {  # GGUF tensor suffix -> HF Llama name suffix
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# GGUF general.architecture -> family (llama.cpp converts Mistral checkpoints to "llama")
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (it interleaves the two RoPE halves per head)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def load_model_config(model: str) -> ModelConfig:
    """The architecture alone (no weights read): for validating a fleet before spawning it."""
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_config(GGUFFile(path), path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    raise ValueError(f"model path {str(path)!r} is not a .gguf file or a directory with config.json")


def _load_gguf(path: Path) -> ModelSource:
    reader = GGUFFile(path)
    config = _gguf_config(reader, path)
    # llama.cpp interleaves the RoPE halves of q/k rows only in its Llama converter; Qwen
    # models use its NEOX RoPE, which keeps HF's layout.
    is_permuted = config.family == "llama"
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = t.name
        if name == "rope_freqs.weight":
            continue  # read into config.rope_scaling
        w = reader.dequantize(t)
        if is_permuted and name.endswith("attn_q.weight"):
            w = _unpermute(w, config.num_heads)
        elif is_permuted and name.endswith("attn_k.weight"):
            w = _unpermute(w, config.num_kv_heads)
        weights[_hf_name(name)] = w.contiguous()
    return ModelSource(config, weights, file_checksum([path]), path.parent, path.name)


def _gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    def field(name: str, default=None):
        return reader.fields.get(name, default)

    arch = field("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(GGUF_FAMILIES)})")
    family = GGUF_FAMILIES[arch]
    scaling_type = field(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ValueError(f"{path}: GGUF {arch}.rope.scaling.type {scaling_type!r} is not "
                         "supported (only llama3 scaling stored as rope_freqs)")
    tensors = {t.name: t for t in reader.tensors}
    num_heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    head_dim = field(f"{arch}.attention.key_length") or field(
        f"{arch}.rope.dimension_count", hidden // num_heads)
    for key in ("attention.value_length", "rope.dimension_count"):
        if field(f"{arch}.{key}", head_dim) != head_dim:
            raise ValueError(f"{path}: GGUF {arch}.{key} ({field(f'{arch}.{key}')}) differs "
                             f"from the head dimension ({head_dim}); not supported")
    rope_theta = float(field(f"{arch}.rope.freq_base", 10000.0))
    scaling = None
    if "rope_freqs.weight" in tensors:  # llama3 scaling, baked in by llama.cpp
        factors = reader.dequantize(tensors["rope_freqs.weight"]).reshape(-1).tolist()
        try:
            scaling = RopeScaling.from_freq_factors(factors, rope_theta, head_dim)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    max_len = field(f"{arch}.context_length", 2048)
    window = field(f"{arch}.attention.sliding_window")  # see hf_sliding_window
    eos = field("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=tensors["token_embd.weight"].shape[1],
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_layers=field(f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=field(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        max_position_embeddings=max_len if window is None else min(max_len, window),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=scaling,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        family=family,
        qkv_bias=FAMILIES[family].qkv_bias,
        qk_norm=FAMILIES[family].qk_norm,
    )


def _hf_name(gguf_name: str) -> str:
    fixed = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, part, kind = gguf_name.split(".")
    if part not in _GGUF_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_GGUF_NAMES[part]}.{kind}"


def load_tokenizer_only(model: str):
    """The model's tokenizer without reading its weights (for a front process)."""
    from shoal.model.tokenizer import Tokenizer
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer(path.parent, path.name, file_checksum([path]))
    return Tokenizer(path, None, "")
