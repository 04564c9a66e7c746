"""Page-cache read rate of block files by thread count: raw readinto vs the pool read path vs
the checksum alone (run on a GPU machine to size the load path).

    PYTHONPATH=$PWD python3 scripts/io_probe.py NUM_FILES FILE_BYTES [DIR]

MODES (comma-separated, default all but procs): raw, ours, dirs, noverify, hash, and procs
(raw reads by N processes into one shared mapping: the ceiling with no GIL shared).
"""
import os, sys, time, tempfile, torch, numpy as np
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from shoal.connectors.fs import format as pf
N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
BS = int(sys.argv[2]) if len(sys.argv) > 2 else 512 << 10
root = Path(tempfile.mkdtemp(prefix="probe-", dir=sys.argv[3] if len(sys.argv) > 3 else None))
pf.ensure_pool_dirs(root)
ns = os.urandom(32)
shape = (BS // 2,)
payload = np.random.randint(0, 255, BS, dtype=np.uint8)
keys = [os.urandom(32) for _ in range(N)]
for k in keys:
    pf.write_block(root, ns, k, memoryview(payload), shape, torch.bfloat16)
THREADS = [int(t) for t in os.environ.get("THREADS", "1,2,4,8,16").split(",")]
buf = (torch.empty((N, BS), dtype=torch.uint8).pin_memory().numpy() if os.environ.get("PINNED")
       else np.empty((N, BS), np.uint8))  # PINNED=1: into pinned memory, as a GPU load
paths = [pf.block_path_str(str(root), k) for k in keys]
def raw(i):
    with open(paths[i], "rb", buffering=0) as f:
        f.seek(128); f.readinto(memoryview(buf[i]))
def ours(i):
    pf.read_block_into(root, ns, keys[i], memoryview(buf[i]), shape, torch.bfloat16)
dirs = pf.BlockDirs(root)
def ours_dirs(i):
    pf.read_block_into(root, ns, keys[i], memoryview(buf[i]), shape, torch.bfloat16, dirs=dirs)
def noverify(i):
    pf.read_block_into(root, ns, keys[i], memoryview(buf[i]), shape, torch.bfloat16, dirs=dirs,
                       verify=False)
def hashonly(i):
    pf.checksum(memoryview(buf[i]))
MODES = os.environ.get("MODES", "raw,ours,dirs,noverify,hash").split(",")
if "procs" in MODES:  # processes, each with a GIL of its own, into one shared mapping
    import mmap
    import multiprocessing as mp
    shared = np.frombuffer(mmap.mmap(-1, N * BS, flags=mmap.MAP_SHARED), np.uint8).reshape(N, BS)

    def proc_read(lo_hi):
        for i in range(*lo_hi):
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.preadv(fd, [memoryview(shared[i])], 128)
            finally:
                os.close(fd)
    for procs in THREADS:
        parts = [(N * k // (4 * procs), N * (k + 1) // (4 * procs)) for k in range(4 * procs)]
        with mp.get_context("fork").Pool(procs) as pool:
            pool.map(proc_read, parts)
            t = time.perf_counter()
            for _ in range(3):
                pool.map(proc_read, parts)
            dt = (time.perf_counter() - t) / 3
        print(f"procs {procs:2d} procs:   {N*BS/dt/1e9:6.2f} GB/s  {dt/N*1e6:6.1f} us/file", flush=True)
for name, fn in [(m, f) for m, f in [("raw", raw), ("ours", ours), ("dirs", ours_dirs),
                                     ("noverify", noverify), ("hash", hashonly)] if m in MODES]:
    for threads in THREADS:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(fn, range(N)))
            t = time.perf_counter()
            for _ in range(3):
                list(ex.map(fn, range(N)))
            dt = (time.perf_counter() - t) / 3
        print(f"{name:5s} {threads:2d} threads: {N*BS/dt/1e9:6.2f} GB/s  {dt/N*1e6:6.1f} us/file", flush=True)
