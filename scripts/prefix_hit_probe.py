"""TTFT of a prompt whose front the engine's own prefix cache holds, with and without a pool
(the fs pool in a temporary directory): what a pool connector adds to a local prefix hit.

    PYTHONPATH=$PWD python3 scripts/prefix_hit_probe.py [model] [prompt tokens] [block size]

Each engine computes the prompt once, then 15 requests share all of it but their last 16
tokens (median TTFT). Defaults: random:smollm2-135m@2, 8192 tokens, 16-token blocks, CPU
(DEVICE=cuda for a GPU).
"""
import os
import statistics
import sys

from shoal import LLM
from shoal.bench.ttft import ONE, _prompt, bench_pool
from shoal.util import cdiv

model = sys.argv[1] if len(sys.argv) > 1 else "random:smollm2-135m@2"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
bs = int(sys.argv[3]) if len(sys.argv) > 3 else 16
kw = dict(device=os.environ.get("DEVICE", "cpu"), block_size=bs, max_num_tokens=n,
          max_batch_size=1, num_kv_blocks=cdiv(n, bs) + 64)


def prefix_hits(llm: LLM, prompt: list[int]) -> float:
    llm.generate([prompt], ONE)
    ttfts = [llm.generate([prompt[:-16] + [7 + i] * 16], ONE)[0].metrics.ttft_s
             for i in range(15)]
    return statistics.median(ttfts) * 1e3


with bench_pool(None) as connector:
    with LLM(model, **kw) as llm:
        prompt = _prompt(llm, n)
        off = prefix_hits(llm, prompt)
    with LLM(model, kv_connector=connector(), **kw) as llm:
        on = prefix_hits(llm, prompt)
print(f"{model}, {n}-token prompt, {bs}-token blocks, {kw['device']}: prefix-hit TTFT "
      f"{off:.2f} ms without a pool, {on:.2f} ms with one ({on / off:.3f})")
