"""A constrained decode step's timeline, thread by thread: which wait is on the critical path.

    PYTHONPATH=$PWD python3 scripts/structured_trace.py MODEL_DIR cuda 64 128

MODEL_DIR needs a tokenizer (scripts/tokenized_ckpt.py). Runs the same prompts free and
under a regex, records every call of the functions below as (thread, name, start, end), and
prints (1) each name's mean time a step per thread, (2) four steady-state steps as a
timeline in ms, (3) the device's busy share over ten steps (torch.profiler). Env knobs:
SWITCH=<seconds> (Python's GIL switch interval).
"""
import collections, functools, os, sys, threading, time


from shoal import LLM, SamplingParams, StructuredOutput
from shoal.bench.throughput import bench_prompts
from shoal.engine.engine import Engine
from shoal.engine.model_runner import ModelRunner
from shoal.engine.scheduler import Scheduler
from shoal.sampling import Sampler
from shoal.structured_output import Grammars
from shoal.util import HostCopy, cdiv

SPANS: list[tuple[str, str, float, float]] = []


def wrap(cls, name):
    f = getattr(cls, name)
    key = f"{cls.__name__}.{name}"

    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPANS.append((threading.current_thread().name[:14], key, t, time.perf_counter()))
    setattr(cls, name, g)


for cls, names in [(Engine, ["step", "_update", "_report"]), (ModelRunner, ["execute"]),
                   (Scheduler, ["schedule", "update"]),
                   (Sampler, ["sample_on_device", "_constrain"]),
                   (Grammars, ["masks", "_fill", "advance", "bitmask", "prepare"]),
                   (HostCopy, ["tolist"])]:
    for n in names:
        wrap(cls, n)
if "SWITCH" in os.environ:
    sys.setswitchinterval(float(os.environ["SWITCH"]))

model, device, n, m = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kw = dict(device=device)
if device.startswith("cuda"):
    kw.update(max_batch_size=n, max_num_tokens=16384, num_kv_blocks=n * cdiv(64 + m, 16) + 64)


def report(name, wall, steps, tok_s):
    print(f"== {name}: wall {wall:.3f}s, decode tok/s {tok_s:.0f}, steps {steps}, "
          f"{1e3 * wall / max(steps, 1):.3f} ms/step")
    per = collections.defaultdict(float)
    for th, key, a, b in SPANS:
        per[(th, key)] += b - a
    for (th, key), s in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"   {th:14s} {key:26s} {1e3 * s / max(steps, 1):8.3f} ms/step")
    starts = [a for th, key, a, b in SPANS if key == "ModelRunner.execute"]
    if len(starts) > 60:
        t0, t1 = starts[50], starts[54]
        print("   -- timeline of steps 50-53 (ms from the 50th execute)")
        for th, key, a, b in sorted(SPANS, key=lambda s: s[2]):
            if t0 <= a < t1:
                print(f"   {1e3 * (a - t0):8.3f} {1e3 * (b - t0):8.3f}  {th:14s} {key}")


with LLM(model, **kw) as llm:
    prompts = bench_prompts(llm, n, 0)
    no_eos = {t: -100.0 for t in llm.engine.eos_token_ids}
    spec = StructuredOutput(regex=r"[A-Za-z0-9 ,.;:'!?\n-]+")
    runs = {"free": SamplingParams(max_tokens=m, logit_bias=no_eos),
            "constrained": SamplingParams(max_tokens=m, logit_bias=no_eos, structured_output=spec)}
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_output=spec))
    for rnd in range(2):
        for name, sp in runs.items():
            SPANS.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            wall = time.perf_counter() - t0
            first = max(o.metrics.first_token_time for o in outs)
            end = max(o.metrics.finish_time for o in outs)
            steps = sum(1 for s in SPANS if s[1] == "Engine.step")
            report(f"{name} round {rnd}", wall, steps, n * (m - 1) / (end - first))
    if device.startswith("cuda"):
        from torch.profiler import ProfilerActivity, profile
        for name, sp in runs.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                llm.generate(prompts, sp)
                wall = time.perf_counter() - t0
            busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
            print(f"== device busy, {name}: {busy:.3f} s of {wall:.3f} s wall "
                  f"({busy / wall:.2f})")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
