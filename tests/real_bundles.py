"""A real trained YOLOv8 and real photos, shared by the tests that need them (bound as fixtures in
conftest.py): nudenet 3.4.2's 320n.onnx (YOLOv8n, 18 classes, dynamic axes, 320 input; tests/trained.py
finds it), four of scikit-image's photos, and fp32 bundles of the model with the letterbox on the host
and on the GPU (for this GPU, sm_75 without one), built once per session."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from deepjit_compiler import build as build_module
from deepjit_compiler.build import build_pipeline
from deepjit_compiler.runtime import gpu as gpu_mod
from deepjit_compiler.validation.gate import not_run

CONF, IOU, SIZE = 0.1, 0.45, 320  # conf 0.1: a few detections on every photo, none near the threshold
PHOTOS = ("astronaut", "coffee", "chelsea", "colorwheel")


@pytest.fixture(scope="session")
def real_model(nudenet_320n) -> Path:
    """The trained YOLOv8n: tests/trained.py's nudenet_320n (installed, its sha256 checked)."""
    return nudenet_320n


@pytest.fixture(scope="session")
def photos(tmp_path_factory) -> dict[str, Path]:
    data = pytest.importorskip("skimage.data", reason="scikit-image ships the photos")
    image = pytest.importorskip("PIL.Image", reason="Pillow writes them as PNG")
    folder = tmp_path_factory.mktemp("photos")
    out = {}
    for name in PHOTOS:
        out[name] = folder / f"{name}.png"
        image.fromarray(np.ascontiguousarray(getattr(data, name)()[..., :3])).save(out[name])
    return out


def spec(model: Path, gpu_letterbox: bool, out: Path, sm: int, precision: str = "fp32") -> dict:
    inputs = {"images": {"shape": ["batch", 3, "height", "width"], "buckets": [1, 2],
                         "profile": {"min": [1, 3, SIZE, SIZE], "opt": [1, 3, SIZE, SIZE], "max": [2, 3, SIZE, SIZE]}}}
    cuts = [{"name": "decode", "preset": "yolov8_decode",
             "kernels": [{"contract": "yolov8_decode", "params": {"mode": "candidates", "conf_threshold": CONF}}]},
            {"name": "nms", "add": "after", "at": "output0",
             "kernels": [{"contract": "nms", "params": {"conf_threshold": CONF, "iou_threshold": IOU, "max_det": 100}}]}]
    if gpu_letterbox:
        inputs = {"raw_images": {"shape": ["batch", "height", "width", 3], "dtype": "uint8", "buckets": [1, 2],
                                 "profile": {"min": [1, 32, 32, 3], "opt": [1, 512, 512, 3], "max": [2, 1024, 1024, 3]}},
                  **inputs}
        cuts.insert(0, {"name": "letterbox", "add": "before", "at": "images",
                        "kernels": [{"contract": "letterbox", "params": {"size": SIZE}}]})
    ranges = {name: [0, 255] if inp.get("dtype") == "uint8" else [0.0, 1.0] for name, inp in inputs.items()}
    return {"name": out.name, "model": {"path": str(model)}, "target": {"sm": sm}, "inputs": inputs,
            "engine": {"precision": precision}, "cuts": cuts,
            "validation": {"samples": 1, "data": {"random": {"ranges": ranges}}},
            "bundle": {"path": str(out)}}


@pytest.fixture(scope="session")
def real_bundles(real_model, tmp_path_factory) -> dict[str, Path]:
    """fp32 bundles of the model for this GPU (sm_75 without one): host letterbox and GPU letterbox."""
    folder = tmp_path_factory.mktemp("real")
    sm = gpu_mod.Gpu().sm if gpu_mod.available() else 75
    out = {}
    with pytest.MonkeyPatch.context() as mp:  # the GPU levels are the validation tests'
        mp.setattr(build_module, "gpu_levels", lambda path, spec, *_: [not_run("kernels", "test"),
                                                                                      not_run("end_to_end", "test")])
        for name, gpu_letterbox in (("host_letterbox", False), ("gpu_letterbox", True)):
            path = folder / f"{name}.yaml"
            path.write_text(yaml.safe_dump(spec(real_model, gpu_letterbox, folder / "out" / name, sm)))
            out[name] = build_pipeline(path, publish=False).bundle.path
    return out
