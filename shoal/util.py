"""Small helpers every layer may use."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (blocks for a number of tokens)."""
    return -(-a // b)
