"""Shared fixtures. Test modules mirror the package (test_spec.py for spec.py, and so on)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PIPELINES = REPO / "pipelines"


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU: run on the device machine (pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def write_spec(tmp_path):
    """Write a variant of the T4 example spec into tmp_path: write_spec(replacements={'old': 'new'})."""

    def write(replacements: dict[str, str] | None = None, name: str = "spec.yaml", text: str | None = None) -> Path:
        body = text if text is not None else (PIPELINES / "yolov8_t4.yaml").read_text()
        for old, new in (replacements or {}).items():
            assert old in body, f"test bug: {old!r} is not in the spec"
            body = body.replace(old, new)
        path = tmp_path / name
        path.write_text(body)
        return path

    return write


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `deepjit ARGS` in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "deepjit_compiler.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)
