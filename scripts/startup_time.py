"""How long Shoal takes to start and stop (CPU): what every CLI run, server and fleet pays.

    .venv/bin/python scripts/startup_time.py

Prints, for the default model (SmolLM2's GGUF): reading it (header and dequantization) and a
whole `shoal generate` of 4 tokens in a fresh process; for a tiny random Llama: a 2-rank ADP
fleet brought up, one request, and shut down, three times in one process (the first fleet
also starts multiprocessing's fork server).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from shoal import LLM, SamplingParams
    from shoal.model.loader import load_model_source
    from shoal.model.presets import fetch_preset
    from tests.conftest import make_tiny_llama

    gguf = str(fetch_preset("smollm2"))
    start = time.perf_counter()
    load_model_source(gguf)
    print(f"smollm2 GGUF read and dequantized: {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shoal", "generate", "--model", gguf, "--prompt", "Hi",
                    "--max-tokens", "4"], check=True, capture_output=True)
    print(f"shoal generate (smollm2, 4 tokens), whole process: {time.perf_counter() - start:.2f} s")
    tiny = str(make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", "gqa_tied"))
    for i in range(3):
        start = time.perf_counter()
        with LLM(tiny, dp_size=2, block_size=4, num_kv_blocks=64) as llm:
            up = time.perf_counter()
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
            done = time.perf_counter()
        print(f"fleet {i + 1} (dp 2, tiny): up {up - start:.2f} s, one request "
              f"{done - up:.2f} s, down {time.perf_counter() - done:.2f} s")


if __name__ == "__main__":
    main()
