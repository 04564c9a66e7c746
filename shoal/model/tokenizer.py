"""Text <-> token ids and chat templates, through `transformers` tokenizers."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from shoal.model.presets import cache_dir

log = logging.getLogger(__name__)


class Tokenizer:
    """Thin wrapper, loaded on first use (token-id prompts never need it). GGUF tokenizers are
    converted once and cached as HF files."""

    def __init__(self, tokenizer_dir: Path, gguf_file: str | None, checksum: str):
        self._dir, self._gguf_file, self._checksum = tokenizer_dir, gguf_file, checksum
        self._loaded = None
        self._error: str | None = None  # why it could not be loaded
        # held by an encode through the transformers wrapper (a tokenizer with no Rust side);
        # every other call may run on many threads at once: the Rust side's settings are
        # fixed at load (`_tok`) and its decode only reads
        self._lock = threading.Lock()

    @property
    def _tok(self):
        if self._error is not None:  # a fresh one each time: an error kept with a traceback
            # keeps its frames alive, and their callers' (an engine being built or shut down)
            raise ValueError(self._error)
        if self._loaded is None:
            try:
                loaded = self._load()
            except ValueError as e:
                self._error = str(e)
                raise
            rust = getattr(loaded, "backend_tokenizer", None)
            if rust is not None:  # a file's truncation and padding off, once: the wrapper
                # turns them off in each of its calls, and `_ids` calls the Rust side itself
                rust.no_truncation()
                rust.no_padding()
            self._loaded = loaded
        return self._loaded

    @property
    def is_available(self) -> bool:
        """False for checkpoints without tokenizer files (token-id prompts still work)."""
        if self._error is not None:
            return False
        try:
            self._tok
        except ValueError:
            return False
        return True

    def _load(self):
        from transformers import AutoTokenizer

        if self._gguf_file is None:
            try:
                return AutoTokenizer.from_pretrained(str(self._dir))
            except (OSError, ValueError) as e:
                raise ValueError(f"model {self._dir} has no usable tokenizer ({e}); "
                                 "give prompts as token ids") from e
        converted = cache_dir() / "tokenizers" / self._checksum
        try:
            return AutoTokenizer.from_pretrained(str(converted))
        except (OSError, ValueError):
            tok = AutoTokenizer.from_pretrained(str(self._dir), gguf_file=self._gguf_file)
            partial = converted.with_name(f"{converted.name}.tmp-{os.getpid()}")
            try:
                tok.save_pretrained(str(partial))
                os.rename(partial, converted)  # whole directory or nothing for other processes
            except OSError as e:
                shutil.rmtree(partial, ignore_errors=True)
                if not converted.is_dir():
                    log.warning("could not cache the converted tokenizer in %s: %s", converted, e)
            return tok

    @property
    def hf(self):
        """The Hugging Face tokenizer itself (ValueError if the model has none)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._ids(text, add_special_tokens=True)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None
                            ) -> list[int]:
        """Token ids of a conversation followed by the assistant's generation prompt
        (`tools`: OpenAI-shaped function specs, for templates that render them)."""
        text = self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             tokenize=False)
        return self._ids(text, add_special_tokens=False)  # (the template has its own)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, as the HF tokenizer's encode gives them. Through the Rust
        tokenizer's batch call: that lets go of the GIL and changes no setting, so threads
        tokenize at once (a server's requests: an 8k-token prompt takes ~5-10 ms). A
        tokenizer with no Rust side goes through the wrapper, one call at a time."""
        tok = self._tok
        rust = getattr(tok, "backend_tokenizer", None)
        if rust is None:
            with self._lock:
                return tok.encode(text, add_special_tokens=add_special_tokens)
        return rust.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
