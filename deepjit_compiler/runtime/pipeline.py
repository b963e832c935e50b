"""A loaded bundle on one CUDA stream: `Pipeline.load(bundle)`, then `pipeline(feeds)`.

    with Pipeline.load("build/yolov8s_h200") as pipe:
        dets = pipe({"images": x})                 # num_dets, boxes, scores, classes

Load: every device buffer is allocated once, sized by the profile's max shapes (batch b is a prefix
of each); pinned host staging for what crosses between host and device; each kernel loads its cubin
when the bundle's SM is this GPU's, else its PTX (with a warning); per batch bucket the device work
is launched once plainly and captured as a CUDA graph.

A call: inputs are checked against the profile, padded up to the batch's bucket (the rows past the
batch hold whatever an earlier call left: zeros after load; images never mix, so they cannot change
the real rows, which are sliced back), and the phases run in plan order. A device phase is host
copies into pinned staging, one async H2D copy per tensor, one graph replay, then async D2H copies;
the stream is synchronized once, at the end. With the engine on the GPU (TensorRT, or ONNX Runtime's
CUDA provider with IO binding over these buffers on this stream) engine and kernels are one device
phase: the inputs go in, the outputs come out, nothing crosses in between; its graph holds the engine
too where the engine can be captured from outside, else the kernels around it are captured on their
own (graphs.PreparedPhase). With the engine on the CPU (ONNX Runtime without onnxruntime-gpu) it runs
between device phases on host arrays; a stage before the engine (letterbox on the GPU) then costs a
D2H copy and a synchronize before the engine: the price of a CPU engine.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..bundle.folder import read_bundle
from ..bundle.view import BundleView
from ..errors import KernelError
from .code import choose_code
from .gpu import DeviceArray, Gpu, driver_version
from .graphs import EngineCall, PreparedPhase, view
from .hostmem import PinnedBuffer, capacity, d2h_async, h2d_async
from .launch import ContractKernel, host_values
from .layout import (
    Layout,
    LayoutFacts,
    Phase,
    StepInfo,
    kernel_dims,
    kernel_workspace,
    nbytes,
)
from .segments import engine_runner

log = logging.getLogger("deepjit.runtime")

MAX_LAZY_GRAPHS = 16  # graphs captured for new non-batch shapes (dynamic sizes), per phase


class CountingGpu(Gpu):
    """A Gpu whose device allocations are counted: after load, a call must add none."""

    def __init__(self, ordinal: int = 0):
        super().__init__(ordinal)
        self.allocations = 0
        self.allocated_bytes = 0

    def empty(self, shape, dtype, name: str | None = None) -> DeviceArray:
        arr = super().empty(shape, dtype, name)
        self.allocations += 1
        self.allocated_bytes += capacity(arr)
        return arr


_new_gpu = CountingGpu  # the device a Pipeline loads on (tests swap in a host-memory fake)


class Pipeline(LayoutFacts):
    """A bundle loaded on this GPU. Not thread-safe: one call at a time."""

    def __init__(self, bundle: BundleView, layout: Layout, gpu: CountingGpu, prefer: str, graphs: bool,
                 capture: str = "auto", engine: str = "auto", gpu_index: int = 0):
        self.bundle, self.layout, self.gpu, self.graphs, self.gpu_index = bundle, layout, gpu, graphs, gpu_index
        self.prefer, self.capture, self.engine = prefer, capture, engine
        self.code: dict[str, str] = {}
        self._closed = False
        self._buffers: dict[str, DeviceArray] = {}
        self._staging: dict[str, PinnedBuffer] = {}
        self._workspaces: dict[str, DeviceArray | None] = {}
        self._kernels: dict[str, ContractKernel] = {}
        self._runners: dict[str, Any] = {}
        self._on_device: dict[str, bool] = {}
        self._prepared: list[OrderedDict] = []
        self._events: list[tuple] = []
        self._timed: list[tuple] = []
        self._copied = {"h2d": 0, "d2h": 0}
        self._shapes: dict[str, tuple[int, ...]] = {}  # the last call's device tensor shapes

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, bundle: Path | str | BundleView, *, prefer: str = "auto", graphs: bool = True,
             capture: str = "auto", engine: str = "auto", gpu: int = 0) -> Pipeline:
        """Load a bundle (folder, .tar.gz or read BundleView) on GPU `gpu` (an ordinal among the GPUs this
        process sees: a Triton instance's device); BundleError/KernelError when its kernels cannot run
        on this GPU or driver, MissingDependency without a GPU (or that GPU). `engine`: auto
        (a plan where one runs here, else the segment's ONNX on ONNX Runtime, with a warning), plan
        (EngineError naming why when none runs) or onnxruntime (segments.py). `capture`: how a phase
        with an engine is captured (graphs.PreparedPhase.capture; the default suits everyone, the
        others are for measuring the arrangements)."""
        bundle = read_bundle(bundle)
        layout = Layout.from_bundle(bundle)
        self = cls(bundle, layout, _new_gpu(gpu), prefer, graphs, capture, engine, gpu)
        try:
            self._load()
        except BaseException:
            self.close()
            raise
        return self

    def _load(self) -> None:
        layout, gpu = self.layout, self.gpu
        self._load_kernels()
        self._load_engines()
        device_engines = any(self._on_device.values())
        self.schedule = layout.schedule(device_engines)
        self.phases: tuple[Phase, ...] = self.schedule.phases
        self.max_shapes = self._max_shapes()
        self._dtypes = layout.dtypes()
        for name in self.schedule.device_tensors:
            self._buffers[name] = gpu.zeros(self.max_shapes[name], self._dtypes[name], name)
        for step in layout.steps:
            for k in step.kernels:
                size = kernel_workspace(k, kernel_dims(k, self.max_shapes))
                self._workspaces[k.name] = gpu.empty((size,), np.uint8) if size else None
        crossing = {n for p in self.phases for n in (*p.upload, *p.download)} | set(self.schedule.final_download)
        for name in sorted(crossing):
            self._staging[name] = PinnedBuffer(nbytes(self.max_shapes[name], self._dtypes[name]))
        for phase in self.phases:
            self._prepared.append(OrderedDict())
            self._events.append((gpu.event(), gpu.event(), gpu.event(), gpu.event()) if phase.where == "device" else ())
        for bucket in self.buckets:
            for i, phase in enumerate(self.phases):
                if phase.where == "device":
                    shapes = {n: (bucket, *self.max_shapes[n][1:]) for n in phase.reads}
                    self._prepare(i, shapes, bucket, lazy=False)
        gpu.sync()
        log.info("loaded %s on %s (sm_%d): %d device buffers (%.1f MiB), %s graphs for buckets %s; kernels: %s",
                 layout.name or self.bundle.source, gpu.name, gpu.sm, gpu.allocations, gpu.allocated_bytes / 2**20,
                 "CUDA" if self.graphs else "no", ", ".join(map(str, self.buckets)),
                 ", ".join(f"{k} ({c})" for k, c in self.code.items()) or "none")

    def _load_kernels(self) -> None:
        driver = driver_version()
        where = self.layout.name or str(self.bundle.source)
        for k in self.layout.kernels:
            self.code[k.name] = choose_code(k, self.gpu.sm, driver, self.prefer, device_name=self.gpu.name,
                                            bundle_name=where)
        ptx = [name for name, code in self.code.items() if code == "ptx"]
        if ptx and self.prefer == "auto":
            target = f"sm_{self.layout.target_sm}" + (f" ({self.layout.target_gpu})" if self.layout.target_gpu else "")
            log.warning("%s was built for %s; this GPU is sm_%d (%s): loading the PTX of %s, compiled by the driver "
                        "at load; rebuild with target.gpu for this GPU to load cubins", where, target, self.gpu.sm,
                        self.gpu.name, ", ".join(ptx))
        for k in self.layout.kernels:
            self._kernels[k.name] = ContractKernel(self.gpu, self.bundle.compiled(k.view),
                                                   self.code[k.name])

    def _load_engines(self) -> None:
        for step in self.layout.steps:
            if step.kind == "segment":
                runner, on_device = engine_runner(self.bundle, self.layout, step, engine=self.engine,
                                                  device_sm=self.gpu.sm, device_id=self.gpu_index)
                self._runners[step.name], self._on_device[step.name] = runner, on_device

    def _max_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {i.name: tuple(i.max) for i in self.layout.inputs}
        for step in self.layout.steps:  # in order: a segment's inputs may be a kernel's outputs
            probe: dict[str, tuple[int, ...]] = {}
            if step.kind == "segment" and any(self.layout.engine_output_shape(t, self.max_batch, shapes) is None
                                              for t in step.outputs):
                probe = self._probe(step, shapes)
            shapes = self.layout.shapes([step], shapes, self.max_batch, probe)
        return shapes

    def _probe(self, step: StepInfo, known: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Output shapes the manifest leaves symbolic: run the engine once at these input shapes."""
        log.info("segment '%s': output shapes depend on the data; running it once at %s", step.name,
                 {t.name: known[t.name] for t in step.inputs})
        feed = {t.name: np.zeros(known[t.name], t.dtype) for t in step.inputs}
        return {k: tuple(v.shape) for k, v in self._runners[step.name].infer(feed).items()}

    # -- preparing a phase -----------------------------------------------------------------------
    def _prepare(self, index: int, reads: Mapping[str, tuple[int, ...]], bucket: int, *, lazy: bool) -> PreparedPhase:
        phase = self.phases[index]
        steps = [self.layout.step(s) for s in phase.steps]
        shapes = dict(reads)
        for step in steps:
            shapes = self.layout.shapes([step], shapes, bucket, self._engine_shapes(step, shapes))
        views = {n: view(self._buffers[n], s) for n, s in shapes.items() if n in self._buffers}
        items: list = []
        count = 0
        for step in steps:
            if step.kind == "segment":
                items.append(self._enqueue(step, views))
                continue
            for k in step.kernels:
                kernel = self._kernels[k.name]
                dims = kernel_dims(k, shapes)
                values = {s.name: views[k.plan_name(s.name)] for s in k.sigs}
                values.update(workspace=self._workspaces[k.name], **host_values(k.contract, k.params, dims))
                plan = kernel.prepare(values, dims)
                items += plan
                count += len(plan)
        prepared = PreparedPhase(self.gpu, items, {n: shapes[n] for n in views}, count)
        prepared.launch()  # a plain run first: loads the functions and lets engines settle before capture
        if self.graphs:
            prepared.capture(self.capture)
        cache = self._prepared[index]
        cache[_key(bucket, reads)] = prepared
        if lazy:
            log.info("phase %d prepared%s for new shapes %s", index, " and captured" if self.graphs else "",
                     dict(reads))
            lazy_keys = [key for key in cache if key not in self._load_keys(index)]
            if len(lazy_keys) > MAX_LAZY_GRAPHS:
                cache.pop(lazy_keys[0]).close()
        return prepared

    def _load_keys(self, index: int) -> set:
        reads = self.phases[index].reads
        return {_key(b, {n: (b, *self.max_shapes[n][1:]) for n in reads}) for b in self.buckets}

    def _engine_shapes(self, step: StepInfo, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """A device engine's output shapes for these input shapes: asked of it (TensorRT), else from the
        manifest's dims, else from one run on zeros of those shapes (ONNX Runtime tells only by running)."""
        if not self._on_device.get(step.name):
            return {}
        runner = self._runners[step.name]
        inputs = {t.name: tuple(shapes[t.name]) for t in step.inputs}
        told = runner.output_shapes(inputs)
        if told or all(self.layout.engine_output_shape(t, shapes[step.inputs[0].name][0], shapes) is not None
                       for t in step.outputs):
            return told
        return self._probe(step, inputs)

    def _enqueue(self, step: StepInfo, views: Mapping[str, DeviceArray]) -> EngineCall:
        names = [t.name for t in (*step.inputs, *step.outputs)]
        return EngineCall(self._runners[step.name], int(self.gpu.stream.handle), {n: views[n].ptr for n in names},
                          {n: tuple(views[n].shape) for n in names})

    # -- running ---------------------------------------------------------------------------------
    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the pipeline on `feeds` (batch n <= max_batch): outputs with n rows, in plan order."""
        if self._closed:
            raise KernelError("this pipeline was closed")
        n = self.layout.check_feeds(feeds)
        bucket = self.layout.bucket_for(n)
        host: dict[str, np.ndarray] = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
        shapes: dict[str, tuple[int, ...]] = {}
        gpu, self._timed, copied = self.gpu, [], {"h2d": 0, "d2h": 0}
        self._copied = copied
        device_phases = [i for i, p in enumerate(self.phases) if p.where == "device"]
        for i, phase in enumerate(self.phases):
            if phase.where == "host":
                if phase.download:
                    for name in phase.download:
                        host[name] = self._stage(name, (n, *shapes[name][1:]))
                        d2h_async(gpu, host[name], self._buffers[name])
                        copied["d2h"] += host[name].nbytes
                    gpu.sync()
                for step in phase.steps:
                    runner = self._runners[step]
                    host.update(runner.infer({t: host[t] for t in self.layout.step(step).reads}))
                continue
            start, end, k0, k1 = self._events[i]
            staged = {name: self._stage(name, host[name].shape) for name in phase.upload}
            for name, view_ in staged.items():  # the host's one copy, before the GPU part starts
                np.copyto(view_, host[name])
                shapes[name] = (bucket, *host[name].shape[1:])
            gpu.record(start)
            for name, view_ in staged.items():
                h2d_async(gpu, self._buffers[name], view_)
                copied["h2d"] += view_.nbytes
            reads = {r: shapes[r] for r in phase.reads}
            prepared = self._prepared[i].get(_key(bucket, reads)) or self._prepare(i, reads, bucket, lazy=True)
            gpu.record(k0)
            prepared.run(self.graphs)
            gpu.record(k1)
            shapes.update(prepared.shapes)
            if i != device_phases[-1]:
                gpu.record(end)
                self._timed.append((start, end, k0, k1))
        out_host = {}
        for name in self.schedule.final_download:
            out_host[name] = self._stage(name, (n, *shapes[name][1:]))
            d2h_async(gpu, out_host[name], self._buffers[name])
            copied["d2h"] += out_host[name].nbytes
        if device_phases:
            gpu.record(self._events[device_phases[-1]][1])
            self._timed.append(self._events[device_phases[-1]])
        gpu.sync()
        self._shapes = shapes
        return {o.name: out_host[o.name].copy() if o.name in out_host else host[o.name][:n]
                for o in self.layout.outputs}

    def read(self, name: str) -> np.ndarray:
        """A device tensor as the last call left it (at its bucket's shape), copied to the host: what an
        engine segment or a kernel wrote, for tests and debugging."""
        if name not in self._shapes or name not in self._buffers:
            raise KernelError(f"'{name}' is not a device tensor of the last call; those are "
                              f"{', '.join(n for n in self._shapes if n in self._buffers) or 'none'}")
        out = np.empty(self._shapes[name], self._dtypes[name])
        d2h_async(self.gpu, out, view(self._buffers[name], out.shape))
        self.gpu.sync()
        return out

    def _stage(self, name: str, shape) -> np.ndarray:
        return self._staging[name].array(shape, self._dtypes[name])

    def last_timing(self) -> dict[str, float]:
        """GPU milliseconds of the last call from its events: `gpu_ms` (copies + kernels/graphs of
        every device phase, the final copies included) and `kernels_ms` (the replays alone)."""
        gpu_ms = sum(self.gpu.elapsed_ms(s, e) for s, e, _, _ in self._timed)
        kernels_ms = sum(self.gpu.elapsed_ms(a, b) for _, _, a, b in self._timed)
        return {"gpu_ms": gpu_ms, "kernels_ms": kernels_ms}

    def last_copies(self) -> dict[str, int]:
        """Bytes the last call copied host -> device (`h2d`) and device -> host (`d2h`): with the engine
        on the GPU, the inputs and the outputs alone; with it on the CPU, also everything it reads and makes."""
        return dict(self._copied)

    # -- facts (inputs, outputs, buckets, max_batch: LayoutFacts) --------------------------------
    @property
    def allocations(self) -> int:
        """Device allocations made so far; load makes them all, calls add none."""
        return self.gpu.allocations

    def describe(self) -> dict[str, Any]:
        """What runs where, for `run` and `bench`: this GPU, each kernel's code, the engines."""
        return {"bundle": self.layout.name, "digest": self.layout.digest, "device": self.gpu.name, "sm": self.gpu.sm,
                "kernels": dict(self.code), "graphs": self.graphs,
                "engine": ", ".join(dict.fromkeys(r.describe() for r in self._runners.values())) or "none",
                "capture": self.capture_modes()}

    def capture_modes(self) -> str:
        """How the device phases were captured: 'whole' (one graph with the engine in it), 'split'
        (graphs around an engine that cannot be captured, which runs through its own graph where it
        has one), 'split_plain' (the same, the engine run plainly), 'off', or a mix as 'whole, split'."""
        modes = [p.mode for cache in self._prepared for p in cache.values()]
        return ", ".join(dict.fromkeys(modes)) or "none"

    def _bucket_phases(self, batch: int) -> list[PreparedPhase]:
        """The prepared device phases a call at this batch runs (its bucket's, at the max shapes)."""
        bucket = self.layout.bucket_for(batch)
        out = []
        for i, phase in enumerate(self.phases):
            keys = [k for k in self._prepared[i] if k[0] == bucket] if phase.where == "device" else []
            out += [self._prepared[i][keys[-1]]] if keys else []
        return out

    def launches_per_inference(self, batch: int) -> int:
        """Kernels launched per call at this batch (its bucket's), engine kernels not counted."""
        return sum(p.kernel_launches for p in self._bucket_phases(batch))

    def graph_launches_per_inference(self, batch: int | None = None) -> int:
        """CUDA graph launches per call: one per device phase captured whole, one per run of kernels
        between engines for a phase captured split, 0 without graphs."""
        if not self.graphs:
            return 0
        return sum(p.graph_launches for p in self._bucket_phases(batch or self.buckets[0]))

    # -- closing ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for cache in self._prepared:
            for prepared in cache.values():
                prepared.close()
        for runner in self._runners.values():
            try:
                runner.deactivate()
            except Exception as e:  # a runner that failed to activate has nothing to release
                log.debug("deactivating %s: %s", getattr(runner, "name", runner), e)
        for events in self._events:
            for ev in events:
                self.gpu.destroy_event(ev)
        for buf in self._staging.values():
            buf.close()
        for arr in [*self._buffers.values(), *(w for w in self._workspaces.values() if w is not None)]:
            arr.buffer.close()
        self._prepared, self._events, self._staging, self._buffers, self._workspaces = [], [], {}, {}, {}

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key(bucket: int, reads: Mapping[str, tuple[int, ...]]) -> tuple:
    return (bucket, tuple(sorted((n, tuple(s)) for n, s in reads.items())))
