"""Shoal: a compact LLM inference engine with a persistent, shared KV pool."""

from shoal.llm import LLM
from shoal.request import RequestOutput
from shoal.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
