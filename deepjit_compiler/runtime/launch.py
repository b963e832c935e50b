"""Host-side launchers: bind tensors to a contract, compute its geometry, pack typed args, launch.

`ContractKernel` runs any compiled contract (a user's too); `KernelChain` runs several one after the
other on shared buffers (decode -> nms), ready for CUDA-graph capture; `host_values` gives the args a
contract takes from the host (its roles.host_args: the letterbox's geometry).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import KernelError, RuntimeInputError
from ..graph.tensors import TensorSig
from ..jit.contracts import (
    Contract,
    Launch,
    bind_dims,
    concrete_shape,
    launches,
    load_contract,
    signature,
    workspace_bytes,
)
from ..jit.geometry import check_launch
from ..jit.nvrtc import CompiledKernel
from .gpu import DeviceArray, Gpu

log = logging.getLogger("deepjit.kernels")

_ARG_TYPES = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64, "f32": np.float32,
              "f64": np.float64}


def pack_arg(name: str, kind: str, value: Any):
    """A kernel arg with an explicit C type: cuda.core would pass a Python int as a pointer and a
    float as a double."""
    if kind == "ptr":
        if isinstance(value, DeviceArray):
            return np.uint64(value.ptr)
        if value is None:
            return np.uint64(0)
        if isinstance(value, (int, np.integer)):
            return np.uint64(int(value))
        raise KernelError(f"kernel arg '{name}' is a pointer; got {type(value).__name__}")
    if isinstance(value, DeviceArray) or kind not in _ARG_TYPES or not _fits(np.dtype(_ARG_TYPES[kind]), value):
        raise KernelError(f"kernel arg '{name}' is {kind}; got {value!r}"
                          + (f", which {kind} cannot hold" if kind in _ARG_TYPES else ""))
    return _ARG_TYPES[kind](value)


def _fits(dtype: np.dtype, value: Any) -> bool:
    """Whether `value` is a number (a bool too: 0 or 1) that `dtype` holds: numpy raised ValueError on a str
    or NaN (exit 3), made an array of a list, wrapped an int past the type's range (2**40 as i32 is 0, -1 as
    u32 is 4294967295), truncated a fraction and made inf of a finite float past float32's range."""
    if not isinstance(value, (int, float, np.integer, np.floating, np.bool_)):
        return False
    if dtype.kind == "f":  # inf and nan pass as they are
        return not math.isfinite(float(value)) or abs(float(value)) <= float(np.finfo(dtype).max)
    info = np.iinfo(dtype)
    return info.min <= value <= info.max and float(value).is_integer()


def pack_args(launch: Launch) -> list:
    return [pack_arg(name, kind, value) for name, kind, value in launch.args]


class ContractKernel:
    """A compiled contract loaded on a GPU."""

    def __init__(self, gpu: Gpu, compiled: CompiledKernel, prefer: str = "auto"):
        self.gpu, self.compiled = gpu, compiled
        self.contract = load_contract(compiled.contract_path)
        self.params = compiled.params
        self.module = gpu.load(compiled, prefer)
        self.signature: tuple[TensorSig, ...] = signature(self.contract, self.params)
        self._functions: dict[str, Any] = {}  # by symbol
        self._shared: dict[str, int] = {}  # dynamic shared memory each symbol is allowed so far

    @property
    def inputs(self) -> tuple[TensorSig, ...]:
        return tuple(s for s in self.signature if s.role == "input")

    @property
    def outputs(self) -> tuple[TensorSig, ...]:
        return tuple(s for s in self.signature if s.role == "output")

    def bind(self, inputs: Mapping[str, DeviceArray], extra_dims: Mapping[str, int] | None = None) -> Mapping[str, int]:
        """Symbolic dims from the inputs' shapes; dtypes checked."""
        for sig in self.inputs:
            arr = inputs.get(sig.name)
            if arr is not None and arr.dtype != np.dtype(sig.dtype):
                raise RuntimeInputError(f"kernel {self.contract.name}: input '{sig.name}' is {arr.dtype}, "
                                        f"expected {sig.dtype}")
        return bind_dims(self.contract, self.params, {k: v.shape for k, v in inputs.items()}, extra_dims)

    def allocate_outputs(self, dims: Mapping[str, int]) -> dict[str, DeviceArray]:
        """Output buffers for bound dims; zero_init ones (counters) are zeroed once, here."""
        out = {}
        for sig in self.outputs:
            arr = self.gpu.empty(concrete_shape(sig, self.params, dims), sig.dtype, sig.name)
            if sig.zero_init:
                self.gpu.fill(arr, 0)
            out[sig.name] = arr
        return out

    def workspace(self, dims: Mapping[str, int]) -> DeviceArray | None:
        size = workspace_bytes(self.contract, self.params, dims)
        return self.gpu.empty((size,), np.uint8) if size else None

    def launches(self, tensors: Mapping[str, Any], dims: Mapping[str, int]) -> tuple[Launch, ...]:
        return launches(self.contract, self.params, dims, tensors)

    def prepare(self, tensors: Mapping[str, Any], dims: Mapping[str, int]) -> tuple[Prepared, ...]:
        """Geometry, configs and packed args for fixed buffers: launching them is all that is left."""
        plan = []
        for item in self.launches(tensors, dims):
            # before the driver sees it: a bundle built elsewhere (or for another GPU) fails with its numbers
            check_launch(item, self.gpu.sm, f"kernel {self.contract.name} ({self.contract.path})", batch=dims.get("B"),
                         target=f"{self.gpu.name} (sm_{self.gpu.sm})")
            # By symbol: an entry's from_batch instantiation is another kernel of the same entry.
            fn = self._functions.get(item.symbol)
            if fn is None:
                fn = self._functions[item.symbol] = self.module.kernel(item.symbol)
            # Only ever raised: graphs captured for other shapes still launch with what they were given.
            if item.shared_mem > self._shared.get(item.symbol, 0):
                self.gpu.allow_shared(fn, item.shared_mem, f"kernel {self.contract.name} ({item.entry})")
                self._shared[item.symbol] = item.shared_mem
            # Overlap needs the code's own wait, compiled in only for sm_90 and newer.
            config = self.gpu.launch_config(item.grid, item.block, item.shared_mem,
                                            overlap=item.overlap and self.compiled.sm >= 90)
            plan.append(Prepared(item.entry, fn, config, tuple(pack_args(item))))
        return tuple(plan)

    def launch(self, tensors: Mapping[str, Any], dims: Mapping[str, int]) -> int:
        """Launch every entry point in order; returns how many kernels were launched."""
        return self.gpu_launch(self.prepare(tensors, dims))

    def gpu_launch(self, plan: tuple[Prepared, ...]) -> int:
        for p in plan:
            self.gpu.launch_with(p.config, p.function, *p.args)
        return len(plan)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A launch ready to go: kernel, LaunchConfig and typed args (pointers fixed)."""

    entry: str
    function: Any
    config: Any
    args: tuple


class KernelChain:
    """Compiled kernels run one after the other on one GPU over buffers allocated once: a kernel reads the
    given inputs or an earlier kernel's outputs by pipeline name (`aliases` maps its contract's tensor
    names to those), its outputs are allocated for the bound dims (zero_init ones zeroed once), and its
    host args (roles.host_args) computed. Ready for CUDA-graph capture: decode -> nms is two launches
    and no memset, since nms resets the decode's counters. The kernels level runs these; so do the GPU
    tests and benchmarks."""

    def __init__(self, gpu: Gpu, kernels: Sequence[CompiledKernel | tuple[CompiledKernel, Mapping[str, str]]],
                 inputs: Mapping[str, DeviceArray], prefer: str = "auto"):
        self.gpu, self.inputs = gpu, dict(inputs)
        self.tensors: dict[str, DeviceArray] = dict(inputs)
        self.kernels: list[ContractKernel] = []
        self.dims: list[Mapping[str, int]] = []
        self.plan: tuple[Prepared, ...] = ()
        self.workspaces: list[DeviceArray] = []  # held here: the plan keeps only their pointers
        for item in kernels:
            compiled, aliases = item if isinstance(item, tuple) else (item, {})
            kernel = ContractKernel(gpu, compiled, prefer)
            reads = {}
            for sig in kernel.inputs:
                name = aliases.get(sig.name, sig.name)
                if name not in self.tensors:
                    raise KernelError(f"kernel {kernel.contract.name}: input '{sig.name}' ({name}) is neither given "
                                      f"nor made by an earlier kernel; have {', '.join(self.tensors)}")
                reads[sig.name] = self.tensors[name]
            dims = kernel.bind(reads)
            outs = kernel.allocate_outputs(dims)
            workspace = kernel.workspace(dims)
            if workspace is not None:
                self.workspaces.append(workspace)
            values = {**reads, **outs, "workspace": workspace, **host_values(kernel.contract, kernel.params, dims)}
            self.plan += kernel.prepare(values, dims)
            self.tensors.update(outs)
            self.kernels.append(kernel)
            self.dims.append(dims)

    @property
    def outputs(self) -> dict[str, DeviceArray]:
        """The outputs of the last kernel that has any (one done by the kernel before it has none)."""
        last = next((k for k in reversed(self.kernels) if k.outputs), self.kernels[-1])
        return {s.name: self.tensors[s.name] for s in last.outputs}

    def launch(self) -> int:
        """Enqueue the kernels on the GPU's stream; returns how many were launched."""
        for p in self.plan:
            self.gpu.launch_with(p.config, p.function, *p.args)
        return len(self.plan)

    def results(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Buffers copied to the host: `names` (any kernel's outputs), else the last kernel's outputs."""
        return {n: self.gpu.download(self.tensors[n]) for n in (names or self.outputs)}


@dataclass(frozen=True, slots=True)
class LetterboxGeometry:
    """Where an H x W image lands in the size x size canvas (docs/semantics.md, "Letterbox")."""

    r: float
    new_w: int
    new_h: int
    left: int
    top: int
    scale_x: float      # new_w / W in float32, as ONNX Resize derives it from output sizes
    scale_y: float

    def values(self) -> dict[str, Any]:
        return {"r": np.float32(self.r), "new_w": self.new_w, "new_h": self.new_h, "left": self.left,
                "top": self.top, "scale_x": np.float32(self.scale_x), "scale_y": np.float32(self.scale_y)}


def letterbox_geometry(h: int, w: int, size: int) -> LetterboxGeometry:
    """r = min(size / H, size / W) in float32; new sizes and padding rounded half to even."""
    if h < 1 or w < 1:
        raise RuntimeInputError(f"letterbox: a {w}x{h} image has no pixels; allowed: at least 1x1")
    f32 = np.float32
    r = min(f32(size) / f32(h), f32(size) / f32(w))
    new_w, new_h = round(float(f32(w) * r)), round(float(f32(h) * r))
    if new_w < 1 or new_h < 1:  # its resize would divide by zero, and nothing of it would be seen
        raise RuntimeInputError(f"letterbox: a {w}x{h} image has no pixel left in the {size}x{size} frame (it "
                                f"scales to {new_w}x{new_h}); allowed: a long side under {2 * size} times the short side")
    dw, dh = f32(size - new_w) / f32(2), f32(size - new_h) / f32(2)
    left, top = round(float(dw - f32(0.1))), round(float(dh - f32(0.1)))
    return LetterboxGeometry(float(r), new_w, new_h, left, top, float(f32(new_w) / f32(w)),
                             float(f32(new_h) / f32(h)))


def _letterbox_args(params: Mapping[str, Any], dims: Mapping[str, int]) -> dict[str, Any]:
    return letterbox_geometry(dims["H"], dims["W"], int(params["size"])).values()


# roles.host_args -> the launch args it computes from the params and the bound dims
HOST_ARGS = {"letterbox_geometry": _letterbox_args}


def host_values(contract: Contract, params: Mapping[str, Any], dims: Mapping[str, int]) -> dict[str, Any]:
    """The launch args a contract takes from the host besides tensors and dims (its roles.host_args)."""
    name = contract.model.roles.host_args
    return HOST_ARGS[name](params, dims) if name else {}
