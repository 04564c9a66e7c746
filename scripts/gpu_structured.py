"""What structured output costs a decode step at real model shapes, on the lent GPU.

    PYTHONPATH=$PWD python3 scripts/gpu_structured.py TOKDIR SHAPE:PROMPTS ...

`shoal bench structured` needs a tokenizer, and the random checkpoints have none. For each
SHAPE (a `random:` shape, `@<layers>` allowed) this builds a random bf16 checkpoint of that
shape whose vocabulary is the tokenizer's (SmolLM2's 49,152 entries, from TOKDIR: make it
with scripts/device_prep.sh), copies the tokenizer files in, and runs the bench on it with
both grammars (PROMPTS requests, 128 tokens each, 3 alternating rounds). The vocabulary is
the only field changed: the layers are the shape's own, the output head is smaller.
Env: GRAMMARS=regex,json (which).
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

from shoal.bench.structured import run_structured
from tokenized_ckpt import build

grammars = os.environ.get("GRAMMARS", "regex,json").split(",")
tok_dir = Path(sys.argv[1])
for spec in sys.argv[2:]:
    shape, _, prompts = spec.partition(":")
    path = Path(tempfile.mkdtemp(prefix="shoal-structured-"))
    vocab = build(tok_dir, shape, path)
    for grammar in grammars:
        print(f"== {shape} (vocab {vocab}), {prompts} prompts, grammar {grammar}", flush=True)
        run_structured(str(path), int(prompts or 64), 128, "cuda", rounds=3, grammar=grammar)
    shutil.rmtree(path)
