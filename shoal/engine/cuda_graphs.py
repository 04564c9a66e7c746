"""CUDA graphs for decode steps and one request's short prefill chunks (`StepGraphs`).

A replay's inputs are the eager forward's (`StepRows`), copied into the graph's padded
layout; padded rows write a scratch block no request owns and are never sampled. Connector
layer hooks cannot run inside a replay: they run for every layer before and after it. One
rank only (no collectives in a captured graph). docs/design.md, "Attention on a GPU".
"""

from __future__ import annotations

import numpy as np
import torch

from shoal.engine.step_inputs import StepRows, aligned_starts
from shoal.engine.table_rows import TableRows
from shoal.util import HostBuffers, cdiv
from shoal.model.llama import AttentionMetadata, PagedInputs
from shoal.model.mla import ABSORBED_MAX_QUERY
from shoal.model.paged_attention import PREFILL_TILE, prefill_parts

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
PREFILL_LADDER = (16, 32, 64, 128, 256, 512)  # one request's chunk: tokens


class _Graph:
    """One captured step of `tokens` rows and its logits. Decode: `tokens` requests of one row
    each. Prefill: one request's chunk of up to `tokens` rows, the rows past it a second
    request with no context (they attend to nothing, as a decode graph's padded rows)."""

    # host layout: ids | positions | slot blocks | slot offsets (`tokens` each), then query
    # starts | query lens | context lens | table rows | sampled rows | placeholder rows |
    # their sources (`seqs` each), each from a 64-byte boundary (as StepInputs: no kernel
    # variant per alignment); then the table entries to write (flat indices, block ids)
    TOKEN_VECTORS, SEQ_VECTORS = 4, 7

    def __init__(self, tokens: int, decode: bool, width: int, device: torch.device,
                 scratch_block: int, parts: int | None = None):
        self.size, self.decode = tokens, decode
        self.seqs = tokens if decode else 2
        self._lengths = [tokens] * self.TOKEN_VECTORS + [self.seqs] * self.SEQ_VECTORS
        self._starts = aligned_starts(self._lengths)
        self.buffer = torch.zeros(self._starts[-1], dtype=torch.int32, device=device)
        (self.ids, self.positions, self.slot_blocks, self.slot_offsets, starts, query_lens, ctxs,
         self.table_rows, self.samples, self.fill_rows, self.sources) = self._vectors(self.buffer)
        self.slot_blocks.fill_(scratch_block)
        self.table = torch.zeros(self.seqs, width, dtype=torch.int32, device=device)  # gathered
        self.scratch_block = scratch_block  # padded rows write it: no request owns it
        self.meta = AttentionMetadata(self.slot_blocks, self.slot_offsets, PagedInputs(
            self.table, starts, query_lens, ctxs, 1 if decode else tokens, parts=parts))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _vectors(self, buffer):
        """The layout's vectors, as views of `buffer` (the device's or a host's)."""
        return [buffer[start:start + n] for start, n in zip(self._starts, self._lengths)]

    def host_size(self, width: int) -> int:
        return self._starts[-1] + 2 * self.seqs * width

    def fill(self, rows: StepRows, pinned: torch.Tensor, table_rows: TableRows,
             staging: torch.Tensor) -> int:
        """Write a batch's arrays (`rows`; a batch this graph holds) through `pinned` (a host
        buffer of host_size) into the graph's input buffers, and the blocks its requests
        added into `table_rows` (through `staging`, a device buffer as large). Returns k, the
        placeholder rows (`fill_rows[:k]`, filled from `sources[:k]` on the device)."""
        t, s = self.size, self.seqs
        host = pinned.numpy()
        (ids, pos, blocks, offsets, starts, query_lens, ctxs, table, samples, fill_rows,
         sources) = self._vectors(host)
        n, c = rows.ids.size, rows.lens.size  # real rows and sequences; the rest is padding
        assert n <= t and c <= s, f"{n} rows, {c} sequences in a graph of {t}, {s}"
        # padded rows write the scratch block (through any table row) and attend to nothing
        # (the host buffer is shared by every graph: stale otherwise)
        for vector, real, pad in ((ids, rows.ids, 0), (pos, rows.positions, 0),
                                  (blocks, rows.slot_blocks, self.scratch_block),
                                  (offsets, rows.slot_offsets, 0), (ctxs, rows.ctxs, 0),
                                  (table, rows.table_rows, 0)):
            vector[:real.size], vector[real.size:] = real, pad
        if self.decode:  # a row per request, each one position deep (every one sampled)
            starts[:] = samples[:] = np.arange(s, dtype=np.int32)
            query_lens[:] = 1
        else:  # one chunk, then the padding rows as a request with no context
            starts[:], query_lens[:] = (0, n), (n, t - n)
            samples[:] = n - 1
        k = rows.fill_rows.size
        fill_rows[:k], sources[:k] = rows.fill_rows, rows.sources
        # what travels: the vectors, and the table entries the step's requests added
        vectors, m = self._starts[-1], rows.table_indices.size
        host[vectors:vectors + m] = rows.table_indices
        host[vectors + m:vectors + 2 * m] = rows.table_values
        self.buffer.copy_(pinned[:vectors], non_blocking=True)
        if m:
            staging[:2 * m].copy_(pinned[vectors:vectors + 2 * m], non_blocking=True)
            table_rows.write(staging[:m], staging[m:2 * m])
        return k


class StepGraphs:
    """The runner's CUDA graphs: decode steps by batch size (BATCH_LADDER), and one request's
    short, launch-bound prefill chunk (the rest of a prompt after a pool or prefix hit) by
    its length (PREFILL_LADDER; for MLA up to mla.ABSORBED_MAX_QUERY tokens, the chunks it
    attends as decode rows: a longer one loops over requests on the host)."""

    def __init__(self, model, kv_cache, max_batch_size: int, max_num_tokens: int,
                 table_rows: TableRows):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.table_rows = table_rows  # the runner's: kept across every step
        self.width = table_rows.width
        device = kv_cache.tensor.device
        self.max_size = max_batch_size
        self._build_inputs(device, max_num_tokens)
        pool = None
        with torch.inference_mode():  # the largest first: a shared pool
            for g in sorted(self.graphs.values(), key=lambda g: g.size, reverse=True):
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    self._forward(g)
                torch.cuda.synchronize(device)
                g.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g.graph, pool=pool):
                    g.logits = self._forward(g)
                pool = g.graph.pool()
        torch.cuda.synchronize(device)

    def _build_inputs(self, device: torch.device, max_num_tokens: int) -> None:
        """Each graph's input buffers, the host buffers and the device staging (shared)."""
        self.decode_sizes = [s for s in BATCH_LADDER if s < self.max_size] + [self.max_size]
        scratch = self.kv_cache.scratch_block
        self.graphs = {("decode", s): _Graph(s, True, self.width, device, scratch)
                       for s in self.decode_sizes}
        self.max_prefill = 0
        is_mla = self.model.cfg.is_mla  # (its chunks in graphs: those it attends absorbed)
        longest = min(max_num_tokens, ABSORBED_MAX_QUERY) if is_mla else max_num_tokens
        heads = self.model.layers[0].self_attn.num_heads
        for t in (t for t in PREFILL_LADDER if t <= longest):
            parts = prefill_parts(device, cdiv(t, PREFILL_TILE) * heads,
                                  self.width * self.block_size)
            self.graphs["prefill", t] = _Graph(t, False, self.width, device, scratch, parts)
            self.max_prefill = t
        size = max(g.host_size(self.width) for g in self.graphs.values())
        self.host = HostBuffers(size, device)
        self.staging = torch.zeros(size, dtype=torch.int32, device=device)
        self.num_replays = self.num_prefill_replays = 0

    def _forward(self, g: _Graph) -> torch.Tensor:
        torch.index_select(self.table_rows.table, 0, g.table_rows, out=g.table)
        hidden = self.model(g.ids, g.positions, g.meta, self.kv_cache.layers, None)
        return self.model.compute_logits(hidden if g.decode else hidden.index_select(0, g.samples))

    def graph_for(self, batch) -> _Graph | None:
        """The graph that replays `batch` (None: it runs eagerly)."""
        chunks = batch.chunks
        # decodes only, a token each and every one sampled (a chunk has at least one token,
        # and num_tokens is their sum)
        n = len(chunks)
        if 0 < n <= self.max_size and batch.num_tokens == n == len(batch.sampled):
            return self.graphs["decode", next(s for s in self.decode_sizes if s >= n)]
        if (len(chunks) == 1 and 1 < chunks[0].num_tokens <= self.max_prefill
                and chunks[0].request.sampling.prompt_logprobs is None):
            return self.graphs["prefill", next(t for t in PREFILL_LADDER
                                               if t >= chunks[0].num_tokens)]
        return None

    def replay(self, g: _Graph, batch, runner, layer_hooks=None) -> torch.Tensor:
        """Logits [sampled rows, vocab] of `batch` from its graph `g` (`graph_for`; rows in
        chunk order); `runner` (the ModelRunner) finds and fills the rows whose token the
        previous step sampled."""
        self.prepare(g, batch, runner)
        # the connector's layer hooks, run for every layer before and after the replay
        hooked = range(len(self.kv_cache.layers)) if layer_hooks is not None else ()
        for i in hooked:
            layer_hooks.wait_for_layer_load(i)
        g.graph.replay()
        self.num_replays += 1
        self.num_prefill_replays += not g.decode
        for i in hooked:
            layer_hooks.save_kv_layer(i)
        return g.logits[:len(batch.sampled)]

    def prepare(self, g: _Graph, batch, runner) -> None:
        """`batch` written into its graph's inputs, its placeholders filled."""
        k = g.fill(runner.rows(batch), self.host.take(), self.table_rows, self.staging)
        self.host.sent()
        runner.fill_placeholders(g.ids, g.fill_rows[:k], g.sources[:k])
