"""A real trained detector and real photos, for the accuracy tests (bound as fixtures in conftest.py).

- `nudenet_320n`: nudenet 3.4.2's `320n.onnx`, a YOLOv8n trained at 320 with 18 classes and dynamic
  axes. pip fetches the wheel once into the user cache (`deepjit/test-models/nudenet-3.4.2/` there);
  the test skips, saying why, when it is not cached and no package index answers. On a machine
  without one, copy the file into that folder (XDG_CACHE_HOME moves the user cache).
- `sample_photos`: the photos scikit-image ships inside its package (no download), as PNG files.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import platformdirs
import pytest

NUDENET = "nudenet==3.4.2"
NUDENET_ONNX_SHA256 = "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f"
# Every photo scikit-image keeps in its package (skimage.data.data_dir): 8 in colour, 9 grey ones
# (read as RGB). Detections at conf 0.25 land on astronaut, camera, colorwheel and moon; int8 adds
# one on chelsea (the cat).
PHOTOS = ("astronaut", "brick", "camera", "chelsea", "clock", "coffee", "coins", "colorwheel", "grass", "gravel",
          "hubble_deep_field", "immunohistochemistry", "moon", "page", "retina", "rocket", "text")


def _fetch_nudenet(folder: Path) -> Path:
    """320n.onnx in `folder`, taken out of the wheel pip downloads (once: a verified copy is reused)."""
    model = folder / "320n.onnx"
    if model.is_file() and hashlib.sha256(model.read_bytes()).hexdigest() == NUDENET_ONNX_SHA256:
        return model
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        try:
            got = subprocess.run([sys.executable, "-m", "pip", "download", NUDENET, "--no-deps", "--only-binary",
                                  ":all:", "-d", tmp, "--timeout", "20", "--retries", "1",
                                  "--disable-pip-version-check"], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip(f"{NUDENET} is not cached in {folder} and pip could not download it within 5 minutes")
        wheels = list(Path(tmp).glob("nudenet-*.whl"))
        if got.returncode != 0 or not wheels:
            why = (got.stderr.strip().splitlines() or ["no wheel"])[-1]
            pytest.skip(f"{NUDENET} is not cached in {folder} and pip could not download it (no package index "
                        f"reachable?): {why}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read("nudenet/320n.onnx")
        digest = hashlib.sha256(data).hexdigest()
        assert digest == NUDENET_ONNX_SHA256, f"{NUDENET}'s 320n.onnx has sha256 {digest}, not the one tested"
        part = Path(tmp) / "320n.onnx"
        part.write_bytes(data)
        os.replace(part, model)
    return model


@pytest.fixture(scope="session")
def nudenet_320n() -> Path:
    return _fetch_nudenet(Path(platformdirs.user_cache_dir("deepjit")) / "test-models" / "nudenet-3.4.2")


@pytest.fixture(scope="session")
def sample_photos(tmp_path_factory) -> Path:
    """A folder of PNGs of scikit-image's sample photos."""
    data = pytest.importorskip("skimage.data", reason="the sample photos come with scikit-image (the test extra)")
    image = pytest.importorskip("PIL.Image", reason="writing the photos needs Pillow (the test extra)")
    folder = tmp_path_factory.mktemp("photos")
    for name in PHOTOS:
        image.fromarray(getattr(data, name)()).save(folder / f"{name}.png")
    return folder
