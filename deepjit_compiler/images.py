"""Input files that run, validation and calibration read: images (decoded with Pillow, optional) as
uint8 [H, W, 3] RGB arrays, and .npy / .npz arrays. A file that cannot be read is a
RuntimeInputError naming it and what is allowed; only regular files are opened (a FIFO never blocks).
"""
from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from .errors import MissingDependency, RuntimeInputError
from .files import open_regular

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")

# What np.load raises on a file that is not a plain array: pickled or object data (refused), a bad
# header, a truncated body, a broken zip or deflate stream, an empty file, a header claiming TiBs.
_ARRAY_ERRORS = (OSError, ValueError, EOFError, MemoryError, zipfile.BadZipFile, zlib.error)
_ARRAYS_ALLOWED = "allowed: numeric arrays written by numpy.save / numpy.savez (no pickled or object arrays)"


def read_image(path: Path) -> np.ndarray:
    """An image file as uint8 [H, W, 3] RGB."""
    try:
        from PIL import Image
    except ImportError:
        raise MissingDependency(f"{path}: reading images needs Pillow (pip install pillow); or give the "
                                "image as a uint8 [H, W, 3] .npy (BGR)") from None
    try:
        with open_regular(path) as f, Image.open(f) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except Image.DecompressionBombError as e:  # not an OSError: a header claiming billions of pixels
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)  # Pillow refuses past twice its warning limit
        raise RuntimeInputError(f"{path}: the image is too large to decode ({e}); allowed: at most {limit} "
                                "pixels (2 x PIL.Image.MAX_IMAGE_PIXELS): resize it") from None
    except (OSError, ValueError, SyntaxError) as e:  # UnidentifiedImageError is an OSError
        raise RuntimeInputError(f"{path}: cannot decode the image ({e}); give a "
                                f"{', '.join(IMAGE_SUFFIXES)} image or a uint8 [H, W, 3] .npy (BGR)") from None


def read_npy(path: Path) -> np.ndarray:
    """A .npy file's array (allow_pickle=False: an input file must never run code)."""
    try:
        with open_regular(path) as f:
            return np.load(f, allow_pickle=False)
    except _ARRAY_ERRORS as e:
        raise RuntimeInputError(f"{path}: cannot read it as a .npy array ({e}); {_ARRAYS_ALLOWED}") from None


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """A .npz file's arrays by name, every member read (and so checked) here."""
    try:
        with open_regular(path) as f, np.load(f, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except _ARRAY_ERRORS as e:
        raise RuntimeInputError(f"{path}: cannot read it as a .npz of arrays ({e}); {_ARRAYS_ALLOWED}") from None
