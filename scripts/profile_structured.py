"""Where a constrained decode step's time goes: cumulative wall time per call site (engine
step, update, execute, sampler, grammar matchers), free and constrained, two rounds each.

    PYTHONPATH=$PWD python3 scripts/profile_structured.py MODEL_DIR cuda 64 128

MODEL_DIR needs a tokenizer (on the GPU machine: the random smollm2-135m checkpoint with
SmolLM2's tokenizer files copied in, as for `shoal bench structured`). Times of calls on
different threads overlap; compare the two runs' rows, not their sum.
"""
import collections, functools, sys, time
from shoal import LLM, SamplingParams, StructuredOutput
from shoal.bench.throughput import _prompts
from shoal.engine.engine import Engine
from shoal.engine.model_runner import ModelRunner
from shoal.engine.scheduler import Scheduler
from shoal.sampling import Sampler
from shoal.structured_output import Grammars
from shoal.util import HostCopy, cdiv

T, N = collections.defaultdict(float), collections.Counter()
def wrap(cls, name):
    f = getattr(cls, name)
    key = f"{cls.__name__}.{name}"
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[key] += time.perf_counter() - t
            N[key] += 1
    setattr(cls, name, g)
for cls, names in [(Engine, ["step", "_update", "_execute", "_report"]), (ModelRunner, ["execute"]),
                   (Scheduler, ["schedule", "update"]),
                   (Sampler, ["sample_on_device", "_constrain", "_shape"]),
                   (Grammars, ["masks", "_fill", "advance", "bitmask"]), (HostCopy, ["tolist"])]:
    for n in names:
        wrap(cls, n)
model, device, n, m = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kw = dict(device=device)
if device.startswith("cuda"):
    kw.update(max_batch_size=n, max_num_tokens=16384, num_kv_blocks=n * cdiv(64 + m, 16) + 64)
with LLM(model, **kw) as llm:
    prompts = _prompts(llm, n, 0)
    no_eos = {t: -100.0 for t in llm.engine.eos_token_ids}
    spec = StructuredOutput(regex=r"[A-Za-z0-9 ,.;:'!?\n-]+")
    runs = {"free": SamplingParams(max_tokens=m, logit_bias=no_eos),
            "constrained": SamplingParams(max_tokens=m, logit_bias=no_eos, structured_output=spec)}
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_output=spec))
    for rnd in range(2):
        for name, sp in runs.items():
            T.clear(); N.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            wall = time.perf_counter() - t0
            first = max(o.metrics.first_token_time for o in outs)
            end = max(o.metrics.finish_time for o in outs)
            steps = N["Engine.step"]
            print(f"== {name} round {rnd}: wall {wall:.3f}s, decode tok/s {n * (m - 1) / (end - first):.0f}, steps {steps}")
            for k in sorted(T, key=T.get, reverse=True):
                print(f"   {k:28s} {1e3 * T[k] / max(steps, 1):8.3f} ms/step  ({N[k]} calls)")
