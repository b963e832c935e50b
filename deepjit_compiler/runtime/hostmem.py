"""Pinned (page-locked) host staging and the async copies between it and device buffers.

Copies from pageable numpy memory are staged by the driver and synchronous in effect; from pinned
memory they are DMA transfers that stay asynchronous on the stream. The runtime allocates one
pinned buffer per tensor that crosses between host and device, sized for the max batch, once:

    staging = PinnedBuffer(nbytes)                 # cuMemHostAlloc; needs the GPU's context current
    view = staging.array((n, 64, 80, 80), np.float32)
    np.copyto(view, host_array)                    # the one host copy, before the GPU part
    h2d_async(gpu, device_array, view)             # cuMemcpyHtoDAsync on the GPU's stream
"""
from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Sequence

import numpy as np

from ..errors import KernelError
from .gpu import DeviceArray, _ck, driver

log = logging.getLogger("deepjit.runtime")


class PinnedBuffer:
    """`nbytes` of page-locked host memory, viewed as numpy arrays; freed by close()."""

    def __init__(self, nbytes: int):
        self.nbytes = max(1, int(nbytes))
        self.ptr = int(_ck(driver.cuMemHostAlloc(self.nbytes, 0), "cuMemHostAlloc"))
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        self._bytes = np.frombuffer(raw, dtype=np.uint8)

    def array(self, shape: Sequence[int], dtype) -> np.ndarray:
        """A C-contiguous view of the buffer's first bytes (valid until close())."""
        if self.ptr == 0:
            raise KernelError("pinned staging buffer used after close()")
        dtype = np.dtype(dtype)
        size = math.prod(int(d) for d in shape) * dtype.itemsize
        if size > self.nbytes:
            raise KernelError(f"pinned staging: {tuple(shape)} {dtype} needs {size} bytes, the buffer has "
                              f"{self.nbytes}")
        return self._bytes[:size].view(dtype).reshape(tuple(int(d) for d in shape))

    def close(self) -> None:
        if self.ptr:
            self._bytes = np.empty(0, np.uint8)
            _ck(driver.cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the context may be gone already
            pass


def capacity(arr: DeviceArray) -> int:
    """Bytes behind a device array: its allocation's size (a view may use fewer)."""
    return int(getattr(arr.buffer, "size", arr.nbytes))


def _host_ptr(view: np.ndarray) -> int:
    if not view.flags.c_contiguous:
        raise KernelError("staging copies need a C-contiguous host array")
    return int(view.ctypes.data)


def h2d_async(gpu, dst: DeviceArray, src: np.ndarray) -> None:
    """Enqueue src (pinned) -> the first src.nbytes of dst on the GPU's stream; no synchronize."""
    if src.nbytes > capacity(dst):
        raise KernelError(f"h2d: {src.nbytes} bytes do not fit {dst}")
    if src.nbytes:
        _ck(driver.cuMemcpyHtoDAsync(dst.ptr, _host_ptr(src), src.nbytes, gpu.cu_stream), "cuMemcpyHtoDAsync")


def d2h_async(gpu, dst: np.ndarray, src: DeviceArray) -> None:
    """Enqueue the first dst.nbytes of src -> dst (pinned) on the GPU's stream; no synchronize."""
    if dst.nbytes > capacity(src):
        raise KernelError(f"d2h: {src} holds fewer than {dst.nbytes} bytes")
    if dst.nbytes:
        _ck(driver.cuMemcpyDtoHAsync(_host_ptr(dst), src.ptr, dst.nbytes, gpu.cu_stream), "cuMemcpyDtoHAsync")
