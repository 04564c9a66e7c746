"""The Triton MLA decode kernel against the absorbed reference (gathers + SDPA), on random
latent caches: ragged contexts, a padding row, head counts that do not fill a tile, block
sizes 16 and 32. On CPU through Triton's interpreter; compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

pm = pytest.importorskip("shoal.model.paged_mla")
if not pm.HAS_TRITON:
    pytest.skip("Triton is not installed", allow_module_level=True)

from shoal.model.attention_backend import decode_attention  # noqa: E402
from tests.test_paged_attention import DEVICE, tables  # noqa: E402


# bfloat16 on a GPU only (Triton's interpreter computes in numpy, which has none)
CASES = [(16, 20, torch.float32), (32, 16, torch.float32), (16, 4, torch.float32),
         (64, 16, torch.float32)] + (
    [(16, 16, torch.bfloat16), (16, 128, torch.bfloat16)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("splits", [1, 3, None])  # None: as many as the batch calls for
@pytest.mark.parametrize("block_size, num_heads, dtype", CASES)
def test_mla_decode_matches_the_absorbed_reference(block_size, num_heads, dtype, splits):
    g = torch.Generator().manual_seed(block_size + num_heads)
    latent, rot, num_blocks = 32, 8, 24
    layers = torch.randn(num_blocks, 3, 1, block_size, 1, latent + rot, generator=g)
    cache = layers.to(DEVICE, dtype)[:, 1, 0]  # one layer's strided view, as KVCache gives
    lengths = [1, 5, 17, 40, 0]  # the last: a padding row
    table = tables([max(n, 1) for n in lengths], block_size, num_blocks, g)
    q = torch.randn(len(lengths), num_heads, latent + rot, generator=g).to(DEVICE, dtype)
    scale = 0.37
    out = pm.mla_decode(q, cache, table, torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
                        latent, scale, splits=splits)
    live = lengths[:-1]
    ref = decode_attention(q[:-1].double(), table[:-1].long(), live, cache.double(),
                           cache[..., :latent].double(), scale)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[:-1].double(), ref, **tol)
    assert out.shape == (len(lengths), num_heads, latent) and not out[-1].any()
