"""Decoded images (Pillow, optional) as uint8 [H, W, 3] RGB arrays."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import MissingDependency, RuntimeInputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def read_image(path: Path) -> np.ndarray:
    """An image file as uint8 [H, W, 3] RGB."""
    try:
        from PIL import Image
    except ImportError:
        raise MissingDependency(f"{path}: reading images needs Pillow (pip install pillow); or give the "
                                "image as a uint8 [H, W, 3] .npy (BGR)") from None
    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except OSError as e:
        raise RuntimeInputError(f"{path}: cannot decode the image ({e})") from None
