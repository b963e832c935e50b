"""Validation data: seeded random feeds with per-input ranges, or a folder of images or .npy files,
at the shapes the spec gives its inputs."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..errors import SpecError
from ..graph.tensors import TensorSig
from ..images import IMAGE_SUFFIXES, read_image
from ..surgery.references import letterbox_numpy

_INT_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}


def image_feeds(paths: list[Path], inputs: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[dict[str, np.ndarray]]:
    """One feed per image (batch 1: images differ in size). A uint8 [B, H, W, 3] input (a letterbox
    stage on the GPU) takes the image as decoded, BGR like OpenCV's; a [B, 3, S, S] input takes it
    letterboxed on the host with the reference semantics (docs/semantics.md)."""
    if len(inputs) != 1:
        raise SpecError(f"validation.data.folder: images need a pipeline with one input, not {', '.join(inputs)}")
    (name, (dtype, shape)), = inputs.items()
    feeds = []
    for path in paths:
        bgr = read_image(path)[..., ::-1]
        if dtype == "uint8" and len(shape) == 4 and shape[-1] == 3:
            feeds.append({name: np.ascontiguousarray(bgr[None])})
        elif len(shape) == 4 and shape[1] == 3 and shape[2] == shape[3]:
            feeds.append({name: letterbox_numpy(bgr[None], size=shape[2], dtype=dtype, swap_rb=True)["images"]})
        else:
            raise SpecError(f"validation.data.folder: {path.name}: input '{name}' {list(shape)} takes no images "
                            "(a square [B, 3, S, S] input or a letterbox stage does); give .npy files")
    return feeds


def concrete_shape(shape, batch: int, fallback: tuple[int, ...] | None = None, *,
                   name: str | None = None) -> tuple[int, ...]:
    """Symbolic dims resolved: the first to `batch`, the rest from `fallback` (the profile's opt shape).
    `name`: the input's, for the error message."""
    dims = []
    for i, d in enumerate(shape):
        if isinstance(d, int) and d > 0:
            dims.append(d)
        elif i == 0:
            dims.append(batch)
        elif fallback is not None:
            dims.append(int(fallback[i]))
        else:
            where = f"inputs.{name}: " if name else ""
            raise SpecError(f"{where}dim {i} of shape {list(shape)} is symbolic: give a profile so validation can "
                            "pick a size")
    return tuple(dims)


def random_feeds(inputs: Mapping[str, tuple[str, tuple[int, ...]]], *, seed: int, samples: int,
                 ranges: Mapping[str, tuple[float, float]] | None = None) -> list[dict[str, np.ndarray]]:
    """`samples` feeds of seeded uniform data; float inputs default to [0, 1], integers to their range."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(samples):
        feed = {}
        for name, (dtype, shape) in inputs.items():
            lo, hi = (ranges or {}).get(name, _INT_RANGES.get(dtype, (0.0, 1.0)))
            if np.issubdtype(np.dtype(dtype), np.integer):
                feed[name] = rng.integers(int(lo), int(hi) + 1, size=shape).astype(dtype)
            else:
                feed[name] = rng.uniform(lo, hi, size=shape).astype(dtype)
        feeds.append(feed)
    return feeds


def folder_feeds(folder: Path, inputs: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[dict[str, np.ndarray]]:
    """Feeds from the images in `folder`, else from `<input>_<k>.npy` files (one batch each),
    grouped by k in sorted order."""
    if not folder.is_dir():
        raise SpecError(f"validation.data.folder: {folder} is not a folder")
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if images:
        return image_feeds(images, inputs)
    per_input = {name: sorted(folder.glob(f"{name}_*.npy")) for name in inputs}
    counts = {name: len(files) for name, files in per_input.items()}
    if not all(counts.values()) or len(set(counts.values())) != 1:
        raise SpecError(f"validation.data.folder: {folder} needs the same number (>= 1) of <input>_<k>.npy files "
                        f"for every input, found {counts}")
    feeds = []
    for k in range(next(iter(counts.values()))):
        feed = {}
        for name, (dtype, shape) in inputs.items():
            array = np.load(per_input[name][k], allow_pickle=False)
            if array.dtype != np.dtype(dtype) or array.ndim != len(shape):
                raise SpecError(f"{per_input[name][k]}: expected {dtype} with rank {len(shape)}, "
                                f"got {array.dtype} {list(array.shape)}")
            feed[name] = array
        feeds.append(feed)
    return feeds


def validation_feeds(validation, inputs: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[dict[str, np.ndarray]]:
    """The spec's validation data for the pipeline inputs `{name: (dtype, concrete shape)}`."""
    if validation.data.folder is not None:
        return folder_feeds(validation.data.folder, inputs)
    return random_feeds(inputs, seed=validation.seed, samples=validation.samples,
                        ranges=validation.data.random.ranges)


def _batch(spec, name: str) -> int:
    inp = spec.inputs.get(name)
    want = spec.validation.batch
    return want if inp is None else min(max(want, inp.min_shape[0]), inp.max_shape[0])


def symbolic_dims(spec) -> dict[str, int]:
    """Values for the spec inputs' symbolic dims: the batch from validation, the rest from `opt`."""
    dims = {}
    for name, inp in spec.inputs.items():
        for i, d in enumerate(inp.shape):
            if isinstance(d, str):
                dims[d] = _batch(spec, name) if i == 0 else inp.opt_shape[i]
    return dims


def feeds_for(spec, sigs: Sequence[TensorSig]) -> list[dict[str, np.ndarray]]:
    """The spec's validation data for the tensors `sigs` (the pipeline's inputs, or a segment's)."""
    inputs = {}
    for sig in sigs:
        inp = spec.inputs.get(sig.name)
        inputs[sig.name] = (sig.dtype, concrete_shape(sig.shape, _batch(spec, sig.name),
                                                      inp.opt_shape if inp else None, name=sig.name))
    return validation_feeds(spec.validation, inputs)
