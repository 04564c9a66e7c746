"""A random bf16 checkpoint of a `random:` shape with a real tokenizer copied in, for the
benches that need one on the lent GPU (the random checkpoints have no tokenizer):

    PYTHONPATH=$PWD python3 scripts/tokenized_ckpt.py TOKDIR SHAPE DIR

TOKDIR: a tokenizer's files (SmolLM2's, from scripts/device_prep.sh). The vocabulary is the
tokenizer's (SmolLM2's 49,152 entries); every other field is the shape's own.
"""
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.model.random_ckpt import random_config


def build(tok_dir: Path, shape: str, path: Path) -> int:
    """Write the checkpoint to `path`; returns its vocabulary size."""
    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    config = random_config(shape)
    config.vocab_size = vocab
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for f in tok_dir.iterdir():
        shutil.copy(f, path / f.name)
    return vocab


if __name__ == "__main__":
    print(f"vocabulary {build(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))}")
