"""What structured output costs a decode step at real model shapes, on the lent GPU.

    PYTHONPATH=$PWD python3 scripts/gpu_structured.py TOKDIR SHAPE:PROMPTS ...

`shoal bench structured` needs a tokenizer, and the random checkpoints have none. For each
SHAPE (a `random:` shape, `@<layers>` allowed) this builds a random bf16 checkpoint of that
shape whose vocabulary is the tokenizer's (SmolLM2's 49,152 entries, from TOKDIR: make it
with scripts/device_prep.sh), copies the tokenizer files in, and runs the bench on it with
both grammars (PROMPTS requests, 128 tokens each, 3 alternating rounds). The vocabulary is
the only field changed: the layers are the shape's own, the output head is smaller.
"""
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.bench.structured import run_structured
from shoal.model.random_ckpt import random_config

tok_dir = Path(sys.argv[1])
vocab = len(AutoTokenizer.from_pretrained(tok_dir))
for spec in sys.argv[2:]:
    shape, _, prompts = spec.partition(":")
    config = random_config(shape)
    config.vocab_size = vocab
    path = Path(tempfile.mkdtemp(prefix="shoal-structured-"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    for f in tok_dir.iterdir():
        shutil.copy(f, path / f.name)
    for grammar in ("regex", "json"):
        print(f"== {shape} (vocab {vocab}), {prompts} prompts, grammar {grammar}", flush=True)
        run_structured(str(path), int(prompts or 64), 128, "cuda", rounds=3, grammar=grammar)
    shutil.rmtree(path)
