"""Device buffer sizes (CPU only): a shape from a manifest that is negative or absurd is a BundleError
naming the tensor, raised before anything is allocated."""
from __future__ import annotations

import numpy as np
import pytest

from deepjit_compiler.config import MAX_DEVICE_BYTES
from deepjit_compiler.errors import BundleError
from deepjit_compiler.runtime.gpu import Gpu, device_nbytes


def test_sizes_that_fit_are_their_bytes_and_an_empty_tensor_gets_one():
    rng = np.random.default_rng(51)
    for _ in range(20):
        shape = tuple(int(d) for d in rng.integers(0, 64, rng.integers(1, 5)))
        dtype = rng.choice(["float32", "float16", "int64", "uint8"])
        assert device_nbytes(shape, dtype) == max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    assert device_nbytes((1 << 38,), np.float32) == MAX_DEVICE_BYTES   # exactly the limit is allowed


@pytest.mark.parametrize("shape", [(-1, 3), (2, -8400), (-2, -3), (1 << 38, 2), (10**12, 10**6)],
                         ids=["negative", "negative-dim", "two-negatives", "just-over", "absurd"])
def test_a_negative_or_absurd_size_names_the_tensor(shape):
    with pytest.raises(BundleError, match=rf"tensor 'boxes': shape \[.*\] of float32 \(-?\d+ bytes\) is not "
                                          rf"allocatable; allowed: dims >= 0 and at most {MAX_DEVICE_BYTES} bytes"):
        device_nbytes(shape, np.float32, "boxes")


def test_gpu_empty_refuses_before_allocating():
    allocated = []
    gpu = Gpu.__new__(Gpu)  # no device here: only the allocator is needed
    gpu.stream = None
    gpu.device = type("Device", (), {"allocate": lambda _, n, stream=None: allocated.append(n)})()
    with pytest.raises(BundleError, match=r"a device buffer: shape \[-4, 100\]"):
        gpu.empty((-4, 100), np.float32)
    assert allocated == []
