"""Shoal: a compact LLM inference engine with a persistent, shared KV pool."""

from shoal.llm import LLM
from shoal.request import RequestOutput
from shoal.sampling import SamplingParams
from shoal.structured_output import StructuredOutput
from shoal.version import __version__

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "RequestOutput", "__version__"]
