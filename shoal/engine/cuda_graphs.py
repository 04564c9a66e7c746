"""A step's inputs in one copy, and CUDA graphs for decode steps.

`StepInputs`: a step's integer arrays (token ids, positions, KV slots, the paged kernels'
tables) are written into one pinned host buffer and sent with one non-blocking copy; the
model reads device views of it. Steps are launched before the previous one finished, so
the host buffers alternate (`HostBuffers`): one is rewritten only once its last copy ran.

`DecodeGraphs`: a step whose chunks are all one-token decodes (the steady state) replays
a graph captured at start-up for the smallest batch size on a ladder that holds it. The
graph's inputs live in one device buffer per size; padded rows write their KV to a scratch
block no request owns, attend to nothing and are never sampled. Block tables are kept from
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

ALIGN = 16  # int32 elements: 64 bytes
BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


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


class _Graph:
    """One captured decode step for `size` rows: its input buffers and output logits."""

    # host layout: ids | positions | slot blocks | slot offsets | context lens | placeholder
    # rows | their sources | table rows (the vectors, `size` each), then the table entries
    # to write (flat indices, then block ids)
    NUM_VECTORS = 8

    def __init__(self, size: int, width: int, device: torch.device, scratch_block: int):
        self.size = size
        self.buffer = torch.zeros(self.NUM_VECTORS * size, dtype=torch.int32, device=device)
        (self.ids, self.positions, self.slot_blocks, self.slot_offsets, self.lens,
         self.fill_rows, self.sources, self.table_rows) = (self.buffer[i * size:(i + 1) * size]
                                                           for i in range(self.NUM_VECTORS))
        self.slot_blocks.fill_(scratch_block)
        self.table = torch.zeros(size, width, dtype=torch.int32, device=device)  # gathered
        self.scratch_block = scratch_block  # padded rows write it: no request owns it
        rows = torch.arange(size, dtype=torch.int32, device=device)
        self.meta = AttentionMetadata(
            self.slot_blocks, self.slot_offsets,
            PagedInputs(self.table, rows, torch.ones_like(rows), self.lens, 1))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def host_size(self, width: int) -> int:
        return self.NUM_VECTORS * self.size + 2 * self.size * width

    def fill(self, chunks, pinned: torch.Tensor, block_size: int, placeholders,
             table_rows: TableRows, staging: torch.Tensor) -> int:
        """Write a decode batch (len(chunks) <= size) through `pinned` (a host buffer of
        host_size) into the graph's input buffers, and the blocks its requests added into
        `table_rows` (through `staging`, a device buffer as large). Returns the number of
        placeholder rows (`fill_rows[:k]`, to be filled from `sources[:k]` on the device)."""
        n, size, bs = len(chunks), self.size, block_size
        host = pinned.numpy()
        ids, pos, blocks, offsets, lens, fill_rows, sources, rows = (
            host[i * size:(i + 1) * size] for i in range(self.NUM_VECTORS))
        pos[:n] = [c.start for c in chunks]
        ids[:n] = [c.token_ids[0] if c.token_ids else 0 for c in chunks]
        blocks[:n] = [c.block_ids[c.start // bs] for c in chunks]
        np.remainder(pos[:n], bs, out=offsets[:n])
        np.add(pos[:n], 1, out=lens[:n])
        rows[:n], indices, values = table_rows.place(chunks, bs)
        # padded rows (the buffer is shared by every size: stale otherwise): write the
        # scratch block, attend to nothing (through any table row)
        for vector, value in ((ids, 0), (pos, 0), (blocks, self.scratch_block), (offsets, 0),
                              (lens, 0), (rows, 0)):
            vector[n:] = value
        sampled_rows, srcs = placeholders(chunks)
        k = len(sampled_rows)
        fill_rows[:k], sources[:k] = sampled_rows, srcs
        # what travels: the vectors, and the table entries the step's requests added
        vectors, m = self.NUM_VECTORS * size, len(indices)
        host[vectors:vectors + m], host[vectors + m:vectors + 2 * m] = indices, values
        self.buffer.copy_(pinned[:vectors], non_blocking=True)
        if m:
            staging[:2 * m].copy_(pinned[vectors:vectors + 2 * m], non_blocking=True)
            table_rows.write(staging[:m], staging[m:2 * m])
        return k


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_batch_size: int, table_rows: TableRows):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.table_rows = table_rows  # the runner's: kept across every step
        self.width = table_rows.width
        device = kv_cache.tensor.device
        self.max_size = max_batch_size
        self._build_inputs(device)
        pool = None
        with torch.inference_mode():
            for size in sorted(self.graphs, reverse=True):  # the largest first: a shared pool
                g = self.graphs[size]
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    self._forward(g)
                torch.cuda.synchronize(device)
                g.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g.graph, pool=pool):
                    g.logits = self._forward(g)
                pool = g.graph.pool()
        torch.cuda.synchronize(device)

    def _build_inputs(self, device: torch.device) -> None:
        """Each size's input buffers, the host buffers and the device staging (shared)."""
        sizes = [s for s in BATCH_LADDER if s < self.max_size] + [self.max_size]
        self.graphs = {s: _Graph(s, self.width, device, self.kv_cache.scratch_block)
                       for s in sizes}
        size = self.graphs[self.max_size].host_size(self.width)
        self.host = HostBuffers(size, device)
        self.staging = torch.zeros(size, dtype=torch.int32, device=device)
        self.num_replays = 0

    def _forward(self, g: _Graph) -> torch.Tensor:
        torch.index_select(self.table_rows.table, 0, g.table_rows, out=g.table)
        hidden = self.model(g.ids, g.positions, g.meta, self.kv_cache.layers, None)
        return self.model.compute_logits(hidden)

    def can_replay(self, batch) -> bool:
        return (0 < len(batch.chunks) <= self.max_size
                and all(c.num_tokens == 1 and c.is_sampling for c in batch.chunks))

    def replay(self, batch, runner, layer_hooks=None) -> torch.Tensor:
        """Logits [rows, vocab] of a decode-only batch (rows in chunk order); `runner` (the
        ModelRunner) finds and fills the rows whose token the previous step sampled."""
        g = self.prepare(batch, runner)
        num_layers = len(self.kv_cache.layers)
        if layer_hooks is not None:
            for i in range(num_layers):
                layer_hooks.wait_for_layer_load(i)
        g.graph.replay()
        self.num_replays += 1
        if layer_hooks is not None:
            for i in range(num_layers):
                layer_hooks.save_kv_layer(i)
        return g.logits[:len(batch.chunks)]

    def prepare(self, batch, runner) -> _Graph:
        """The graph for `batch`, its inputs written and its placeholders filled."""
        n = len(batch.chunks)
        g = self.graphs[next(s for s in sorted(self.graphs) if s >= n)]
        k = g.fill(batch.chunks, self.host.take(), self.block_size, runner.placeholders,
                   self.table_rows, self.staging)
        self.host.sent()
        runner.fill_placeholders(g.ids, g.fill_rows[:k], g.sources[:k])
        return g
