"""A real trained detector and real photos, for the accuracy tests (bound as fixtures in conftest.py).

- `nudenet_320n`: nudenet 3.4.2's `320n.onnx`, a YOLOv8n trained at 320 with 18 classes and dynamic
  axes, from the installed nudenet package (in the test extra; only its file is read, nudenet is
  never imported). Without it the tests skip, saying how to install it.
- `sample_photos`: the photos scikit-image ships inside its package (no download), as PNG files.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

NUDENET = "nudenet==3.4.2"
NUDENET_ONNX_SHA256 = "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f"
# Every photo scikit-image keeps in its package (skimage.data.data_dir): 8 in colour, 9 grey ones
# (read as RGB). Detections at conf 0.25 land on astronaut, camera, colorwheel and moon; int8 adds
# one on chelsea (the cat).
PHOTOS = ("astronaut", "brick", "camera", "chelsea", "clock", "coffee", "coins", "colorwheel", "grass", "gravel",
          "hubble_deep_field", "immunohistochemistry", "moon", "page", "retina", "rocket", "text")


@pytest.fixture(scope="session")
def nudenet_320n() -> Path:
    """320n.onnx from the installed nudenet package (the test extra), checked to be the one tested."""
    found = importlib.util.find_spec("nudenet")
    if found is None:
        pytest.skip(f"{NUDENET} is not installed (the test extra brings it; alone: pip install {NUDENET} --no-deps)")
    model = Path(found.submodule_search_locations[0]) / "320n.onnx"
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    assert digest == NUDENET_ONNX_SHA256, f"{model} has sha256 {digest}, not the one tested ({NUDENET})"
    return model


@pytest.fixture(scope="session")
def sample_photos(tmp_path_factory) -> Path:
    """A folder of PNGs of scikit-image's sample photos."""
    data = pytest.importorskip("skimage.data", reason="the sample photos come with scikit-image (the test extra)")
    image = pytest.importorskip("PIL.Image", reason="writing the photos needs Pillow (the test extra)")
    folder = tmp_path_factory.mktemp("photos")
    for name in PHOTOS:
        image.fromarray(getattr(data, name)()).save(folder / f"{name}.png")
    return folder
