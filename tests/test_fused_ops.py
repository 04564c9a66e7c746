"""The fused elementwise kernels against the PyTorch ops they replace (shoal.model.llama),
on random inputs with ragged widths. On CPU through Triton's interpreter (float32); on a
GPU compiled, in float32, bfloat16 and float16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pa = pytest.importorskip("shoal.model.paged_attention")
if not pa.HAS_TRITON:
    pytest.skip("Triton is not installed", allow_module_level=True)

from shoal.model import fused_ops  # noqa: E402
from shoal.model.layers import RMSNorm  # noqa: E402
from shoal.model.rope import rotate_half  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


def assert_rope_matches(ours: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel rounds once (PyTorch's ops round each product, then the sum): within half
    an ulp of the exact value, where the reference may be further off."""
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        return
    x, c, s = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    exact = x * c + rotate_half(x) * s
    scale = (x * c).abs() + (rotate_half(x) * s).abs()
    eps = torch.finfo(ref.dtype).eps
    assert ((ours.double() - exact).abs() <= eps * scale + 1e-30).all()
    assert ((ref.double() - exact).abs() <= 2 * eps * scale + 1e-30).all()  # the same op


def assert_matches(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: within rounding of a different summation order. Half dtypes: the same
    values but for rare one-ulp differences (a float32 intermediate rounding the other way)."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        return
    same = (ours == ref).float().mean().item()
    assert same >= 0.99, same
    ulp = torch.finfo(ref.dtype).eps * ref.abs().float().clamp(min=1e-3)
    assert ((ours.float() - ref.float()).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 576, 200])
def test_rms_norm_and_the_residual_add(dtype, width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(37, width, generator=g).to(DEVICE, dtype)
    residual = (3 * torch.randn(37, width, generator=g)).to(DEVICE, dtype)
    norm = RMSNorm(width, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=g) + 0.5)
        assert_matches(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x))
        out, total = fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        assert torch.equal(total, residual + x)  # one rounding of one add: exact
        assert_matches(out, norm(residual + x))
        # rows of a strided view (a slice of a wider batch) and no rows at all
        wide = torch.randn(37, 2 * width, generator=g).to(DEVICE, dtype)[:, :width]
        assert_matches(fused_ops.rms_norm(wide, norm.weight, norm.eps), norm(wide))
        assert fused_ops.rms_norm(x[:0], norm.weight, norm.eps).shape == (0, width)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [160, 1536, 100])
def test_silu_mul(dtype, n):
    g = torch.Generator().manual_seed(n)
    gate_up = (4 * torch.randn(23, 2 * n, generator=g)).to(DEVICE, dtype)
    gate, up = gate_up.split(n, dim=-1)
    assert_matches(fused_ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 16), (9, 3, 64), (32, 8, 128), (6, 1, 40)])
def test_rope_and_the_cache_write_in_one_kernel(dtype, heads):
    """q rotated in place; k rotated and v copied into each token's slot of a strided
    cache view (a layer of the block-major cache), as apply_rope + store_kv; the k and v
    heads of qkv and every other slot left as they were."""
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(hq * d)
    t, num_blocks, bs, layers = 29, 9, 4, 2
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 4000, (t,), generator=g).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).to(DEVICE)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    ref_q, ref_k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()
    cache = torch.randn(num_blocks, layers, 2, bs, hkv, d, generator=g).to(DEVICE, dtype)
    before = cache.clone()
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]  # layer 1's views
    slots = torch.randperm(num_blocks * bs, generator=g)[:t].to(DEVICE)
    blocks, offsets = (slots // bs).int(), (slots % bs).int()
    fused_ops.rope_store(qkv, cos, sin, hq, hkv, d, k_cache, v_cache, blocks, offsets)
    q_out, k_out, v_out = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    assert_rope_matches(q_out.reshape(t, hq, d), q_in, cos, sin, ref_q)
    assert torch.equal(k_out.reshape(t, hkv, d), k_in)
    assert torch.equal(v_out.reshape(t, hkv, d), v_in)
    assert_rope_matches(k_cache[blocks.long(), offsets.long()], k_in, cos, sin, ref_k)
    assert torch.equal(v_cache[blocks.long(), offsets.long()], v_in)
    written = torch.zeros(num_blocks, bs, dtype=torch.bool, device=DEVICE)
    written[blocks.long(), offsets.long()] = True
    cache[:, 1, :, :][written.unsqueeze(1).expand(-1, 2, -1)] = before[:, 1, :, :][
        written.unsqueeze(1).expand(-1, 2, -1)]
    assert torch.equal(cache, before)  # nothing else was touched
    fused_ops.rope_store(qkv[:0], cos[:0], sin[:0], hq, hkv, d, k_cache, v_cache, blocks[:0],
                         offsets[:0])  # no tokens: nothing to launch


def _rope_bound(ours, x, cos, sin, interleaved, ref):
    """As assert_rope_matches, for the pairs apply_rope rotates (halves, or interleaved
    (2i, 2i+1) written back as all evens, then all odds)."""
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        return
    x = x.double()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    half = x.shape[-1] // 2
    c, s = cos[:, :half].double().unsqueeze(1), sin[:, :half].double().unsqueeze(1)
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    scale = torch.cat(((x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()), dim=-1)
    eps = torch.finfo(ref.dtype).eps
    assert ((ours.double() - exact).abs() <= eps * scale + 1e-30).all()
    assert ((ref.double() - exact).abs() <= 2 * eps * scale + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 128, 64, 512, True), (3, 32, 16, 64, False),
                                   (5, 16, 8, 40, True)])  # heads, nope, rope, latent, interleaved
def test_mla_rope_store_matches_the_ops_it_replaces(dtype, shape):
    """The query heads' rotary parts, and each token's cache entry (the latent's RMSNorm, the
    rotated key) in its slot, as shoal.model.mla's ops compute them; other slots untouched."""
    from shoal.model.rope import apply_rope
    heads, nope, rope, latent, interleaved = shape
    g = torch.Generator().manual_seed(heads * rope)
    t, num_blocks, block_size = 21, 8, 4
    q = torch.randn(t, heads, nope + rope, generator=g).to(DEVICE, dtype)
    kv_a = (3 * torch.randn(t, latent + rope, generator=g)).to(DEVICE, dtype)
    norm = RMSNorm(latent, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(latent, generator=g) + 0.5)
    positions = torch.randint(0, 4000, (t,), generator=g).float()
    freqs = positions[:, None] / (10000 ** (torch.arange(0, rope, 2).float() / rope))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).to(DEVICE)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    cache = torch.full((num_blocks, block_size, 1, latent + rope), float("nan"), dtype=dtype,
                       device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t].to(DEVICE)
    blocks, offsets = (slots // block_size).int(), (slots % block_size).int()
    q_before = q.clone()

    q_rot = fused_ops.mla_rope_store(q, kv_a, norm.weight, norm.eps, cos, sin, cache, blocks,
                                     offsets, nope, interleaved)
    assert torch.equal(q, q_before)  # read only
    _rope_bound(q_rot, q[..., nope:], cos, sin, interleaved,
                apply_rope(q[..., nope:], cos, sin, interleaved))
    entry = cache[blocks.long(), offsets.long(), 0]
    assert_matches(entry[:, :latent], norm(kv_a[:, :latent]))
    k = kv_a[:, latent:].unsqueeze(1)
    _rope_bound(entry[:, latent:].unsqueeze(1), k, cos, sin, interleaved,
                apply_rope(k, cos, sin, interleaved))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert cache.view(-1, latent + rope)[untouched].isnan().all()
    assert fused_ops.mla_rope_store(q[:0], kv_a[:0], norm.weight, norm.eps, cos[:0], sin[:0],
                                    cache, blocks[:0], offsets[:0], nope,
                                    interleaved).shape == (0, heads, rope)
