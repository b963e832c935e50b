"""The TensorRT backend, for both flavours (TensorRT and TensorRT-RTX; what differs is in flavours.py):
build a segment into a plan through Polygraphy's loaders, run the plan on our stream.

Follows TensorRT 10.x and 11.x (docs.nvidia.com/deeplearning/tensorrt: the Python API reference,
"Migrating from TensorRT 10.x to 11.x" and its Python API pages), TensorRT-RTX 1.7 (same builder,
network, parser and runtime API, module `tensorrt_rtx`) and Polygraphy 0.53's loaders:

- build: `NetworkFromOnnxPath(path, strongly_typed=True)` (NetworkDefinitionCreationFlag.STRONGLY_TYPED:
  the precision is in the graph; TensorRT 11 and TensorRT-RTX are always strongly typed),
  `CreateConfig(profiles=[Profile], memory_pool_limits={trt.MemoryPoolType.WORKSPACE: n},
  load_timing_cache=path, builder_optimization_level=0..5,
  hardware_compatibility_level=trt.HardwareCompatibilityLevel.AMPERE_PLUS | SAME_COMPUTE_CAPABILITY)`
  (TensorRT-RTX: `CreateConfigRTX(..., compute_capabilities=[(7, 5)])`, no timing cache),
  `EngineBytesFromNetwork(network, config, save_timing_cache=path)`. TensorRT 11 removed
  BuilderFlag.FP16/BF16/INT8 and calibrators; only a TensorRT 10.x build with
  `strongly_typed=False` gets `fp16=`/`bf16=`/`int8=` (BuilderFlag.FP16/BF16/INT8) to match the graph.
- run: `trt.Runtime(logger).deserialize_cuda_engine(plan)`, `engine.create_execution_context()`
  (TensorRT-RTX: with a runtime config holding its runtime cache), then per launch
  `context.set_input_shape(name, shape)`, `context.set_tensor_address(name, ptr)`,
  `context.execute_async_v3(stream_handle)`. Polygraphy's TrtRunner owns its stream; the runtime
  needs ours (one stream for kernels and engines, and CUDA graph capture), hence this runner.

The spec-to-config mapping is a pure function over names (`config_from_settings`), turned into
TensorRT enums only at build time; `build_plan` runs in a process where Polygraphy drives the
flavour (worker.py), and plans.py caches what it builds.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from polygraphy import config as polygraphy_config
from polygraphy import cuda
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.tensorrt_rtx import CreateConfigRTX
from polygraphy.backend.trt import (
    CreateConfig,
    EngineBytesFromNetwork,
    NetworkFromOnnxPath,
    Profile,
)
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType
from polygraphy.exception import PolygraphyException

from .. import config
from ..errors import EngineError, RuntimeInputError
from ..files import atomic_file, atomic_write
from .base import EngineSettings, Shape
from .flavours import TENSORRT, TENSORRT_RTX, Flavour

log = logging.getLogger("deepjit.engines.tensorrt")

# Builder flags that match a graph's precision, for TensorRT 10.x weakly typed builds only.
WEAK_TYPING_FLAGS = {"fp32": {}, "fp16": {"fp16": True}, "bf16": {"bf16": True}, "int8": {"int8": True}}
SegmentInputs = Sequence[tuple[str, tuple[int | None, ...]]]


def trt_major(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        raise EngineError(f"cannot read a TensorRT version from {version!r}") from None


def segment_inputs(path: str | Path) -> list[tuple[str, tuple[int | None, ...]]]:
    """(name, dims) of an ONNX file's real inputs; None for a symbolic dim."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # OSError, or protobuf's DecodeError for bytes that are not an ONNX model
        raise EngineError(f"segment {Path(path).name}: not a readable ONNX model ({e})") from None
    inits = {t.name for t in model.graph.initializer}
    return [(vi.name, tuple(d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim))
            for vi in model.graph.input if vi.name not in inits]


def profile_rows(settings: EngineSettings, inputs: SegmentInputs | None = None) -> list[tuple[str, Shape, Shape, Shape]]:
    """(name, min, opt, max) of the one optimization profile covering the segment's dynamic inputs: the
    spec's min/opt/max for an input it names; for an internal tensor with only its batch dim dynamic,
    the spec's batch range."""
    if inputs is None:
        return [(p.name, p.min, p.opt, p.max) for p in settings.profiles]
    rows = []
    for name, dims in inputs:
        p = settings.profile(name)
        if p is not None:
            bad = len(p.opt) != len(dims) or any(d is not None and d != o for d, o in zip(dims, p.opt))
            if bad:
                raise EngineError(f"engine profile for '{name}' {list(p.opt)} does not fit the segment's "
                                  f"input {_show(dims)}")
            rows.append((name, p.min, p.opt, p.max))
        elif None not in dims:
            continue
        elif None not in dims[1:] and settings.profiles:
            b = settings.profiles[0]
            rows.append((name, (b.min[0], *dims[1:]), (b.opt[0], *dims[1:]), (b.max[0], *dims[1:])))
        else:
            raise EngineError(f"segment input '{name}' {_show(dims)} has dynamic dims beyond the batch; "
                              "give it an engine profile (min/opt/max)")
    return rows


def profiles_for(settings: EngineSettings, inputs: SegmentInputs | None = None) -> list[Profile]:
    """`profile_rows` as Polygraphy Profiles (none when every input is static)."""
    rows = profile_rows(settings, inputs)
    if not rows:
        return []
    profile = Profile()
    for name, lo, mid, hi in rows:
        profile.add(name, tuple(lo), tuple(mid), tuple(hi))
    return [profile]


def config_from_settings(settings: EngineSettings, *, inputs: SegmentInputs | None = None,
                         trt_version: str = "11.0", flavour: Flavour = TENSORRT) -> dict:
    """Keyword arguments for Polygraphy's CreateConfig (CreateConfigRTX for TensorRT-RTX), with
    TensorRT enums still as names (see `resolve_enums`): profiles, workspace pool, optimization level;
    for TensorRT the timing cache, hardware compatibility and, for 10.x weakly typed builds, the
    precision's builder flag; for TensorRT-RTX the target's compute capability (flavours.py)."""
    kwargs: dict = {
        "memory_pool_limits": {"WORKSPACE": settings.workspace_bytes},
        "builder_optimization_level": settings.optimization_level,
    }
    profiles = profiles_for(settings, inputs)
    if profiles:
        kwargs["profiles"] = profiles
    if flavour.ahead_of_time:
        if settings.target_sm is None:
            raise EngineError(f"{flavour.title} builds for named compute capabilities: the settings name no target")
        kwargs["compute_capabilities"] = [(settings.target_sm // 10, settings.target_sm % 10)]
    if flavour.timing_cache and settings.timing_cache is not None:
        kwargs["load_timing_cache"] = str(settings.timing_cache)
    # TensorRT-RTX plans run on the compute capabilities they are built for: no hardware compatibility level.
    if not flavour.ahead_of_time and settings.hardware_compatibility != "none":
        kwargs["hardware_compatibility_level"] = settings.hardware_compatibility.upper()
    if not flavour.always_strongly_typed and trt_major(trt_version) < 11 and not settings.strongly_typed:
        kwargs.update(WEAK_TYPING_FLAGS[settings.precision])
    return kwargs


def network_kwargs(settings: EngineSettings, trt_version: str, flavour: Flavour = TENSORRT) -> dict:
    """Keyword arguments for Polygraphy's NetworkFromOnnxPath."""
    return {"strongly_typed": flavour.always_strongly_typed or trt_major(trt_version) >= 11 or settings.strongly_typed}


def resolve_enums(kwargs: Mapping, trt_module) -> dict:
    """`config_from_settings`'s names turned into the TensorRT module's enum members."""
    out = dict(kwargs)
    try:
        if "memory_pool_limits" in out:
            out["memory_pool_limits"] = {getattr(trt_module.MemoryPoolType, k): v
                                         for k, v in out["memory_pool_limits"].items()}
        if "hardware_compatibility_level" in out:
            out["hardware_compatibility_level"] = getattr(trt_module.HardwareCompatibilityLevel,
                                                          out["hardware_compatibility_level"])
    except AttributeError as e:
        raise EngineError(f"TensorRT {getattr(trt_module, '__version__', '?')} lacks a setting the spec asks "
                          f"for ({e}); change engine.hardware_compatibility or use a newer TensorRT") from None
    return out


def build_plan(segment_path: str | Path, settings: EngineSettings, flavour: Flavour, *,
               timing_cache: str | Path | None = None, segment_name: str | None = None) -> tuple[bytes, dict]:
    """Build one segment's ONNX file into a plan in this process, through Polygraphy's loaders:
    (plan bytes, `network_summary` of the parsed network). Polygraphy must drive `flavour` in this
    process (worker.py runs this in a child whose environment says which). TensorRT's timing cache
    (argument, else settings.timing_cache) is loaded if present and saved back."""
    module = flavour.module
    version = module.__version__  # raises MissingDependency without the library
    if polygraphy_config.USE_TENSORRT_RTX != flavour.polygraphy_rtx:
        driven = "TensorRT-RTX" if polygraphy_config.USE_TENSORRT_RTX else "TensorRT"
        raise EngineError(f"internal: Polygraphy drives {driven} in this process, not {flavour.title} (build plans "
                          "through engines.worker)")
    path = Path(segment_path)
    name = segment_name or path.stem
    cache = None
    if flavour.timing_cache:
        cache = Path(timing_cache) if timing_cache is not None else settings.timing_cache
    kwargs = config_from_settings(dataclasses.replace(settings, timing_cache=cache), inputs=segment_inputs(path),
                                  trt_version=version, flavour=flavour)
    create_config = CreateConfigRTX if flavour.ahead_of_time else CreateConfig
    # The timing cache is saved whole or not at all: Polygraphy writes a path in place (a killed build
    # would leave a truncated cache that the next one loads), so it gets a file that atomic_file puts
    # at the path only when the build succeeded (the cache it loaded is merged in by the builder).
    with atomic_file(cache) if cache is not None else contextlib.nullcontext() as sink:
        try:
            builder, network, parser = NetworkFromOnnxPath(str(path), **network_kwargs(settings, version, flavour))()
            summary = network_summary(network)
            plan = EngineBytesFromNetwork((builder, network, parser),
                                          config=create_config(**resolve_enums(kwargs, module)),
                                          save_timing_cache=sink)()
        except PolygraphyException as e:
            raise EngineError(f"segment '{name}' ({path.name}): {flavour.title} {version} could not build it: "
                              f"{e}") from None
        if plan is None:
            raise EngineError(f"segment '{name}' ({path.name}): {flavour.title} {version} returned no plan "
                              "(see its log)")
    return bytes(memoryview(plan)), summary


# TensorRT's DataType names -> the dtype names DeepJIT uses (graph/tensors.py).
DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "UINT8": "uint8",
          "INT32": "int32", "INT64": "int64", "BOOL": "bool", "FP8": "float8_e4m3fn", "INT4": "int4"}


def dtype_name(trt_dtype) -> str:
    name = getattr(trt_dtype, "name", str(trt_dtype))
    return DTYPES.get(name, name.lower())


def numpy_dtype(name: str) -> np.dtype:
    """np.dtype of a `dtype_name` (bfloat16 and float8 from ml_dtypes)."""
    return np.dtype(getattr(ml_dtypes, name)) if name in ("bfloat16", "float8_e4m3fn", "int4") else np.dtype(name)


def network_summary(network) -> dict:
    """Layer count and I/O tensors (name, dtype, TensorRT shape: -1 for a dynamic dim) of a parsed network."""
    def tensor(t) -> dict:
        return {"name": t.name, "dtype": dtype_name(t.dtype), "shape": [int(d) for d in t.shape]}

    return {"layers": int(network.num_layers),
            "inputs": [tensor(network.get_input(i)) for i in range(network.num_inputs)],
            "outputs": [tensor(network.get_output(i)) for i in range(network.num_outputs)]}


def parse_network(onnx_bytes: bytes, flavour: Flavour, *, label: str = "model") -> dict:
    """`network_summary` of an ONNX model as the flavour's ONNX parser reads it (no build, no GPU, no
    Polygraphy: the library's own Builder / OnnxParser)."""
    module = flavour.module
    logger = module.Logger(module.Logger.ERROR)
    builder = module.Builder(logger)
    network = builder.create_network(1 << int(module.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = module.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"{label}: the {flavour.title} {module.__version__} ONNX parser rejects it: {errors}")
    return network_summary(network)


# EngineInvalidityDiagnostics bits of TensorRT-RTX's Runtime.get_engine_validity, for messages.
_INVALIDITY = {1: "built by another TensorRT-RTX version", 2: "built for other compute capabilities",
               4: "the CUDA driver is too old", 8: "the CUDA runtime is too old", 16: "not enough GPU memory",
               32: "not a TensorRT-RTX plan (malformed)", 64: "a CUDA error (no usable GPU?)"}


def plan_refusal(plan: bytes, flavour: Flavour = TENSORRT_RTX) -> str | None:
    """Why the installed library refuses `plan` on this machine before deserializing it, in its own
    words (TensorRT-RTX's `Runtime.get_engine_validity`); None when it accepts it or cannot say."""
    module = flavour.module
    runtime = module.Runtime(module.Logger(module.Logger.ERROR))
    check = getattr(runtime, "get_engine_validity", None)
    if check is None:
        return None
    validity, bits = check(plan[:runtime.engine_header_size])
    if validity.name != "INVALID":
        return None
    why = [text for bit, text in _INVALIDITY.items() if int(bits) & bit]
    return (f"{flavour.title} {module.__version__} refuses the plan: "
            + ("; ".join(why) or "invalid here, with no diagnostic (no usable GPU or CUDA driver?)"))


class TrtEngineRunner(BaseRunner):
    """A TensorRT or TensorRT-RTX plan on a caller's CUDA stream (`enqueue`), or Polygraphy-style `infer`
    for the gate. A TensorRT-RTX runner loads and saves the runtime cache of the kernels it compiles
    for this GPU (`runtime_cache`: a file; default under config.runtime_cache_dir(), by plan digest)."""

    def __init__(self, plan: bytes, *, name: str | None = None, flavour: Flavour = TENSORRT,
                 runtime_cache: Path | None = None):
        super().__init__(name=name, prefix="deepjit-trt-runner")
        self._plan, self.flavour = plan, flavour
        self.runtime_cache_path = runtime_cache
        if flavour.runtime_cache and runtime_cache is None:
            self.runtime_cache_path = config.runtime_cache_dir() / f"{hashlib.sha256(plan).hexdigest()[:32]}.cache"

    def activate_impl(self):
        module = self.flavour.module
        self._logger = module.Logger(module.Logger.WARNING)
        self._runtime = module.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(self._plan)
        if self.engine is None:
            raise EngineError(f"{self.name}: {self.flavour.title} {module.__version__} cannot load this plan (built for "
                              "another GPU or version? see its log above; `deepjit materialize` builds a TensorRT "
                              "plan on this machine)")
        self._runtime_cache = None
        if self.flavour.runtime_cache:
            runtime_config = self.engine.create_runtime_config()
            self._runtime_cache = runtime_config.create_runtime_cache()
            if self.runtime_cache_path.is_file() and not self._runtime_cache.deserialize(
                    self.runtime_cache_path.read_bytes()):
                log.info("%s: runtime cache %s is for another GPU, driver or version: starting afresh",
                         self.name, self.runtime_cache_path)
            runtime_config.set_runtime_cache(self._runtime_cache)
            self.context = self.engine.create_execution_context(runtime_config)
        else:
            self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == module.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]

    def _np_dtype(self, name: str) -> np.dtype:
        # By the DataType's name: Polygraphy's "tensorrt" dtype mapping is bound to one flavour's module.
        return numpy_dtype(dtype_name(self.engine.get_tensor_dtype(name)))

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for name in self.inputs:
            shape = [d if d >= 0 else None for d in self.engine.get_tensor_shape(name)]
            meta.add(name, dtype=DataType.from_dtype(self._np_dtype(name)), shape=shape)
        return meta

    def enqueue(self, stream_handle: int, bindings: Mapping[str, int], shapes: Mapping[str, Shape]) -> None:
        """Set the input shapes (outputs' follow), bind every I/O tensor, launch on the stream."""
        missing = [n for n in (*self.inputs, *self.outputs) if n not in bindings] + \
                  [n for n in self.inputs if n not in shapes]
        if missing:
            raise RuntimeInputError(f"{self.name}: no device pointer or shape for {missing}; the engine's "
                                    f"inputs are {self.inputs}, outputs {self.outputs}")
        for name in self.inputs:
            if not self.context.set_input_shape(name, tuple(shapes[name])):
                lo, _, hi = self.engine.get_tensor_profile_shape(name, 0)
                raise RuntimeInputError(f"{self.name}: input '{name}' shape {tuple(shapes[name])} is outside "
                                        f"the engine's profile ({tuple(lo)} .. {tuple(hi)})")
        for name in (*self.inputs, *self.outputs):
            self.context.set_tensor_address(name, int(bindings[name]))
        if not self.context.execute_async_v3(int(stream_handle)):
            raise EngineError(f"{self.name}: execute_async_v3 failed (see {self.flavour.title}'s log above)")

    def output_shape(self, name: str) -> Shape:
        """An output's shape for the input shapes last set."""
        return tuple(self.context.get_tensor_shape(name))

    def output_shapes(self, input_shapes: Mapping[str, Shape]) -> dict[str, Shape]:
        """Every output's shape for these input shapes, as the engine works them out."""
        for name in self.inputs:
            self.context.set_input_shape(name, tuple(input_shapes[name]))
        return {name: self.output_shape(name) for name in self.outputs}

    def describe(self) -> str:
        return f"gpu ({self.flavour.title} {self.flavour.version()})"

    def infer_impl(self, feed_dict):
        stream, buffers = cuda.Stream(), {}
        try:
            start = time.perf_counter()
            for name in self.inputs:
                host = np.ascontiguousarray(feed_dict[name], dtype=self._np_dtype(name))
                self.context.set_input_shape(name, host.shape)
                buffers[name] = cuda.DeviceArray(host.shape, DataType.from_dtype(host.dtype)).copy_from(host, stream)
            for name in self.outputs:
                buffers[name] = cuda.DeviceArray(self.output_shape(name), DataType.from_dtype(self._np_dtype(name)))
            self.enqueue(stream.ptr, {n: b.ptr for n, b in buffers.items()},
                         {n: feed_dict[n].shape for n in self.inputs})
            outputs = OrderedDict()
            for name in self.outputs:
                outputs[name] = buffers[name].copy_to(np.empty(buffers[name].shape, self._np_dtype(name)), stream)
            stream.synchronize()
            self.inference_time = time.perf_counter() - start
            return outputs
        finally:
            for b in buffers.values():
                b.free()
            stream.free()

    def deactivate_impl(self):
        if self._runtime_cache is not None:
            try:
                atomic_write(self.runtime_cache_path, bytes(self._runtime_cache.serialize()))
            except OSError as e:  # a read-only cache folder costs the next load its JIT time, nothing else
                log.warning("%s: cannot save the runtime cache %s: %s", self.name, self.runtime_cache_path, e)
        del self.context, self.engine, self._runtime, self._logger, self._runtime_cache


def _show(dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
