"""Turns a ScheduledBatch into model inputs, runs the forward and samples.

Runs on the executing thread; steps execute strictly in order. `execute` only launches
(`SampledTokens`), and a chunk's trailing placeholder is filled on the device from the
previous step's samples, never from the host. One input layout (`StepRows`) for every
attention backend and path, CUDA graphs included (shoal.engine.cuda_graphs). See
docs/design.md, "A step" and "Attention on a GPU".
"""

from __future__ import annotations

import time

import torch

from shoal.engine.cuda_graphs import StepGraphs
from shoal.engine.step_inputs import StepInputs, StepRows
from shoal.engine.scheduler import ScheduledBatch, ScheduledChunk
from shoal.engine.table_rows import TableRows
from shoal.kv.kv_cache import KVCache
from shoal.util import HostCopy, cdiv
from shoal.model.llama import AttentionMetadata, LlamaModel, PagedInputs
from shoal.model.moe import SparseMoE
from shoal.request import Request
from shoal.sampling import Sampler, SamplingParams, TokenLogprobs, compute_logprobs


class SampledTokens(HostCopy):
    """One step's sampled token ids on their way to the host: the copy is queued behind the
    step's forward, so `tolist()` waits for that step only."""


NO_TOKENS = SampledTokens(torch.empty(0, dtype=torch.int32))
PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits are computed at once


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, max_model_len: int,
                 max_batch_size: int, enforce_eager: bool = True, max_num_tokens: int = 0):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.tensor.device
        self.block_size = kv_cache.layout.block_size
        self.sampler = Sampler()
        # the previous step's samples, on the device, and each sampled request's row in them
        self._prev_tokens = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._prev_rows: dict[str, int] = {}
        self._logprobs: list[TokenLogprobs | None] | None = None  # the last execute's, if asked
        self._prompt_logprobs: list[tuple[str, int, TokenLogprobs]] = []  # (rid, position, lp)
        # block-table columns: no request grows past the context or the whole cache
        max_len = min(max_model_len, kv_cache.layout.num_blocks * self.block_size)
        self.table_width = cdiv(max_len, self.block_size)
        # every running request's row (room for two full batches: one leaving, one joining)
        self.table_rows = TableRows(2 * max_batch_size, self.table_width, self.device)
        self._inputs = StepInputs(self.device)
        self.replayed = False  # the last execute replayed a graph
        if self.is_paged:
            self._warm_up()
        self.graphs = (StepGraphs(model, kv_cache, max_batch_size, max_num_tokens, self.table_rows)
                       if self.is_paged and not enforce_eager and model.shard.size == 1 else None)

    @property
    def is_paged(self) -> bool:
        """The model attends with the Triton kernels (warm-up and CUDA graphs apply)."""
        return self.model.backend.paged

    def execute(self, batch: ScheduledBatch, token_counts: list[int],
                layer_hooks=None, eager: bool = False) -> SampledTokens:
        """Launch one step; returns one sampled token per sampling chunk, in chunk order.
        `token_counts`: every ADP owner's tokens in this forward (one entry without ADP).
        `layer_hooks`: the connector's worker hooks, called around every layer. `eager`: no
        graph replay."""
        sampling = batch.sampled
        with torch.inference_mode():
            graph = None if eager or self.graphs is None else self.graphs.graph_for(batch)
            self.replayed = graph is not None
            if self.replayed:
                logits = self.graphs.replay(graph, batch, self, layer_hooks)
            else:
                input_ids, positions, meta, sample_rows = self._prepare(batch, token_counts)
                hidden = self.model(input_ids, positions, meta, self.kv_cache.layers, layer_hooks)
                logits = self.model.compute_logits(hidden[sample_rows])
                self._prompt_logprobs = self._of_prompts(batch, hidden)
            tokens = self.sampler.sample_on_device(logits, sampling).int()
        self._prev_tokens = tokens
        self._prev_rows = {req.request_id: row for row, req in enumerate(sampling)}
        sampled = SampledTokens(tokens)
        if any(req.sampling.logprobs is not None for req in sampling):  # only those that asked
            num_top = [req.sampling.logprobs for req in sampling]
            self._logprobs = compute_logprobs(logits, sampled.tolist(), num_top)
        return sampled

    def time_prefill(self, num_tokens: int, context: int = 0) -> tuple[float, float]:
        """Seconds one eager prefill forward of `num_tokens` tokens after `context` cached
        ones takes, and of those the host's launching it (0 on a CPU, where the launch is
        the work). Run at bring-up; its KV (and its context's) is the scratch block's."""
        probe = Request("shoal-bring-up-prefill", [1] * (context + num_tokens),
                        SamplingParams(max_tokens=1), frozenset())
        scratch = [self.kv_cache.scratch_block] * cdiv(context + num_tokens, self.block_size)
        chunk = ScheduledChunk(probe, context, num_tokens, [1] * num_tokens, 0, scratch, True, 0)
        batch = ScheduledBatch([chunk], num_tokens)
        start = time.perf_counter()
        sampled = self.execute(batch, [num_tokens], eager=True)
        launch = time.perf_counter() - start if self.device.type == "cuda" else 0.0
        sampled.tolist()
        seconds = time.perf_counter() - start
        self.forget(probe.request_id)
        self._prev_rows = {}
        return seconds, launch

    def _of_prompts(self, batch: ScheduledBatch, hidden: torch.Tensor) -> list:
        """(request id, position, TokenLogprobs) of the prompt tokens whose predicting row
        this step computed, for the requests that asked (row p's logits give token p+1's);
        in slices, so a long prompt's logits never sit in memory whole."""
        asked = []  # (row, the token it predicts, request id, that token's position, top k)
        row = 0
        for chunk in batch.chunks:
            req = chunk.request
            k = req.sampling.prompt_logprobs
            if k is not None:
                last = min(chunk.start + chunk.num_tokens, len(req.prompt_token_ids) - 1)
                asked += [(row + p - chunk.start, req.prompt_token_ids[p + 1], req.request_id,
                           p + 1, k) for p in range(chunk.start, last)]
            row += chunk.num_tokens
        out = []
        for i in range(0, len(asked), PROMPT_LOGPROBS_ROWS):
            rows, targets, rids, positions, num_top = zip(*asked[i:i + PROMPT_LOGPROBS_ROWS])
            logits = self.model.compute_logits(hidden.index_select(
                0, torch.tensor(rows, device=hidden.device)))
            out += zip(rids, positions, compute_logprobs(logits, targets, num_top))
        return out

    def take_logprobs(self) -> tuple[list[TokenLogprobs | None] | None,
                                     list[tuple[str, int, TokenLogprobs]]]:
        """The last `execute`'s logprobs, cleared by the call: of its samples (None where not
        asked; None if none asked), and of its prompts ((request id, position, lp) each)."""
        out = self._logprobs, self._prompt_logprobs
        self._logprobs, self._prompt_logprobs = None, []
        return out

    def _warm_up(self) -> None:
        """Compile the Triton kernels of attention and of the MoE (each tile size) now, not
        in the first request that needs one: the graphs' capture reaches only some, and an
        eager engine or a TP or ADP rank captures none."""
        moe = next((layer.mlp for layer in self.model.layers
                    if isinstance(layer.mlp, SparseMoE)), None)  # (DeepSeek's first are dense)
        with torch.inference_mode():
            self.model.layers[0].self_attn.warm_up(*self.kv_cache.layers[0],
                                                   self.kv_cache.scratch_block)
            if moe is not None:
                moe.warm_up()

    def forget(self, request_id: str) -> None:
        """Drop per-request state once a request can never be scheduled again."""
        self.sampler.forget(request_id)
        self.table_rows.release(request_id)

    def rows(self, batch: ScheduledBatch) -> StepRows:
        """The step's host arrays (every path's); places its requests' block-table rows."""
        return StepRows.of(batch.chunks, self.block_size, self._prev_rows, self.table_rows)

    def fill_placeholders(self, input_ids: torch.Tensor, rows: torch.Tensor,
                          sources: torch.Tensor) -> None:
        """input_ids[rows] = the previous step's samples[sources], on the device."""
        if rows.numel():
            input_ids.index_copy_(0, rows.to(torch.long), self._prev_tokens.index_select(
                0, sources.to(torch.long)).to(input_ids.dtype))

    def _prepare(self, batch: ScheduledBatch, token_counts: list[int]):
        """The step's inputs, for every backend, in one copy (`StepInputs`); the block table
        gathered from the rows kept across steps."""
        r = self.rows(batch)
        (input_ids, positions, slot_blocks, slot_offsets, starts, lens, ctxs, table_rows,
         indices, values, sample_rows, fill_rows, sources) = self._inputs.send([
            r.ids, r.positions, r.slot_blocks, r.slot_offsets, r.starts, r.lens, r.ctxs,
            r.table_rows, r.table_indices, r.table_values, r.sample_rows, r.fill_rows, r.sources])
        if r.table_indices.size:
            self.table_rows.write(indices, values)
        host = r.starts.tolist(), r.lens.tolist(), r.ctxs.tolist()
        cols = cdiv(max(host[2], default=1), self.block_size)  # the columns any request reads
        table = self.table_rows.table[:, :cols].index_select(0, table_rows)
        self.fill_placeholders(input_ids, fill_rows, sources)
        paged = PagedInputs(table, starts, lens, ctxs, max(host[1], default=1), host)
        meta = AttentionMetadata(slot_blocks, slot_offsets, paged, token_counts)
        return input_ids, positions, meta, sample_rows.long()
