"""Rotary position embedding: the frequency table of a model, and applying it to q and k.

Three kinds of frequencies, as `ModelConfig.rope_scaling` says:
- plain RoPE: theta^(-2i/d);
- llama3 (`RopeScaling`): long wavelengths divided by `factor`, short ones kept, a smooth
  band in between;
- YaRN (`YarnScaling`, DeepSeek-V2/V3): each frequency a blend of the original and the
  interpolated one (divided by `factor`), by a ramp over the dimensions between the
  `beta_fast` and `beta_slow` rotation counts; cos and sin are multiplied by an attention
  factor, and MLA also scales the softmax (`softmax_scale`).

Two layouts of the rotated dimensions: halves (Llama: dimension i pairs with i + d/2) and
interleaved pairs (DeepSeek: 2i with 2i + 1). The interleaved rotation writes its output
in halves (evens, then odds): q and k are permuted alike, so their dot product is the same.
"""

from __future__ import annotations

import math

import torch

from shoal.model.config import ModelConfig
from shoal.model.rope_scaling import RopeScaling, YarnScaling


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] of the model's rotary dimensions (on the CPU, also
    inside a `torch.device` context: an op on the meta device imports torch._dynamo, which
    costs a process about 1.8 s)."""
    dim = cfg.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (cfg.rope_theta ** (steps / dim))
    s = cfg.rope_scaling
    if isinstance(s, YarnScaling):
        return _yarn(inv_freq, cfg.rope_theta, dim, s)
    if isinstance(s, RopeScaling):
        return _llama3(inv_freq, s)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, theta: float, dim: int, s: YarnScaling) -> torch.Tensor:
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp would divide by zero
    dims = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast dimensions), 0: interpolated
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
    s = cfg.rope_scaling
    if not isinstance(s, YarnScaling):
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def softmax_scale(cfg: ModelConfig, qk_head_dim: int) -> float:
    """The attention logits' scale: 1/sqrt(d), times YaRN's mscale_all_dim correction
    squared where the model has one (DeepSeek scales every dimension, not only the rotary)."""
    scale = qk_head_dim ** -0.5
    s = cfg.rope_scaling
    if isinstance(s, YarnScaling) and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    """x [T, H, d] rotated by cos/sin [T, d] (both halves of the table hold the same angles).
    Interleaved: pairs (2i, 2i+1), written back as (all evens, all odds)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if not interleaved:
        return x * cos + rotate_half(x) * sin
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
