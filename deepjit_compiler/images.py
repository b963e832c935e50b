"""Input files that run, validation and calibration read: images (decoded with Pillow, optional) as
uint8 [H, W, 3] RGB arrays, and .npy / .npz arrays. A file that cannot be read is a
RuntimeInputError naming it and what is allowed; only regular files are opened (a FIFO never blocks).
"""
from __future__ import annotations

import zipfile
import zlib
from collections.abc import Collection
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
            return _rgb8(img, path)
    except Image.DecompressionBombError as e:  # not an OSError: a header claiming billions of pixels
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)  # Pillow refuses past twice its warning limit
        raise RuntimeInputError(f"{path}: the image is too large to decode ({e}); allowed: at most {limit} "
                                "pixels (2 x PIL.Image.MAX_IMAGE_PIXELS): resize it") from None
    except (OSError, ValueError, SyntaxError) as e:  # UnidentifiedImageError is an OSError
        raise RuntimeInputError(f"{path}: cannot decode the image ({e}); give a "
                                f"{', '.join(IMAGE_SUFFIXES)} image or a uint8 [H, W, 3] .npy (BGR)") from None


def _rgb8(img, path: Path) -> np.ndarray:
    """uint8 RGB of a decoded image. Pillow's convert("RGB") clips a 16-bit grey image (mode I;16, or
    I from a PNG, which holds no 32-bit pixels) at 255, saturating it: it is scaled to 8 bits by its
    high byte instead, as OpenCV's imread (what ultralytics reads with) does."""
    if img.mode.startswith("I;16") or (img.mode == "I" and img.format == "PNG"):
        grey = (np.asarray(img).astype(np.uint32) >> 8).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=-1)
    if img.mode in ("I", "F"):
        raise RuntimeInputError(f"{path}: a {'32-bit integer' if img.mode == 'I' else 'floating-point'} image "
                                f"(Pillow mode {img.mode}) has no 8-bit meaning; give an 8- or 16-bit image, or a "
                                "uint8 [H, W, 3] .npy (BGR)")
    return np.asarray(img.convert("RGB"), dtype=np.uint8)


def read_npy(path: Path) -> np.ndarray:
    """A .npy file's array (allow_pickle=False: an input file must never run code)."""
    try:
        with open_regular(path) as f:
            array = np.load(f, allow_pickle=False)
    except _ARRAY_ERRORS as e:
        raise RuntimeInputError(f"{path}: cannot read it as a .npy array ({e}); {_ARRAYS_ALLOWED}") from None
    return _finite(array, str(path))


def read_npz(path: Path, inputs: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """A .npz file's arrays by name, every member read (and so checked) here; those named in `inputs`
    (all, without it) must be finite: another member the caller never feeds may hold anything."""
    try:
        with open_regular(path) as f, np.load(f, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except _ARRAY_ERRORS as e:
        raise RuntimeInputError(f"{path}: cannot read it as a .npz of arrays ({e}); {_ARRAYS_ALLOWED}") from None
    return {k: _finite(a, f"{path}: array '{k}'") if inputs is None or k in inputs else a for k, a in arrays.items()}


def _finite(array: np.ndarray, what: str) -> np.ndarray:
    """`array`, refused if it holds NaN or inf: no pipeline input means anything with them, and they
    would pass through the engine into NaN boxes, or fail deep inside calibration."""
    if np.issubdtype(array.dtype, np.inexact):
        finite = np.isfinite(array)
        if not finite.all():  # argmin, not argwhere: an all-NaN array must not cost ndim int64s per element
            first = [int(i) for i in np.unravel_index(int(np.argmin(finite)), array.shape)]
            raise RuntimeInputError(f"{what}: {array.size - int(np.count_nonzero(finite))} of its {array.size} values "
                                    f"are NaN or infinite (the first at index {first}); allowed: finite numbers only")
    return array
