"""Every module imports, and the CLI starts, without TensorRT (Polygraphy's test_dependencies).

Runs in a fresh interpreter where `import tensorrt` fails even if TensorRT is installed, so this
checks what a user without it gets, on any machine.
"""
from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import deepjit_compiler

REPO = Path(__file__).resolve().parent.parent

# sys.modules[name] = None makes `import name` raise ImportError.
BLOCK_TENSORRT = "import sys; sys.modules['tensorrt'] = None\n"


def modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(deepjit_compiler.__path__, "deepjit_compiler."))


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TENSORRT + code], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_every_module_imports_without_tensorrt():
    names = modules()
    assert {"deepjit_compiler.precision.rewrite", "deepjit_compiler.precision.calibration",
            "deepjit_compiler.engines.tensorrt", "deepjit_compiler.engines.onnxrt", "deepjit_compiler.engines.base"} <= set(names)
    proc = run("import importlib, sys\n"
               f"for name in {names!r}:\n"
               "    importlib.import_module(name)\n"
               "assert sys.modules['tensorrt'] is None, 'something replaced the tensorrt block'\n")
    assert proc.returncode == 0, proc.stderr


def test_tensorrt_use_without_tensorrt_is_a_missing_dependency():
    proc = run("from deepjit_compiler.engines import tensorrt_importable\n"
               "from deepjit_compiler.engines.tensorrt import build_engine\n"
               "from deepjit_compiler.engines import EngineSettings\n"
               "from deepjit_compiler.errors import MissingDependency\n"
               "assert tensorrt_importable() is False\n"
               "try:\n"
               "    build_engine('x.onnx', EngineSettings())\n"
               "except MissingDependency as e:\n"
               "    print(e)\n")
    assert proc.returncode == 0, proc.stderr
    assert "building TensorRT engines needs TensorRT: install deepjit[tensorrt] or set engine.backend: onnxruntime" \
        in proc.stdout


def test_cli_help_without_tensorrt():
    proc = run("import runpy, sys\n"
               "sys.argv = ['deepjit', '--help']\n"
               "runpy.run_module('deepjit_compiler.cli', run_name='__main__')\n")
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout and "build" in proc.stdout
