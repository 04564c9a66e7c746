"""How a model stretches RoPE past its training context: the parameters, as configs give
them (llama3 and YaRN). shoal/model/rope.py turns them into frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (None on a ModelConfig means plain RoPE)."""

    factor: float  # how much longer than the original context the model was tuned for
    low_freq_factor: float  # wavelengths above original/low_freq_factor are divided by factor
    high_freq_factor: float  # wavelengths below original/high_freq_factor are kept
    original_max_position_embeddings: int  # context length before scaling

    @classmethod
    def from_freq_factors(cls, factors: list[float], rope_theta: float,
                          head_dim: int) -> "RopeScaling | None":
        """The llama3 parameters that reproduce llama.cpp's per-frequency divisors (GGUF
        `rope_freqs`: frequency i is divided by factors[i]); None when every divisor is 1.

        llama.cpp bakes the scaling into that tensor and keeps no parameters. Only factor,
        original/low_freq_factor and original/high_freq_factor are observable (scaling the
        three together changes no frequency), so low_freq_factor is taken as 1, as in every
        Llama 3.x release; the rest is fitted on the smoothed band and then checked against
        every divisor. ValueError when no llama3 parameters reproduce them."""
        if len(factors) != head_dim // 2:
            raise ValueError(f"rope_freqs has {len(factors)} entries, expected head_dim/2 = "
                             f"{head_dim // 2}")
        if all(abs(f - 1) < 1e-6 for f in factors):
            return None
        wavelens = _wavelengths(rope_theta, head_dim)
        factor = max(factors)
        # In the band, 1/f = (1 - s)/factor + s, with s linear in 1/wavelen:
        #   s = original/(high - 1) * (1/wavelen) - 1/(high - 1)        (low_freq_factor = 1)
        band = [(1 / w, (1 / f - 1 / factor) / (1 - 1 / factor))
                for w, f in zip(wavelens, factors) if 1 + 1e-6 < f < factor * (1 - 1e-6)]
        if len(band) < 2:
            raise ValueError(f"rope_freqs has {len(band)} smoothed entries; at least 2 are "
                             "needed to recover its llama3 RoPE scaling")
        slope, intercept = _fit_line(band)
        if intercept >= 0 or slope <= 0:
            raise ValueError("rope_freqs is not a llama3 RoPE scaling (its smoothed band "
                             "does not grow with frequency)")
        high = 1 - 1 / intercept
        scaling = cls(factor=round(factor, 4), low_freq_factor=1.0,
                      high_freq_factor=round(high, 4),
                      original_max_position_embeddings=round(slope * (high - 1)))
        expected = scaling.freq_factors(rope_theta, head_dim)
        worst = max(abs(a - b) / b for a, b in zip(factors, expected))
        if worst > 1e-4:
            raise ValueError(f"rope_freqs is not a llama3 RoPE scaling (the closest, {scaling}, "
                             f"is off by {worst:.2g} relative)")
        return scaling

    def freq_factors(self, rope_theta: float, head_dim: int) -> list[float]:
        """llama.cpp's divisor per frequency [head_dim/2] (its converter's formula)."""
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        out = []
        for w in _wavelengths(rope_theta, head_dim):
            if w < high_wavelen:
                out.append(1.0)
            elif w > low_wavelen:
                out.append(self.factor)
            else:
                s = ((self.original_max_position_embeddings / w - self.low_freq_factor)
                     / (self.high_freq_factor - self.low_freq_factor))
                out.append(1 / ((1 - s) / self.factor + s))
        return out


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (DeepSeek-V2/V3): see shoal/model/rope.py for what each field does."""

    factor: float  # how much longer than the original context the model was tuned for
    original_max_position_embeddings: int
    beta_fast: float = 32.0  # rotation counts bounding the ramp between the original
    beta_slow: float = 1.0  # frequencies (fast dimensions) and the interpolated ones
    mscale: float = 1.0  # cos/sin scale: yarn_mscale(factor, mscale) / ...(mscale_all_dim)
    mscale_all_dim: float = 0.0  # also scales the softmax by yarn_mscale(..)^2 (0: not)
    attention_factor: float | None = None  # the cos/sin scale given outright
    truncate: bool = True  # the ramp's ends rounded out to whole dimensions

    @classmethod
    def from_hf(cls, rope: dict[str, Any], max_position_embeddings: int) -> "YarnScaling":
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor") or max_position_embeddings / original
        optional = {k: rope[k] for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                         "attention_factor", "truncate") if rope.get(k) is not None}
        return cls(factor=float(factor), original_max_position_embeddings=original, **optional)


def _wavelengths(rope_theta: float, head_dim: int) -> list[float]:
    return [2 * math.pi * rope_theta ** (i / head_dim) for i in range(0, head_dim, 2)]


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept through (x, y) points (at least two distinct x)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x, _ in points))
    return slope, my - slope * mx
