"""A step's inputs in one copy, and CUDA graphs for decode steps and short prefill chunks.

`StepInputs`: a step's integer arrays (token ids, positions, KV slots, the paged kernels'
tables) are written into one pinned host buffer and sent with one non-blocking copy; the
model reads device views of it. Steps are launched before the previous one finished, so
the host buffers alternate (`HostBuffers`): one is rewritten only once its last copy ran.

`StepGraphs`: a step whose chunks are all one-token decodes (the steady state) replays
a graph captured at start-up for the smallest batch size on a ladder that holds it; a step
of one request's short chunk (up to 512 tokens: launch-bound on a GPU) replays one
captured for the smallest chunk length that holds it. A graph's inputs live in one device
buffer; padded rows write their KV to a scratch block no request owns, attend to nothing
and are never sampled. Block tables are kept from
step to step (`TableRows`: a request's row is written once, then only its new blocks); the
graph gathers its rows of them as its first op. Connector layer hooks
cannot run inside a replay: they are called for every layer before (loads waited for) and
after it (saves enqueued), which the contract allows. One rank only (no collectives in a
captured graph).
"""

from __future__ import annotations

import numpy as np
import torch

from shoal.engine.table_rows import TableRows
from shoal.util import cdiv
from shoal.model.llama import AttentionMetadata, PagedInputs
from shoal.model.paged_attention import PREFILL_TILE, prefill_parts

ALIGN = 16  # int32 elements: 64 bytes
BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
PREFILL_LADDER = (16, 32, 64, 128, 256, 512)  # one request's chunk: tokens


class HostBuffers:
    """Two int32 host buffers (pinned for a GPU) used in turn for host-to-device copies:
    `take()` returns the next one once the copy last sent from it has run; `sent()` marks
    the copy from it just queued."""

    def __init__(self, size: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.size = size
        self._buffers = [torch.zeros(size, dtype=torch.int32, pin_memory=self.cuda)
                         for _ in range(2)]
        # an event not yet recorded counts as done: synchronize() returns at once
        self._events = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self._turn = 0

    def take(self) -> torch.Tensor:
        self._turn ^= 1
        if self._events is not None:
            self._events[self._turn].synchronize()
        return self._buffers[self._turn]

    def sent(self) -> None:
        if self._events is not None:
            self._events[self._turn].record()


class StepInputs:
    def __init__(self, device: torch.device):
        self.device = device
        self._host = HostBuffers(0, device)
        self._dev = torch.empty(0, dtype=torch.int32, device=device)

    def send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device int32 views of `arrays` (1-D or 2-D), sent in one copy. Each view starts
        on a 64-byte boundary: Triton specializes a kernel on its pointers' alignment, and a
        view at a step-dependent offset would compile new variants mid-request."""
        starts, total = [], 0
        for a in arrays:
            starts.append(total)
            total += cdiv(a.size, ALIGN) * ALIGN
        if total > self._host.size:
            size = max(total, 2 * self._host.size, 1 << 16)
            if self._host.cuda:  # the old buffers' last copies
                torch.cuda.synchronize(self.device)
            self._host = HostBuffers(size, self.device)
            self._dev = torch.empty(size, dtype=torch.int32, device=self.device)
        pinned = self._host.take()
        host = pinned.numpy()
        for a, start in zip(arrays, starts):
            host[start:start + a.size] = a.reshape(-1)
        self._dev[:total].copy_(pinned[:total], non_blocking=True)
        self._host.sent()
        return [self._dev[start:start + a.size].view(a.shape) for a, start in zip(arrays, starts)]


def chunk_rows(chunk, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A chunk's rows of the step: (token ids, its placeholders as 0; positions; the block
    holding each position's KV slot)."""
    end = chunk.start + chunk.num_tokens
    pos = np.arange(chunk.start, end, dtype=np.int32)
    first = chunk.start // block_size  # the chunk's own blocks only
    blocks = np.asarray(chunk.block_ids[first:cdiv(end, block_size)], dtype=np.int32)
    ids = np.asarray(chunk.token_ids + [0] * chunk.num_placeholders, np.int32)
    return ids, pos, blocks[pos // block_size - first]


class _Graph:
    """One captured step of `tokens` rows and its output logits. A decode graph: `tokens`
    requests of one row each. A prefill graph: one request's chunk of up to `tokens` rows,
    and the rows past it a second request with no context (they attend to nothing: zeros,
    as a decode graph's padded rows)."""

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
        self._starts = [sum(cdiv(n, ALIGN) * ALIGN for n in self._lengths[:i])
                        for i in range(len(self._lengths) + 1)]
        self.buffer = torch.zeros(self._starts[-1], dtype=torch.int32, device=device)
        (self.ids, self.positions, self.slot_blocks, self.slot_offsets, starts, query_lens,
         ctxs, self.table_rows, self.samples, self.fill_rows, self.sources) = self._vectors(
            self.buffer)
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

    def fill(self, chunks, pinned: torch.Tensor, block_size: int, placeholders,
             table_rows: TableRows, staging: torch.Tensor) -> int:
        """Write a batch this graph holds through `pinned` (a host buffer of host_size) into
        the graph's input buffers, and the blocks its requests added into `table_rows`
        (through `staging`, a device buffer as large). Returns the number of placeholder
        rows (`fill_rows[:k]`, to be filled from `sources[:k]` on the device)."""
        t, s, bs = self.size, self.seqs, block_size
        host = pinned.numpy()
        (ids, pos, blocks, offsets, starts, query_lens, ctxs, rows, samples, fill_rows,
         sources) = self._vectors(host)
        if self.decode:  # a row per request, each one position deep
            n = len(chunks)
            pos[:n] = [c.start for c in chunks]
            ids[:n] = [c.token_ids[0] if c.token_ids else 0 for c in chunks]
            blocks[:n] = [c.block_ids[c.start // bs] for c in chunks]
            starts[:] = samples[:] = np.arange(s, dtype=np.int32)
            query_lens[:] = 1
            np.add(pos[:n], 1, out=ctxs[:n])
            ctxs[n:] = 0  # padded rows attend to nothing
        else:  # one chunk, then the padding rows as a request with no context
            (chunk,) = chunks
            n = chunk.num_tokens
            ids[:n], pos[:n], blocks[:n] = chunk_rows(chunk, bs)
            starts[:], query_lens[:] = (0, n), (n, t - n)
            ctxs[:] = chunk.start + n, 0
            samples[:] = n - 1
        np.remainder(pos[:n], bs, out=offsets[:n])
        rows[:len(chunks)], indices, values = table_rows.place(chunks, bs)
        # padded rows (the host buffer is shared by every graph: stale otherwise): write
        # the scratch block (through any table row)
        for vector, value in ((ids, 0), (pos, 0), (blocks, self.scratch_block), (offsets, 0)):
            vector[n:] = value
        rows[len(chunks):] = 0
        sampled_rows, srcs = placeholders(chunks)
        k = len(sampled_rows)
        fill_rows[:k], sources[:k] = sampled_rows, srcs
        # what travels: the vectors, and the table entries the step's requests added
        vectors, m = self._starts[-1], len(indices)
        host[vectors:vectors + m], host[vectors + m:vectors + 2 * m] = indices, values
        self.buffer.copy_(pinned[:vectors], non_blocking=True)
        if m:
            staging[:2 * m].copy_(pinned[vectors:vectors + 2 * m], non_blocking=True)
            table_rows.write(staging[:m], staging[m:2 * m])
        return k


class StepGraphs:
    """The runner's CUDA graphs: decode steps by batch size (BATCH_LADDER), and one
    request's short prefill chunk by its length (PREFILL_LADDER, not for MLA, whose
    prefill loops over requests on the host). A short chunk's forward is launch-bound
    (64 tokens of Llama-8B over an 8k context: ~9 ms of GPU work behind ~350 launches):
    the rest of a prompt after a pool hit, or a new turn after a prefix hit."""

    def __init__(self, model, kv_cache, max_batch_size: int, max_num_tokens: int,
                 table_rows: TableRows):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.table_rows = table_rows  # the runner's: kept across every step
        self.width = table_rows.width
        device = kv_cache.tensor.device
        self.max_size = max_batch_size
        self._build_inputs(device, max_num_tokens, not model.cfg.is_mla)
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

    def _build_inputs(self, device: torch.device, max_num_tokens: int, prefill: bool) -> None:
        """Each graph's input buffers, the host buffers and the device staging (shared)."""
        self.decode_sizes = [s for s in BATCH_LADDER if s < self.max_size] + [self.max_size]
        scratch = self.kv_cache.scratch_block
        self.graphs = {("decode", s): _Graph(s, True, self.width, device, scratch)
                       for s in self.decode_sizes}
        self.max_prefill = 0
        if prefill:
            heads = self.model.layers[0].self_attn.num_heads
            for t in (t for t in PREFILL_LADDER if t <= max_num_tokens):
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
        if 0 < len(chunks) <= self.max_size and all(c.num_tokens == 1 and c.is_sampling
                                                   for c in chunks):
            return self.graphs["decode", next(s for s in self.decode_sizes if s >= len(chunks))]
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
        num_layers = len(self.kv_cache.layers)
        if layer_hooks is not None:
            for i in range(num_layers):
                layer_hooks.wait_for_layer_load(i)
        g.graph.replay()
        self.num_replays += 1
        self.num_prefill_replays += not g.decode
        if layer_hooks is not None:
            for i in range(num_layers):
                layer_hooks.save_kv_layer(i)
        return g.logits[:sum(c.is_sampling for c in batch.chunks)]

    def prepare(self, g: _Graph, batch, runner) -> None:
        """`batch` written into its graph's inputs, its placeholders filled."""
        k = g.fill(batch.chunks, self.host.take(), self.block_size, runner.placeholders,
                   self.table_rows, self.staging)
        self.host.sent()
        runner.fill_placeholders(g.ids, g.fill_rows[:k], g.sources[:k])
