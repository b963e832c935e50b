"""The TensorRT backend: build a segment into a plan through Polygraphy's loaders, run the plan on
our stream with the TensorRT runtime.

Follows TensorRT 10.x and 11.x (docs.nvidia.com/deeplearning/tensorrt: the Python API reference,
"Migrating from TensorRT 10.x to 11.x" and its Python API pages) and Polygraphy 0.53's loaders:

- build: `NetworkFromOnnxPath(path, strongly_typed=True)` (NetworkDefinitionCreationFlag.STRONGLY_TYPED:
  the precision is in the graph; TensorRT 11 is always strongly typed and accepts the flag),
  `CreateConfig(profiles=[Profile], memory_pool_limits={trt.MemoryPoolType.WORKSPACE: n},
  load_timing_cache=path, builder_optimization_level=0..5,
  hardware_compatibility_level=trt.HardwareCompatibilityLevel.AMPERE_PLUS | SAME_COMPUTE_CAPABILITY)`,
  `EngineBytesFromNetwork(network, config, save_timing_cache=path)`. TensorRT 11 removed
  BuilderFlag.FP16/BF16/INT8 and calibrators; only a TensorRT 10.x build with
  `strongly_typed=False` gets `fp16=`/`bf16=`/`int8=` (BuilderFlag.FP16/BF16/INT8) to match the graph.
- run: `trt.Runtime(logger).deserialize_cuda_engine(plan)`, `engine.create_execution_context()`,
  then per launch `context.set_input_shape(name, shape)`, `context.set_tensor_address(name, ptr)`,
  `context.execute_async_v3(stream_handle)`. Polygraphy's TrtRunner owns its stream; the runtime
  needs ours (one stream for kernels and engines, and CUDA graph capture), hence this runner.

TensorRT cannot be installed where DeepJIT is developed: the spec-to-config mapping is a pure
function over names (`config_from_settings`), turned into TensorRT enums only at build time.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from polygraphy import cuda
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.trt import (
    CreateConfig,
    EngineBytesFromNetwork,
    NetworkFromOnnxPath,
    Profile,
)
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType
from polygraphy.exception import PolygraphyException

from .._optional import lazy_import
from ..errors import EngineError, RuntimeInputError
from .base import EngineArtifact, EngineSettings, Shape

log = logging.getLogger("deepjit.engines.tensorrt")

trt = lazy_import("tensorrt", "building TensorRT engines needs TensorRT: install deepjit[tensorrt] or set "
                              "engine.backend: onnxruntime")

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
    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    return [(vi.name, tuple(d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim))
            for vi in model.graph.input if vi.name not in inits]


def profiles_for(settings: EngineSettings, inputs: SegmentInputs | None = None) -> list[Profile]:
    """One optimization profile covering the segment's dynamic inputs: the spec's min/opt/max for an
    input it names; for an internal tensor with only its batch dim dynamic, the spec's batch range."""
    if inputs is None:
        rows = [(p.name, p.min, p.opt, p.max) for p in settings.profiles]
    else:
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
    if not rows:
        return []
    profile = Profile()
    for name, lo, mid, hi in rows:
        profile.add(name, tuple(lo), tuple(mid), tuple(hi))
    return [profile]


def config_from_settings(settings: EngineSettings, *, inputs: SegmentInputs | None = None,
                         trt_version: str = "11.0") -> dict:
    """Keyword arguments for Polygraphy's CreateConfig, with TensorRT enums still as names
    (see `resolve_enums`): profiles, workspace pool, timing cache, optimization level, hardware
    compatibility, and for TensorRT 10.x weakly typed builds the precision's builder flag."""
    kwargs: dict = {
        "memory_pool_limits": {"WORKSPACE": settings.workspace_bytes},
        "builder_optimization_level": settings.optimization_level,
    }
    profiles = profiles_for(settings, inputs)
    if profiles:
        kwargs["profiles"] = profiles
    if settings.timing_cache is not None:
        kwargs["load_timing_cache"] = str(settings.timing_cache)
    if settings.hardware_compatibility != "none":
        kwargs["hardware_compatibility_level"] = settings.hardware_compatibility.upper()
    if trt_major(trt_version) < 11 and not settings.strongly_typed:
        kwargs.update(WEAK_TYPING_FLAGS[settings.precision])
    return kwargs


def network_kwargs(settings: EngineSettings, trt_version: str) -> dict:
    """Keyword arguments for Polygraphy's NetworkFromOnnxPath."""
    return {"strongly_typed": trt_major(trt_version) >= 11 or settings.strongly_typed}


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


def build_engine(segment_path: str | Path, settings: EngineSettings, *, timing_cache: str | Path | None = None,
                 segment_name: str | None = None) -> EngineArtifact:
    """Build one segment's ONNX file into a TensorRT plan (on this machine's GPU). The timing cache
    (argument, else settings.timing_cache) is loaded if present and saved back."""
    version = trt.__version__  # raises MissingDependency without TensorRT
    path = Path(segment_path)
    name = segment_name or path.stem
    cache = Path(timing_cache) if timing_cache is not None else settings.timing_cache
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
    kwargs = config_from_settings(dataclasses.replace(settings, timing_cache=cache),
                                  inputs=segment_inputs(path), trt_version=version)
    start = time.perf_counter()
    try:
        network = NetworkFromOnnxPath(str(path), **network_kwargs(settings, version))
        plan = EngineBytesFromNetwork(network, config=CreateConfig(**resolve_enums(kwargs, trt)),
                                      save_timing_cache=str(cache) if cache is not None else None)()
    except PolygraphyException as e:
        raise EngineError(f"segment '{name}' ({path}): TensorRT {version} could not build it: {e}") from None
    if not plan:
        raise EngineError(f"segment '{name}' ({path}): TensorRT {version} returned no plan (see its log above)")
    log.info("segment %s: TensorRT %s plan, %d bytes, in %.1f s", name, version, len(plan), time.perf_counter() - start)
    settings_json = json.dumps({**settings.to_dict(), "built_with": {"tensorrt": version}}, sort_keys=True)
    return EngineArtifact("tensorrt", name, {f"{name}.plan": bytes(plan)}, settings_json)


class TrtEngineRunner(BaseRunner):
    """A TensorRT plan on a caller's CUDA stream (`enqueue`), or Polygraphy-style `infer` for the gate."""

    def __init__(self, plan: bytes, *, name: str | None = None):
        super().__init__(name=name, prefix="deepjit-trt-runner")
        self._plan = plan

    def activate_impl(self):
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(self._plan)
        if self.engine is None:
            raise EngineError(f"{self.name}: TensorRT {trt.__version__} cannot load this plan (built for another "
                              "GPU or TensorRT version? run `deepjit materialize` on this machine)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for name in self.inputs:
            shape = [d if d >= 0 else None for d in self.engine.get_tensor_shape(name)]
            meta.add(name, dtype=DataType.from_dtype(self.engine.get_tensor_dtype(name), "tensorrt"), shape=shape)
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
            raise EngineError(f"{self.name}: execute_async_v3 failed (see TensorRT's log above)")

    def output_shape(self, name: str) -> Shape:
        """An output's shape for the input shapes last set."""
        return tuple(self.context.get_tensor_shape(name))

    def output_shapes(self, input_shapes: Mapping[str, Shape]) -> dict[str, Shape]:
        """Every output's shape for these input shapes, as the engine works them out."""
        for name in self.inputs:
            self.context.set_input_shape(name, tuple(input_shapes[name]))
        return {name: self.output_shape(name) for name in self.outputs}

    def describe(self) -> str:
        return f"gpu (TensorRT {trt.__version__})"

    def infer_impl(self, feed_dict):
        def np_dtype(name):
            return DataType.to_dtype(DataType.from_dtype(self.engine.get_tensor_dtype(name), "tensorrt"), "numpy")

        stream, buffers = cuda.Stream(), {}
        try:
            start = time.perf_counter()
            for name in self.inputs:
                host = np.ascontiguousarray(feed_dict[name], dtype=np_dtype(name))
                self.context.set_input_shape(name, host.shape)
                buffers[name] = cuda.DeviceArray(host.shape, DataType.from_dtype(host.dtype)).copy_from(host, stream)
            for name in self.outputs:
                buffers[name] = cuda.DeviceArray(self.output_shape(name), DataType.from_dtype(np.dtype(np_dtype(name))))
            self.enqueue(stream.ptr, {n: b.ptr for n, b in buffers.items()},
                         {n: feed_dict[n].shape for n in self.inputs})
            outputs = OrderedDict()
            for name in self.outputs:
                outputs[name] = buffers[name].copy_to(np.empty(buffers[name].shape, np_dtype(name)), stream)
            stream.synchronize()
            self.inference_time = time.perf_counter() - start
            return outputs
        finally:
            for b in buffers.values():
                b.free()
            stream.free()

    def deactivate_impl(self):
        del self.context, self.engine, self._runtime, self._logger


def _show(dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
