"""What a call may feed a pipeline: input names, dtypes, shapes within the profile, a batch within
range, and the bucket a batch is padded up to."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import RuntimeInputError, closest


def check_feeds(inputs, feeds: Mapping[str, Any], min_batch: int, max_batch: int, buckets: Sequence[int]) -> int:
    """The batch of `feeds` (a mapping of numpy arrays), after checking names, dtypes, ranks and dims
    against the inputs' shapes and profiles; RuntimeInputError naming the input and what is allowed."""
    names = [i.name for i in inputs]
    for key in feeds:
        if key not in names:
            raise RuntimeInputError(f"unknown input '{key}'{closest(key, names)}; this pipeline takes "
                                    f"{', '.join(names)}")
    batch = None
    for inp in inputs:
        if inp.name not in feeds:
            raise RuntimeInputError(f"input '{inp.name}' is missing; this pipeline takes {', '.join(names)}")
        arr = feeds[inp.name]
        if not isinstance(arr, np.ndarray):
            raise RuntimeInputError(f"input '{inp.name}': expected a numpy array, got {type(arr).__name__}")
        if arr.dtype != np.dtype(inp.dtype):
            raise RuntimeInputError(f"input '{inp.name}' is {arr.dtype}, expected {inp.dtype} "
                                    f"(shape {show_shape(inp.shape)}); convert it with .astype(np.{inp.dtype})")
        if arr.ndim != len(inp.shape):
            raise RuntimeInputError(f"input '{inp.name}' has shape {arr.shape}, expected rank {len(inp.shape)} "
                                    f"{show_shape(inp.shape)}")
        for axis in range(1, arr.ndim):
            lo, hi, got = inp.min[axis], inp.max[axis], arr.shape[axis]
            if not lo <= got <= hi:
                allowed = f"{lo}" if lo == hi else f"{lo}..{hi}"
                raise RuntimeInputError(f"input '{inp.name}' dim {axis} is {got}, allowed {allowed} "
                                        f"(shape {show_shape(inp.shape)}, got {arr.shape})")
        n = arr.shape[0]
        if batch is not None and n != batch:
            raise RuntimeInputError(f"input '{inp.name}' has batch {n}, but the other inputs have {batch}")
        batch = n
    assert batch is not None
    if batch > max_batch:
        raise RuntimeInputError(f"batch {batch} is above this pipeline's max batch {max_batch} (the "
                                f"profile max; buckets {', '.join(map(str, buckets))}): split the batch")
    if batch < min_batch:
        raise RuntimeInputError(f"batch {batch} is below this pipeline's min batch {min_batch}")
    return batch


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `batch` (inputs are padded up to it)."""
    for b in sorted(buckets):
        if b >= batch:
            return b
    raise RuntimeInputError(f"batch {batch} is above the largest bucket {max(buckets)} "
                            f"(buckets {', '.join(map(str, sorted(buckets)))})")


def show_shape(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
