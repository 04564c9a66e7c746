"""Turns a ScheduledBatch into model inputs, runs the forward and samples.

Runs on the thread that executes steps (the caller's in the plain loop, a worker in the
overlap loop). Steps execute strictly in order, which is what lets a step read the
token a previous step sampled (`last_sampled`) before the scheduler has seen it.
"""

from __future__ import annotations

import torch

from shoal.kv.kv_cache import KVCache
from shoal.kv.kv_cache_manager import cdiv
from shoal.model.llama import AttentionMetadata, LlamaModel, PrefillSeq
from shoal.sampling import Sampler
from shoal.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.sampler = Sampler()
        self.last_sampled: dict[str, int] = {}  # request id -> its latest sampled token

    def execute(self, batch: ScheduledBatch, token_counts: list[int], layer_hooks=None) -> list[int]:
        """Run one step; returns one sampled token per sampling chunk, in chunk order.
        `token_counts`: every ADP owner's tokens in this forward (one entry without ADP).
        `layer_hooks` (the connector's worker hooks) are called around every layer."""
        input_ids, positions, meta, sample_rows = self._prepare(batch, token_counts)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, meta, self.kv_cache.layers, layer_hooks)
            logits = self.model.compute_logits(hidden[sample_rows])
        sampling = [c for c in batch.chunks if c.is_sampling]
        tokens = self.sampler.sample(logits, [c.request.request_id for c in sampling],
                                     [c.request.sampling for c in sampling])
        for chunk, token in zip(sampling, tokens):
            self.last_sampled[chunk.request.request_id] = token
        return tokens

    def forget(self, request_id: str) -> None:
        """Drop per-request state once a request can never be scheduled again."""
        self.last_sampled.pop(request_id, None)
        self.sampler.forget(request_id)

    def _prepare(self, batch: ScheduledBatch, token_counts: list[int]):
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        sample_rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        for chunk in batch.chunks:
            row = len(token_ids)
            ids = chunk.token_ids
            if chunk.num_placeholders:
                assert chunk.num_placeholders == 1, f"{chunk.num_placeholders} placeholders"
                ids = ids + [self.last_sampled[chunk.request.request_id]]
            end = chunk.start + chunk.num_tokens
            token_ids.extend(ids)
            positions.extend(range(chunk.start, end))
            slot_blocks.extend(chunk.block_ids[p // bs] for p in range(chunk.start, end))
            num_blocks = cdiv(end, bs)
            if chunk.num_tokens == 1:
                decode_rows.append(row)
                decode_tables.append(chunk.block_ids[:num_blocks])
                decode_lens.append(end)
            else:
                prefills.append(PrefillSeq(row, chunk.num_tokens, end, torch.tensor(
                    chunk.block_ids[:num_blocks], dtype=torch.long, device=self.device)))
            if chunk.is_sampling:
                sample_rows.append(row + chunk.num_tokens - 1)
        pos = torch.tensor(positions, dtype=torch.long)
        meta = AttentionMetadata(
            slot_block_ids=torch.tensor(slot_blocks, dtype=torch.long, device=self.device),
            slot_offsets=(pos % bs).to(self.device),
            decode_rows=None, decode_block_table=None, decode_mask=None,
            decode_context_len=max(decode_lens, default=0), prefills=prefills,
            dp_token_counts=token_counts)
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            table = [t + [0] * (width - len(t)) for t in decode_tables]  # pad with any block
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=self.device)
            meta.decode_block_table = torch.tensor(table, dtype=torch.long, device=self.device)
            if min(decode_lens) != max(decode_lens):
                lens = torch.tensor(decode_lens, device=self.device)
                keys = torch.arange(width * bs, device=self.device)
                meta.decode_mask = (keys.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
        return (torch.tensor(token_ids, dtype=torch.long, device=self.device),
                pos.to(self.device), meta,
                torch.tensor(sample_rows, dtype=torch.long, device=self.device))
