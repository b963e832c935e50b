"""Shared fixtures. Test modules mirror the package (test_spec.py for spec.py, and so on)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import real_bundles as real_data  # tests/real_bundles.py: a trained YOLOv8, photos and bundles of it
import registry  # tests/registry.py: a real OCI registry on loopback
import trained  # tests/trained.py: a trained detector (nudenet's YOLOv8n) and scikit-image's photos

# Their fixtures, for every test module. Bound by assignment rather than `from registry import ...` in
# each module, which pyflakes reports as unused imports shadowed by the test arguments.
registry_server = registry.registry_server
auth_registry_server = registry.auth_registry_server
nudenet_320n = trained.nudenet_320n
sample_photos = trained.sample_photos
real_model, photos, real_bundles = real_data.real_model, real_data.photos, real_data.real_bundles

REPO = Path(__file__).resolve().parent.parent
PIPELINES = REPO / "pipelines"

# The CPU build tests' variant of pipelines/yolov8_t4.yaml: yolov8n (a third of yolov8s's time), every
# path inside the spec's own folder (model, bundle under out/yolov8n_t4, file:// store).
YOLOV8N_T4 = {"path: ../models/yolov8s.onnx": "path: models/yolov8n.onnx", "synthesize: yolov8s": "synthesize: yolov8n",
              "file://../build/store": "file://store", "path: ../build/yolov8s_t4": "path: out/yolov8n_t4"}
# The T4 spec with its decode and NMS in one launch: the decode in mode nms, the nms stage done before it.
DECODE_MODE = "mode: candidates"          # the T4 spec's decode mode
NMS_LAST_PARAM = "          agnostic: false"  # the nms stage's last param line
FUSED = {DECODE_MODE: "mode: nms", NMS_LAST_PARAM: NMS_LAST_PARAM + "\n          fused: true"}


def letterbox_variant(opt_hw: tuple[int, int] = (480, 640)) -> dict[str, str]:
    """The T4 spec with a letterbox on the GPU before the model (raw uint8 BGR frames, batch 1..4), fp32;
    `opt_hw` is the profile's opt frame (a small one keeps the CPU tests' ONNX Runtime runs short)."""
    return {
        "cuts:\n": "cuts:\n  - name: letterbox\n    add: before\n    at: images\n    kernels:\n"
                   "      - contract: letterbox\n        params: {size: 640}\n",
        "inputs:\n  images:": "inputs:\n  raw_images:\n    shape: [batch, height, width, 3]\n    dtype: uint8\n"
                              f"    profile:\n      min: [1, 32, 32, 3]\n      opt: [2, {opt_hw[0]}, {opt_hw[1]}, 3]\n"
                              "      max: [4, 1080, 1920, 3]\n    buckets: [1, 2, 4]\n  images:",
        "max: [8, 3, 640, 640]": "max: [4, 3, 640, 640]",
        "buckets: [1, 2, 4, 8]             #": "buckets: [1, 2, 4]             #",
        "precision: fp16 ": "precision: fp32 ",
        "ranges: {images: [0.0, 1.0]}": "ranges: {images: [0.0, 1.0], raw_images: [0, 255]}",
    }


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


@pytest.fixture(scope="session")
def synthetic_model(tmp_path_factory):
    """place(spec): writes the synthetic model a spec names at its model.path, each set of options made
    once a session. A dry run of a spec whose model file is missing synthesizes it in memory, ~2 s in
    every CLI process: most of test_build's dry runs test something else."""
    from deepjit_compiler.model.synth import write_synthetic
    from deepjit_compiler.spec.load import load_spec

    made: dict[tuple, Path] = {}

    def place(spec: Path) -> None:
        m = load_spec(spec).spec.model
        assert m.synthesize, f"test bug: {spec} names no synthetic model to place"
        key = (m.synthesize, m.seed, m.head_layout, m.dynamic)
        if key not in made:
            made[key] = write_synthetic(m.synthesize, tmp_path_factory.mktemp("synthetic") / "model.onnx",
                                        seed=m.seed, head_layout=m.head_layout, dynamic=m.dynamic)
        m.path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(made[key], m.path)

    return place


@pytest.fixture
def write_spec(tmp_path, request):
    """Write a variant of the T4 example spec into tmp_path: write_spec(replacements={'old': 'new'}).
    With model=True its synthetic model is written too (synthetic_model)."""

    def write(replacements: dict[str, str] | None = None, name: str = "spec.yaml", text: str | None = None,
              model: bool = False) -> Path:
        body = text if text is not None else (PIPELINES / "yolov8_t4.yaml").read_text()
        for old, new in (replacements or {}).items():
            assert old in body, f"test bug: {old!r} is not in the spec"
            body = body.replace(old, new)
        path = tmp_path / name
        path.write_text(body)
        if model:
            request.getfixturevalue("synthetic_model")(path)
        return path

    return write


@pytest.fixture(scope="session")
def t4_build(tmp_path_factory):
    """One full build (published to its own file:// store) of the YOLOV8N_T4 spec, shared by the tests
    that need a built bundle: test_build compares a second build against it, test_runtime loads it."""
    from deepjit_compiler.build import build_pipeline

    folder = tmp_path_factory.mktemp("t4-build")
    body = (PIPELINES / "yolov8_t4.yaml").read_text()
    for old, new in YOLOV8N_T4.items():
        assert old in body, f"test bug: {old!r} is not in the spec"
        body = body.replace(old, new)
    (folder / "spec.yaml").write_text(body)
    return build_pipeline(folder / "spec.yaml")


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `deepjit ARGS` in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "deepjit_compiler.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def table_text(printed: str) -> str:
    """rich tables' text with borders dropped and whitespace collapsed, so a phrase a cell wrapped onto
    the next line (the detail column is the last one) reads whole."""
    return " ".join(re.sub("[│┃║|]", " ", printed).split())


def within(seconds: float, fn, fifo: Path):
    """fn() in a thread; if it blocks (opening the FIFO `fifo`) past `seconds`, unblock it and fail:
    DeepJIT must refuse a FIFO where it expects a file, never wait for a writer."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer appears: the blocked open returns
        thread.join(seconds)
        pytest.fail(f"blocked on the FIFO {fifo}")
    if "error" in box:
        raise box["error"]
    return box["value"]
