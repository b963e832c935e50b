"""Validation data, the same for every level: seeded random feeds with per-input ranges, or a folder
of images or .npy batches, at the shapes the spec gives its inputs (symbolic dims from the profile's
`opt`). A folder's images are all used, batched by the spec's buckets.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..errors import SpecError
from ..graph.tensors import TensorSig
from ..images import IMAGE_SUFFIXES, read_image, read_npy
from ..surgery.references import letterbox_numpy

_INT_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}


class Feeds(list):
    """Validation feeds (one dict of named arrays per batch) and a label for each row of each batch:
    the image file it came from, or its sample and row. The gate names the worst image by it."""

    def __init__(self, feeds=(), labels: Sequence[Sequence[str]] | None = None):
        super().__init__(feeds)
        self.labels = [list(rows) for rows in labels] if labels is not None else None


def row_labels(feeds: Sequence[Mapping[str, np.ndarray]]) -> list[list[str]]:
    """Per feed, a label per row: the Feeds' own, else 'batch k row i'."""
    if isinstance(feeds, Feeds) and feeds.labels is not None:
        return feeds.labels
    return [[f"batch {k} row {i}" for i in range(len(next(iter(f.values()), ())))] for k, f in enumerate(feeds)]


def batch_sizes(count: int, buckets: Sequence[int]) -> list[int]:
    """`count` rows as batches that cycle through the buckets, smallest first, so that each bucket is
    run; what is left at the end goes in the largest bucket that fits, and a rest smaller than every
    bucket in one batch of the smallest (filled up from the first rows)."""
    buckets = sorted(set(buckets))
    sizes, left = [], count
    while left > 0:
        size = buckets[len(sizes) % len(buckets)]
        if size > left:
            size = max((b for b in buckets if b <= left), default=buckets[0])
        sizes.append(size)
        left -= size
    return sizes


def _batched(rows: list[np.ndarray], labels: list[str], name: str, buckets: Sequence[int]) -> Feeds:
    feeds, batch_labels, start = [], [], 0
    for size in batch_sizes(len(rows), buckets):
        take = [(start + j) % len(rows) for j in range(size)]
        feeds.append({name: np.concatenate([rows[i] for i in take])})
        batch_labels.append([labels[i] for i in take])
        start += size
    return Feeds(feeds, batch_labels)


def image_feeds(paths: list[Path], inputs: Mapping[str, tuple[str, tuple[int, ...]]],
                buckets: Sequence[int] = (1,)) -> Feeds:
    """Every image, as the input takes it. A [B, 3, S, S] input takes it letterboxed on the host with
    the reference semantics (docs/semantics.md), images batched by `buckets`. A uint8 [B, H, W, 3]
    input (a letterbox stage on the GPU) takes it as decoded, BGR like OpenCV's: one image per batch
    (their sizes differ), repeated up to the smallest bucket."""
    if len(inputs) != 1:
        raise SpecError(f"validation.data.folder: images need a pipeline with one input, not {', '.join(inputs)}")
    (name, (dtype, shape)), = inputs.items()
    rows = []
    for path in paths:
        bgr = read_image(path)[..., ::-1]
        if dtype == "uint8" and len(shape) == 4 and shape[-1] == 3:
            rows.append(np.ascontiguousarray(bgr[None]))
        elif len(shape) == 4 and shape[1] == 3 and shape[2] == shape[3]:
            rows.append(letterbox_numpy(bgr[None], size=shape[2], dtype=dtype, swap_rb=True)["images"])
        else:
            raise SpecError(f"validation.data.folder: {path.name}: input '{name}' {list(shape)} takes no images "
                            "(a square [B, 3, S, S] input or a letterbox stage does); give .npy files")
    labels = [p.name for p in paths]
    if dtype == "uint8":
        copies = min(buckets)
        return Feeds([{name: np.concatenate([r] * copies)} for r in rows], [[n] * copies for n in labels])
    return _batched(rows, labels, name, buckets)


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
                 ranges: Mapping[str, tuple[float, float]] | None = None) -> Feeds:
    """`samples` feeds of seeded uniform data; float inputs default to [0, 1], integers to their range."""
    rng = np.random.default_rng(seed)
    feeds, labels = [], []
    for k in range(samples):
        feed = {}
        for name, (dtype, shape) in inputs.items():
            lo, hi = (ranges or {}).get(name, _INT_RANGES.get(dtype, (0.0, 1.0)))
            if np.issubdtype(np.dtype(dtype), np.integer):
                feed[name] = rng.integers(int(lo), int(hi) + 1, size=shape).astype(dtype)
            else:
                feed[name] = rng.uniform(lo, hi, size=shape).astype(dtype)
        feeds.append(feed)
        rows = next(iter(inputs.values()))[1][:1] or (1,)
        labels.append([f"sample {k} row {i}" for i in range(rows[0])])
    return Feeds(feeds, labels)


def folder_feeds(folder: Path, inputs: Mapping[str, tuple[str, tuple[int, ...]]],
                 buckets: Sequence[int] = (1,)) -> Feeds:
    """Feeds from all the images in `folder` (batched by `buckets`), else from `<input>_<k>.npy` files
    (one batch each), grouped by k in increasing order; every input needs the same ks."""
    if not folder.is_dir():
        raise SpecError(f"validation.data.folder: {folder} is not a folder")
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if images:
        return image_feeds(images, inputs, buckets)
    per_input = {name: _numbered(folder, name) for name in inputs}
    ks = {name: sorted(files) for name, files in per_input.items()}
    if not all(ks.values()) or len({tuple(k) for k in ks.values()}) != 1:
        raise SpecError(f"validation.data.folder: {folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))}, "
                        f"in the folder itself) and not <input>_<k>.npy files with the same k (>= 1 of them) for "
                        f"every input: found k {ks}")
    feeds, labels = [], []
    for k in next(iter(ks.values())):
        feed = {}
        for name, (dtype, shape) in inputs.items():
            array = read_npy(per_input[name][k])
            if array.dtype != np.dtype(dtype) or array.ndim != len(shape):
                raise SpecError(f"{per_input[name][k]}: expected {dtype} with rank {len(shape)}, "
                                f"got {array.dtype} {list(array.shape)}")
            feed[name] = array
        feeds.append(feed)
        first = per_input[next(iter(inputs))][k]
        labels.append([f"{first.name} row {i}" for i in range(len(next(iter(feed.values()))))])
    return Feeds(feeds, labels)


def _numbered(folder: Path, name: str) -> dict[int, Path]:
    """The folder's `<name>_<k>.npy` files by k; not another input's whose name starts the same
    (`images_size_0.npy` is not a batch of `images`)."""
    found = {}
    for path in folder.glob(f"{name}_*.npy"):
        k = path.name[len(name) + 1:-len(".npy")]
        if k.isascii() and k.isdigit():
            found[int(k)] = path
    return found


def validation_feeds(validation, inputs: Mapping[str, tuple[str, tuple[int, ...]]],
                     buckets: Sequence[int] = (1,)) -> Feeds:
    """The spec's validation data for the pipeline inputs `{name: (dtype, concrete shape)}`."""
    if validation.data.folder is not None:
        return folder_feeds(validation.data.folder, inputs, buckets)
    return random_feeds(inputs, seed=validation.seed, samples=validation.samples,
                        ranges=validation.data.random.ranges)


def _batch(spec, name: str) -> int:
    inp = spec.inputs.get(name)
    want = spec.validation.batch
    return want if inp is None else min(max(want, inp.min_shape[0]), inp.max_shape[0])


def feeds_for(spec, sigs: Sequence[TensorSig]) -> Feeds:
    """The spec's validation data for the tensors `sigs` (the pipeline's inputs, or a segment's); a
    folder's images are batched by the buckets of the input they feed (or of the spec's first input)."""
    inputs = {}
    for sig in sigs:
        inp = spec.inputs.get(sig.name)
        inputs[sig.name] = (sig.dtype, concrete_shape(sig.shape, _batch(spec, sig.name),
                                                      inp.opt_shape if inp else None, name=sig.name))
    owner = next((spec.inputs[s.name] for s in sigs if s.name in spec.inputs), next(iter(spec.inputs.values())))
    feeds = validation_feeds(spec.validation, inputs, owner.batch_buckets)
    for k, feed in enumerate(feeds):  # a folder's arrays must fit the profile (a model would fail on them deep inside)
        for name, array in feed.items():
            inp = spec.inputs.get(name)
            if inp is not None and not (array.ndim == len(inp.min_shape) and all(
                    lo <= d <= hi for d, lo, hi in zip(array.shape, inp.min_shape, inp.max_shape))):
                where = feeds.labels[k][0].rsplit(" row ", 1)[0] if feeds.labels else f"batch {k}"
                raise SpecError(f"validation.data.folder: {where} gives input '{name}' shape {list(array.shape)}; its "
                                f"profile allows {list(inp.min_shape)} to {list(inp.max_shape)}")
    return feeds
