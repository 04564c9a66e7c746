"""Compile Shoal's newest Triton kernels for an H100/H200 (sm_90) without a GPU.

    env -u TRITON_INTERPRET .venv/bin/python scripts/compile_kernels.py

The CPU tests run the kernels through Triton's interpreter, which accepts some programs the
compiler refuses; GPU time is scarce, so this compiles them ahead of time (Triton's own
ptxas, no driver needed) at the shapes a GPU run uses: the MLA decode kernel with and
without context splits and their fold, the dense rope + KV store, MLA's rope + norm + cache write, the fused MoE's
router, its two GEMMs and its routing layout; the dense prefill over a split context and
its fold; structured output's logit mask; the pool's
GPU checksum (both passes) and the placement of
verified rows.
Prints one line per kernel; exits 1 if any fails. The lent GPU's Triton may be older than
this machine's, so a pass here is a good sign, not a proof.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import shoal.model.fused_moe as moe  # noqa: E402
import shoal.model.fused_ops as ops  # noqa: E402
import shoal.model.paged_attention as pa  # noqa: E402
import shoal.model.paged_mla as mla  # noqa: E402
import shoal.connectors.store.gpu_place as place  # noqa: E402
import shoal.connectors.store.gpu_xxh3 as xxh3  # noqa: E402
import shoal.structured_output as so  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def signature(pointers: dict[str, str], ints: list[str], consts: dict) -> tuple[dict, dict]:
    sig = {**{name: f"*{t}" for name, t in pointers.items()}, **{name: "i32" for name in ints},
           **{name: "constexpr" for name in consts}}
    return sig, consts


def cases():
    # DeepSeek-V2-Lite's decode: 16 heads, a 512-wide latent, 64 rotary, 16-token blocks
    mla_ptrs = {"q_ptr": "bf16", "c_ptr": "bf16", "o_ptr": "bf16", "part_ptr": "fp32",
                "stats_ptr": "fp32", "table_ptr": "i32", "lens_ptr": "i32"}
    mla_ints = ["stride_qb", "stride_qh", "stride_cb", "stride_ct", "stride_ob", "stride_oh",
                "stride_table"]
    for splits in (1, 4):
        sig, consts = signature(mla_ptrs, mla_ints, dict(
            H=16, HT=16, L=512, R=64, RP=64, BLOCK_SIZE=16, TILE=16, SPLITS=splits,
            PRECISION="tf32"))
        sig["scale"] = "fp32"
        yield f"mla decode, {splits} split(s)", mla._mla_decode_kernel, sig, consts
    yield "mla combine, 4 splits", mla._mla_combine_kernel, *signature(
        {"part_ptr": "fp32", "stats_ptr": "fp32", "o_ptr": "bf16"}, ["stride_ob", "stride_oh"],
        dict(H=16, HT=16, L=512, SPLITS=4))
    yield "rope + KV store, Llama-3.2-1B's 32 + 8 heads", ops._rope_store_kernel, *signature(
        {"qkv_ptr": "bf16", "cos_ptr": "bf16", "sin_ptr": "bf16", "kc_ptr": "bf16",
         "vc_ptr": "bf16", "blocks_ptr": "i32", "offsets_ptr": "i32"},
        ["stride_t", "stride_cos", "stride_sin", "stride_kb", "stride_kt", "stride_kh",
         "stride_vb", "stride_vt", "stride_vh", "num_q_heads", "num_kv_heads"],
        dict(HALF=32, HP=64, HALFP=32, KVP=8, VP=64))
    for heads, interleaved in ((16, True), (128, True), (16, False)):  # V2-Lite, V3 (TP 1)
        sig, consts = signature(
            {"q_ptr": "bf16", "q_rot_ptr": "bf16", "kv_a_ptr": "bf16", "w_ptr": "bf16",
             "cos_ptr": "bf16", "sin_ptr": "bf16", "cache_ptr": "bf16", "blocks_ptr": "i32",
             "offsets_ptr": "i32"},
            ["stride_q", "stride_qh", "stride_qr", "stride_qrh", "stride_kv_a", "stride_cos",
             "stride_sin", "stride_cache_block", "stride_cache_slot", "num_heads"],
            dict(NOPE=128, LATENT=512, LATENTP=512, HALF=32, HALFP=32, HP=heads,
                 INTERLEAVED=interleaved))
        sig["eps"] = "fp32"
        yield f"mla rope + store, {heads} heads, interleaved={interleaved}", \
            ops._mla_rope_store_kernel, sig, consts
    # the routed experts of V2-Lite (64 experts, top 6, hidden 2048, 1408 wide) at decode
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PRECISION="tf32")
    yield "moe gate_up", moe._gate_up_kernel, *signature(
        {"x_ptr": "bf16", "w_ptr": "bf16", "inter_ptr": "bf16", "row_ids_ptr": "i32",
         "tile_expert_ptr": "i32"}, ["stride_x", "stride_we", "stride_wn", "stride_inter"],
        dict(NUM_EXPERTS=64, TOP_K=6, HIDDEN=2048, INTER=1408, **tiles))
    yield "moe down", moe._down_kernel, *signature(
        {"inter_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "bf16", "weights_ptr": "bf16",
         "row_ids_ptr": "i32", "tile_expert_ptr": "i32"},
        ["stride_inter", "stride_we", "stride_wn", "stride_out"],
        dict(NUM_EXPERTS=64, HIDDEN=2048, INTER=1408, **tiles))
    for experts, k in ((64, 6), (128, 8)):  # V2-Lite's router, Qwen3-30B-A3B's
        sig, consts = signature({"logits_ptr": "fp32", "weights_ptr": "bf16", "chosen_ptr": "i64"},
                                ["stride_logits", "num_experts"],
                                dict(TOP_K=k, K_PAD=8, E_PAD=experts, NORMALIZE=k == 8))
        sig["scale"] = "fp32"
        yield f"moe router, {experts} experts, top {k}", moe._route_kernel, sig, consts
    for experts in (64, 256):  # V2-Lite; V3 (a 512-wide one-hot, 32 assignments a program)
        e_pad = triton.next_power_of_2(experts + 1)
        chunk = min(128, moe.ALIGN_ELEMENTS // e_pad)
        yield f"moe counts, {experts} experts", moe._count_kernel, *signature(
            {"chosen_ptr": "i64", "counts_ptr": "i32"}, ["first", "num"],
            dict(CHUNK=chunk, NUM_EXPERTS=experts, E_PAD=e_pad))
        yield f"moe placing, {experts} experts", moe._place_kernel, *signature(
            {"chosen_ptr": "i64", "counts_ptr": "i32", "ahead_ptr": "i64", "row_ids_ptr": "i32",
             "tile_expert_ptr": "i32"}, ["first", "num", "num_chunks", "num_tiles"],
            dict(CHUNK=chunk, NUM_EXPERTS=experts, E_PAD=e_pad, BLOCK_M=16, TILE_BLOCK=64))
    yield "structured output's mask, 49k vocabulary", so._mask_kernel, *signature(
        {"logits_ptr": "fp32", "rows_ptr": "i64", "mask_ptr": "i32", "stops_ptr": "i64"},
        ["stride", "mask_stride", "vocab"], dict(BLOCK=4096))
    # Llama-3-8B's prefill: 32 query heads over 8 KV heads of 128, 64-token blocks
    sig, consts = signature(
        {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "o_ptr": "bf16", "part_ptr": "fp32",
         "stats_ptr": "fp32", "table_ptr": "i32", "starts_ptr": "i32", "lens_ptr": "i32",
         "ctx_ptr": "i32"},
        ["stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
         "stride_vt", "stride_vh", "stride_ot", "stride_oh", "stride_table", "num_rows",
         "num_parts"],
        dict(H=32, G=4, D=128, DP=128, BLOCK_SIZE=64, BLOCK_M=64, BLOCK_N=64, PRECISION="tf32"))
    sig["scale"] = "fp32"
    yield "prefill, a context in parts", pa._prefill_kernel, sig, consts
    yield "prefill's fold of the parts", pa._combine_kernel, *signature(
        {"o_ptr": "bf16", "part_ptr": "fp32", "stats_ptr": "fp32", "starts_ptr": "i32",
         "lens_ptr": "i32"}, ["stride_ot", "stride_oh", "num_rows", "num_parts"],
        dict(H=32, D=128, DP=128, BLOCK_M=64))
    yield "pool checksum, block sums", xxh3._block_sums_kernel, *signature(
        {"rows_ptr": "i64", "ids_ptr": "i64", "consts_ptr": "i64", "sums_ptr": "i64"},
        ["row_words", "num_blocks"], dict(G=xxh3.SEGMENT))
    yield "pool checksum, chain", xxh3._chain_kernel, *signature(
        {"rows_ptr": "i64", "ids_ptr": "i64", "consts_ptr": "i64", "sums_ptr": "i64",
         "expected_ptr": "i64", "hashes_ptr": "i64", "ok_ptr": "i8"},
        ["row_words", "num_words", "num_blocks", "tail_stripes"], dict(T=xxh3.CHAIN_TILE))
    yield "pool load, verified rows placed", place._place_kernel, *signature(
        {"kv_ptr": "i64", "staging_ptr": "i64", "targets_ptr": "i64", "check_ptr": "i64",
         "ok_ptr": "i8"}, ["row_words"], dict(TILE=place.TILE))


def main() -> int:
    failed = 0
    for name, kernel, sig, consts in cases():
        start = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                                      target=TARGET)
            print(f"ok    {name}: {len(compiled.asm['cubin'])} bytes of sm_90 code, "
                  f"{compiled.metadata.shared} B shared, {time.perf_counter() - start:.1f} s")
        except Exception as e:  # report every kernel, then fail
            failed += 1
            print(f"FAIL  {name}: {type(e).__name__}: {str(e)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
