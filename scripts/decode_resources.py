"""What the decode attention kernels compile to for an H100/H200 (sm_90), without a GPU:
registers, spills and shared memory per program (occupancy), and how the key loop is
pipelined: how many shared buffers its K tiles get, and how many copies its wait leaves in
flight (one buffer and none left: no copy overlaps the fold of a tile).

    env -u TRITON_INTERPRET .venv/bin/python scripts/decode_resources.py

For the shipped `_decode_kernel` at each (TILE, warps, stages) and for
scripts/decode_prefetch.py's kernel at each (TILE, warps), at head dims 64 and 128 (the 1B
and 8B shapes; 4 query heads a KV head, 16-token blocks). Pointers and strides are marked
16-byte divisible as Triton specializes them at run time: without that no load is
vectorized or pipelined and the counts would mean nothing. Registers come from
`cuobjdump -res-usage` (Triton's own copy of it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import shoal.model.paged_attention as pa  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import compile_kernels  # noqa: E402
import decode_prefetch  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
POINTERS = {"q_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16", "o_ptr": "bf16",
            "table_ptr": "i32", "lens_ptr": "i32"}
INTS = ["stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb",
        "stride_vt", "stride_vh", "stride_ob", "stride_oh", "stride_table"]


def compile_decode(kernel, head_dim: int, tile: int, warps: int, stages: int):
    consts = dict(G=4, GP=16, D=head_dim, DP=head_dim, BLOCK_SIZE=16, TILE=tile,
                  PRECISION="tf32")
    sig, consts = compile_kernels.signature(POINTERS, INTS, consts)
    sig["scale"] = "fp32"
    sig = {name: sig[name] for name in kernel.arg_names}  # in the kernel's order
    # the table's stride is not specialized (the kernel says so); everything else is
    aligned = {(i,): [["tt.divisibility", 16]] for i, (k, t) in enumerate(sig.items())
               if t not in ("constexpr", "fp32") and k != "stride_table"}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts,
                                    attrs=aligned),
                          target=TARGET, options=dict(num_warps=warps, num_stages=stages))


def resources(compiled) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|STACK):(\d+)", out))
    regs, stack = int(usage["REG"]), int(usage["STACK"])
    ttgir = compiled.asm["ttgir"]
    per_sm = min(65536 // (regs * 32 * compiled.metadata.num_warps),
                 228 * 1024 // max(compiled.metadata.shared, 1))
    # the key loop's shared buffers for K (the leading dim of its multi-buffered allocation)
    # and what its wait leaves in flight: 1 buffer and 0 left = no copy overlaps the fold
    buffers = re.search(r"%k = ttg.local_alloc : \(\) -> !ttg.memdesc<(\d+)x", ttgir)
    left = re.search(r"scf.for.*?ttg.async_wait [^{]*\{num = (\d+)", ttgir, re.S)
    pipelined = (f"{buffers.group(1)} buffer(s), {left.group(1)} copies left in flight at "
                 f"the loop's wait") if buffers and left else "no async copies in the loop"
    return (f"{regs:4d} registers, {stack:4d} B stack, {compiled.metadata.shared:6d} B shared "
            f"(~{per_sm} programs an SM), {pipelined}")


def main() -> None:
    for head_dim in (64, 128):
        for tile, warps, stages in ((64, 4, 2), (64, 4, 3), (64, 4, 5), (32, 4, 5),
                                    (128, 4, 2)):
            compiled = compile_decode(pa._decode_kernel, head_dim, tile, warps, stages)
            print(f"shipped  dim {head_dim:3d} {tile:3d}:{warps}:{stages}  {resources(compiled)}")
        for tile, warps in ((64, 4), (32, 4), (64, 8)):
            compiled = compile_decode(decode_prefetch._decode_prefetch_kernel, head_dim, tile,
                                      warps, 1)
            print(f"prefetch dim {head_dim:3d} {tile:3d}:{warps}    {resources(compiled)}")


if __name__ == "__main__":
    main()
