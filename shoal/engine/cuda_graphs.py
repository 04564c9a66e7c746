"""A step's inputs in one copy, and CUDA graphs for decode steps.

`StepInputs`: a step's integer arrays (token ids, positions, KV slots, the paged kernels'
tables) are written into one pinned host buffer and sent with one non-blocking copy; the
model reads device views of it. (The buffer is rewritten only after the step's sampled
tokens came back to the host, so the previous copy has finished by then.)

`DecodeGraphs`: a step whose chunks are all one-token decodes (the steady state) replays
a graph captured at start-up for the smallest batch size on a ladder that holds it. The
graph's inputs live in one device buffer per size; padded rows write their KV to a scratch
block no request owns, attend to nothing and are never sampled. Connector layer hooks
cannot run inside a replay: they are called for every layer before (loads waited for) and
after it (saves enqueued), which the contract allows. One rank only (no collectives in a
captured graph).
"""

from __future__ import annotations

import numpy as np
import torch

from shoal.model.llama import AttentionMetadata, PagedInputs

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class StepInputs:
    def __init__(self, device: torch.device):
        self.device = device
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=device)

    def send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device int32 views of `arrays` (1-D or 2-D), sent in one copy."""
        total = sum(a.size for a in arrays)
        if total > self._host.numel():
            size = max(total, 2 * self._host.numel(), 1 << 16)
            self._host = torch.empty(size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._dev = torch.empty(size, dtype=torch.int32, device=self.device)
        host = self._host.numpy()
        offset = 0
        for a in arrays:
            host[offset:offset + a.size] = a.reshape(-1)
            offset += a.size
        self._dev[:total].copy_(self._host[:total], non_blocking=True)
        views, offset = [], 0
        for a in arrays:
            views.append(self._dev[offset:offset + a.size].view(a.shape))
            offset += a.size
        return views


class _Graph:
    """One captured decode step for `size` rows: its input buffers and output logits."""

    def __init__(self, size: int, width: int, device: torch.device, scratch_block: int):
        self.size = size
        pinned = device.type == "cuda"
        # ids | positions | slot blocks | slot offsets | context lens, then a compact table
        self.host = torch.zeros(5 * size + size * width, dtype=torch.int32, pin_memory=pinned)
        self.buffer = torch.zeros(5 * size, dtype=torch.int32, device=device)
        self.ids, self.positions, self.slot_blocks, self.slot_offsets, self.lens = (
            self.buffer[i * size:(i + 1) * size] for i in range(5))
        self.table = torch.zeros(size, width, dtype=torch.int32, device=device)
        self.staging = torch.zeros(size * width, dtype=torch.int32, device=device)
        self.scratch_block = scratch_block  # padded rows write it: no request owns it
        self.host[2 * size:3 * size] = scratch_block
        self.buffer.copy_(self.host[:5 * size])
        rows = torch.arange(size, dtype=torch.int32, device=device)
        self.meta = AttentionMetadata(
            self.slot_blocks, self.slot_offsets, None, None, None, 0, [],
            paged=PagedInputs(self.table, rows, torch.ones_like(rows), self.lens, 1))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def fill(self, chunks, token_ids_of, block_size: int) -> None:
        """Write a decode batch (len(chunks) <= size) into the graph's input buffers."""
        n, size, bs = len(chunks), self.size, block_size
        cols = max(c.start // bs + 1 for c in chunks)  # table columns any row reads
        host = self.host.numpy()
        ids, pos, blocks, offsets, lens = (host[i * size:i * size + n] for i in range(5))
        table = host[5 * size:5 * size + n * cols].reshape(n, cols)
        pos[:] = [c.start for c in chunks]
        ids[:] = [token_ids_of(c)[0] for c in chunks]
        blocks[:] = [c.block_ids[c.start // bs] for c in chunks]
        np.remainder(pos, bs, out=offsets)
        np.add(pos, 1, out=lens)
        for row, c in zip(table, chunks):  # entries past a row's own blocks are never read
            used = c.block_ids[:c.start // bs + 1]
            row[:len(used)] = used
        # padded rows (stale from an earlier, larger batch otherwise): write the scratch
        # block, attend to nothing
        host[2 * size + n:3 * size] = self.scratch_block
        host[4 * size + n:5 * size] = 0
        # only what the step reads travels: the vectors, and an n x cols table placed into
        # the graph's wide one on the device (its other entries are never read)
        self.buffer.copy_(self.host[:5 * size], non_blocking=True)
        self.staging[:n * cols].copy_(self.host[5 * size:5 * size + n * cols], non_blocking=True)
        self.table[:n, :cols].copy_(self.staging[:n * cols].view(n, cols))


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_batch_size: int, table_width: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.width = table_width
        device = kv_cache.tensor.device
        sizes = [s for s in BATCH_LADDER if s < max_batch_size] + [max_batch_size]
        self.graphs = {s: _Graph(s, table_width, device, kv_cache.scratch_block) for s in sizes}
        self.max_size = max_batch_size
        self.num_replays = 0
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

    def _forward(self, g: _Graph) -> torch.Tensor:
        hidden = self.model(g.ids, g.positions, g.meta, self.kv_cache.layers, None)
        return self.model.compute_logits(hidden)

    def can_replay(self, batch) -> bool:
        return (0 < len(batch.chunks) <= self.max_size
                and all(c.num_tokens == 1 and c.is_sampling for c in batch.chunks))

    def replay(self, batch, token_ids_of, layer_hooks=None) -> torch.Tensor:
        """Logits [rows, vocab] of a decode-only batch (rows in chunk order)."""
        n = len(batch.chunks)
        g = self.graphs[next(s for s in sorted(self.graphs) if s >= n)]
        g.fill(batch.chunks, token_ids_of, self.block_size)
        num_layers = len(self.kv_cache.layers)
        if layer_hooks is not None:
            for i in range(num_layers):
                layer_hooks.wait_for_layer_load(i)
        g.graph.replay()
        self.num_replays += 1
        if layer_hooks is not None:
            for i in range(num_layers):
                layer_hooks.save_kv_layer(i)
        return g.logits[:n]
