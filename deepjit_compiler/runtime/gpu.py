"""A thin device layer over cuda.core (device, stream, module load, launch) and cuda.bindings.driver
(copies, memsets, events, CUDA-graph capture). Importing it needs no GPU: everything is lazy.

    gpu = Gpu()                                   # device 0, its own stream
    x = gpu.upload(np.ones((2, 3), np.float32))   # DeviceArray
    mod = gpu.load(compiled)                      # cubin when it matches the GPU, else the PTX
    gpu.launch(mod.kernel("decode"), grid, block, 0, np.uint64(x.ptr), np.int32(6))
    y = gpu.download(x)
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._optional import lazy_import
from ..config import MAX_DEVICE_BYTES
from ..errors import BundleError, KernelError, MissingDependency

log = logging.getLogger("deepjit.gpu")
driver = lazy_import("cuda.bindings.driver", "running kernels needs cuda-bindings and an NVIDIA driver")
_core = lazy_import("cuda.core", "running kernels needs cuda-core")
_core_experimental = lazy_import("cuda.core.experimental", "running kernels needs cuda-core")


def _cc():
    """cuda.core's public namespace (older releases keep it under cuda.core.experimental)."""
    return _core if hasattr(_core, "Device") else _core_experimental


def _ck(result, what: str):
    """Unwrap a cuda.bindings.driver (err, *values) tuple, raising with the driver's error name."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        _, name = driver.cuGetErrorName(err)
        raise KernelError(f"CUDA {what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else tuple(values)


def available() -> bool:
    """True when a CUDA driver and at least one GPU answer."""
    try:
        _ck(driver.cuInit(0), "cuInit")
        return _ck(driver.cuDeviceGetCount(), "cuDeviceGetCount") > 0
    except Exception:  # no driver library, no device, no cuda-bindings: all mean "no GPU here"
        return False


def driver_version() -> int:
    """cuDriverGetVersion(), e.g. 13000 for a CUDA 13.0 driver."""
    return _ck(driver.cuDriverGetVersion(), "cuDriverGetVersion")


def device_nbytes(shape: Sequence[int], dtype, name: str | None = None) -> int:
    """The bytes to allocate for `shape` x `dtype`, at least 1 (an empty tensor still gets a pointer).
    Shapes come from a bundle's manifest: a negative dim or a size past MAX_DEVICE_BYTES is a
    BundleError naming the tensor, raised before any allocation (max(1, ...) must not hide it)."""
    dims = tuple(int(d) for d in shape)
    nbytes = math.prod(dims) * np.dtype(dtype).itemsize
    if any(d < 0 for d in dims) or nbytes > MAX_DEVICE_BYTES:
        raise BundleError(f"{f'tensor {name!r}' if name else 'a device buffer'}: shape {list(dims)} of {np.dtype(dtype)} "
                          f"({nbytes} bytes) is not allocatable; allowed: dims >= 0 and at most "
                          f"{MAX_DEVICE_BYTES} bytes (the bundle's manifest is broken or tampered with)")
    return max(1, nbytes)


class DeviceArray:
    """A device allocation with a numpy shape and dtype (C-contiguous)."""

    def __init__(self, buffer, shape: Sequence[int], dtype):
        self.buffer, self.shape, self.dtype = buffer, tuple(int(d) for d in shape), np.dtype(dtype)

    @property
    def ptr(self) -> int:
        return int(self.buffer.handle)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr=0x{self.ptr:x})"


@dataclass(frozen=True, slots=True)
class Module:
    """Loaded code: kernels by entry point or C++ name expression."""

    code: Any                      # cuda.core ObjectCode
    mangled: dict                  # entry point / name expression -> mangled name
    code_type: str                 # "cubin" | "ptx"

    def kernel(self, entry: str):
        if entry not in self.mangled:
            raise KernelError(f"no kernel '{entry}' in this module; it has {', '.join(self.mangled)}")
        return self.code.get_kernel(self.mangled[entry])


class Graph:
    """An instantiated CUDA graph captured from a stream; replay() launches it on that stream."""

    def __init__(self, graph, exec_, stream):
        self._graph, self._exec, self._stream = graph, exec_, stream

    def replay(self) -> None:
        _ck(driver.cuGraphLaunch(self._exec, self._stream), "cuGraphLaunch")

    def close(self) -> None:
        if self._exec is not None:
            driver.cuGraphExecDestroy(self._exec)
            driver.cuGraphDestroy(self._graph)
            self._exec = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the context may be gone already
            pass


class Gpu:
    """One device and one stream."""

    def __init__(self, ordinal: int = 0):
        if not available():
            raise MissingDependency("no NVIDIA GPU or driver is available here")
        count = _ck(driver.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise MissingDependency(f"GPU {ordinal} is not available here: this process sees {count} GPU(s), "
                                    f"0..{count - 1} (CUDA_VISIBLE_DEVICES chooses which)")
        cc = _cc()
        self.device = cc.Device(ordinal)
        self.device.set_current()
        self.stream = self.device.create_stream()
        major, minor = self.device.compute_capability
        self.sm = int(major) * 10 + int(minor)
        self.name = self.device.name

    @property
    def cu_stream(self):
        handle = self.stream.handle
        return handle if not isinstance(handle, int) else driver.CUstream(handle)

    # -- memory ---------------------------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype, name: str | None = None) -> DeviceArray:
        nbytes = device_nbytes(shape, dtype, name)
        return DeviceArray(self.device.allocate(nbytes, stream=self.stream), shape, dtype)

    def zeros(self, shape: Sequence[int], dtype, name: str | None = None) -> DeviceArray:
        arr = self.empty(shape, dtype, name)
        self.fill(arr, 0)
        return arr

    def fill(self, arr: DeviceArray, byte: int) -> None:
        if arr.nbytes:
            _ck(driver.cuMemsetD8Async(arr.ptr, byte, arr.nbytes, self.cu_stream), "cuMemsetD8Async")

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        """Device-to-device copy on the stream (capturable)."""
        if dst.nbytes != src.nbytes:
            raise KernelError(f"copy: {src} does not fit {dst}")
        _ck(driver.cuMemcpyDtoDAsync(dst.ptr, src.ptr, src.nbytes, self.cu_stream), "cuMemcpyDtoDAsync")

    def upload(self, host: np.ndarray, out: DeviceArray | None = None) -> DeviceArray:
        host = np.ascontiguousarray(host)
        out = out or self.empty(host.shape, host.dtype)
        if out.nbytes != host.nbytes:
            raise KernelError(f"upload: {host.shape} {host.dtype} does not fit {out}")
        if host.nbytes:
            _ck(driver.cuMemcpyHtoDAsync(out.ptr, host.ctypes.data, host.nbytes, self.cu_stream), "cuMemcpyHtoDAsync")
            self.sync()  # the host array may be freed once we return
        return out

    def download(self, arr: DeviceArray) -> np.ndarray:
        host = np.empty(arr.shape, arr.dtype)
        if host.nbytes:
            _ck(driver.cuMemcpyDtoHAsync(host.ctypes.data, arr.ptr, arr.nbytes, self.cu_stream), "cuMemcpyDtoHAsync")
        self.sync()
        return host

    def sync(self) -> None:
        self.stream.sync()

    # -- code -----------------------------------------------------------------------------------
    def load(self, kernel, prefer: str = "auto") -> Module:
        """Load a CompiledKernel: its cubin when built for this GPU's SM, else its PTX (JIT by the
        driver; needs sm <= this GPU's and a driver at least kernel.ptx_min_driver)."""
        if prefer not in ("auto", "cubin", "ptx"):
            raise KernelError(f"prefer must be auto, cubin or ptx, got {prefer!r}")
        code_type = prefer if prefer != "auto" else ("cubin" if kernel.sm == self.sm else "ptx")
        if code_type == "cubin" and kernel.sm != self.sm:
            raise KernelError(f"kernel {kernel.contract}: its cubin is for sm_{kernel.sm}, this GPU ({self.name}) "
                              f"is sm_{self.sm}; load its PTX instead (prefer='ptx')")
        if code_type == "ptx" and kernel.sm > self.sm:
            raise KernelError(f"kernel {kernel.contract}: its PTX is for compute_{kernel.sm}, newer than this GPU "
                              f"({self.name}, sm_{self.sm}): rebuild for sm_{self.sm}")
        if code_type == "ptx" and driver_version() < kernel.ptx_min_driver:
            raise KernelError(f"kernel {kernel.contract}: its PTX (NVRTC {kernel.nvrtc_version}) needs a driver "
                              f"for CUDA {kernel.ptx_min_driver // 1000}.{kernel.ptx_min_driver % 1000 // 10}, this "
                              f"one is {driver_version()}: rebuild with this machine's NVRTC or update the driver")
        cc = _cc()
        data = kernel.cubin if code_type == "cubin" else kernel.ptx.encode()
        factory = cc.ObjectCode.from_cubin if code_type == "cubin" else cc.ObjectCode.from_ptx
        try:
            code = factory(data, name=kernel.contract)
        except TypeError:  # cuda.core < 0.4 takes no name
            code = factory(data)
        mangled = {**{expr: name for expr, name in kernel.lowered},
                   **{entry: dict(kernel.lowered)[expr] for entry, expr in kernel.entries}}
        log.debug("loaded %s as %s on sm_%d", kernel.contract, code_type, self.sm)
        return Module(code, mangled, code_type)

    def launch_config(self, grid: Sequence[int], block: Sequence[int], shared_mem: int = 0, overlap: bool = False):
        """A cuda.core LaunchConfig (build it once, launch with it many times). overlap: launch
        while the previous kernel in the stream still runs (programmatic dependent launch; the
        kernel must wait for it itself); ignored where cuda.core cannot ask for it."""
        cc = _cc()
        if "stream" in getattr(cc.LaunchConfig, "__dataclass_fields__", {}):
            # cuda.core < 0.3: the stream rides in the config
            return cc.LaunchConfig(grid=tuple(grid), block=tuple(block), stream=self.stream, shmem_size=int(shared_mem))
        kwargs = dict(grid=tuple(grid), block=tuple(block), shmem_size=int(shared_mem))
        if overlap:
            try:
                return cc.LaunchConfig(**kwargs, programmatic_stream_serialization=True)
            except TypeError:  # an older cuda.core
                log.debug("this cuda.core cannot ask for programmatic stream serialization: no overlap")
        return cc.LaunchConfig(**kwargs)

    def allow_shared(self, kernel, dynamic: int, who: str) -> None:
        """Let `kernel` have `dynamic` bytes of dynamic shared memory (beyond 48 KiB in all needs
        opting in); KernelError naming `who` when static + dynamic exceed what this GPU allows."""
        if dynamic <= 0:
            return
        handle, dev = driver.CUkernel(int(kernel.handle)), driver.CUdevice(self.device.device_id)
        attr = driver.CUfunction_attribute
        static = _ck(driver.cuKernelGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, handle, dev),
                     "cuKernelGetAttribute")
        limit = _ck(driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev), "cuDeviceGetAttribute")
        if static + dynamic > limit:
            raise KernelError(f"{who} needs {static} bytes of static and {dynamic} of dynamic shared memory "
                              f"(its contract's shared_mem); {self.name} (sm_{self.sm}) allows {limit} per block")
        _ck(driver.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic, handle, dev),
            "cuKernelSetAttribute")

    def launch_with(self, config, kernel, *args) -> None:
        """Launch on this GPU's stream with a prepared config and typed args."""
        cc = _cc()
        if "stream" in getattr(cc.LaunchConfig, "__dataclass_fields__", {}):
            cc.launch(kernel, config, *args)  # cuda.core < 0.3: the kernel comes first
        else:
            cc.launch(self.stream, config, kernel, *args)

    def launch(self, kernel, grid: Sequence[int], block: Sequence[int], shared_mem: int, *args) -> None:
        """Launch with typed args (np.int32, np.float32, np.uint64 pointers, Buffers)."""
        self.launch_with(self.launch_config(grid, block, shared_mem), kernel, *args)

    # -- timing and graphs ----------------------------------------------------------------------
    @staticmethod
    def event():
        """A driver event (for timing with record() and elapsed_ms())."""
        return _ck(driver.cuEventCreate(0), "cuEventCreate")

    @staticmethod
    def destroy_event(event) -> None:
        _ck(driver.cuEventDestroy(event), "cuEventDestroy")

    def record(self, event=None):
        """Record `event` (a new one when None) on the stream now; returns it."""
        event = event if event is not None else self.event()
        _ck(driver.cuEventRecord(event, self.cu_stream), "cuEventRecord")
        return event

    @staticmethod
    def elapsed_ms(start, end) -> float:
        _ck(driver.cuEventSynchronize(end), "cuEventSynchronize")
        return float(_ck(driver.cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def abandon_capture(self) -> None:
        """End a capture someone else left open on this stream (an engine whose own capture failed)."""
        status, *_ = _ck(driver.cuStreamGetCaptureInfo(self.cu_stream), "cuStreamGetCaptureInfo")
        if status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
            _, graph = driver.cuStreamEndCapture(self.cu_stream)
            if graph:
                driver.cuGraphDestroy(graph)

    def capture(self, body: Callable[[], None], flags: int = 0) -> Graph:
        """Run body() under stream capture and instantiate the graph it launched (cuGraphInstantiate's
        `flags`: CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY keeps the priorities capture copied from
        the streams)."""
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _ck(driver.cuStreamBeginCapture(self.cu_stream, mode), "cuStreamBeginCapture")
        try:
            body()
        except BaseException:
            _, graph = driver.cuStreamEndCapture(self.cu_stream)  # the stream leaves capture either way
            if graph:
                driver.cuGraphDestroy(graph)
            raise
        graph = _ck(driver.cuStreamEndCapture(self.cu_stream), "cuStreamEndCapture")
        try:
            exec_ = _ck(driver.cuGraphInstantiate(graph, flags), "cuGraphInstantiate")
        except KernelError:
            driver.cuGraphDestroy(graph)
            raise
        return Graph(graph, exec_, self.cu_stream)
