"""A bundle's run plan, read from its manifest without a GPU.

`Layout.from_bundle(bundle)` gives the pipeline's inputs (batch range, buckets), its outputs, and its
steps: engine segments, and kernel steps (cut sites, added stages) whose tensors come from their
contracts, so a kernel step reads what its kernels read (nms reads the decode's `cand_*`, not the
`output0` its reference reads). `schedule()` groups the steps into device phases (kernels, and engines
when they run on the GPU; one CUDA graph per bucket each) and host phases (an engine on the CPU),
with the copies between them. `shapes()` propagates tensor shapes through the kernels' contracts,
which is how the runtime sizes its buffers (at the max batch) and its per-bucket views.

Everything here is plain Python over the manifest and the contract YAML: the CPU tests use it, and
so does the runtime before it touches the GPU.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..bundle.view import BundleView, EngineView, InputView, KernelView, StepView
from ..errors import BundleError, closest
from ..graph.tensors import TensorSig
from ..jit.contract_models import Detections
from ..jit.contracts import (
    Contract,
    Launch,
    bind_dims,
    concrete_shape,
    launches,
    load_contract,
    resolve_params,
    signature,
    site_inputs,
    workspace_bytes,
)
from .inputs import bucket_for, check_feeds, show_shape
from .launch import host_values

log = logging.getLogger("deepjit.runtime")

Shape = tuple[Any, ...]         # ints, and str for symbolic dims


@dataclass(frozen=True, slots=True)
class KernelInfo:
    """One compiled kernel of a step: its manifest record, its contract, and the plan tensors it
    reads and writes (`aliases` maps the contract's tensor names to the plan's)."""

    step: str
    index: int
    view: KernelView
    contract: Contract
    params: Mapping[str, Any]
    sigs: tuple[TensorSig, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.step}/{self.contract.name}"

    @property
    def sm(self) -> int:
        return self.view.sm

    @property
    def entry(self) -> Mapping[str, Any]:
        return self.view.entry

    def plan_name(self, kernel_name: str) -> str:
        return self.aliases.get(kernel_name, kernel_name)

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(self.plan_name(s.name) for s in self.sigs if s.role == "input")

    @property
    def writes(self) -> tuple[str, ...]:
        return tuple(self.plan_name(s.name) for s in self.sigs if s.role == "output")


@dataclass(frozen=True, slots=True)
class StepInfo:
    """A plan step as the runtime runs it: the bundle's record of it (`segment`, `kernel` or `added`)
    and its kernels with their contracts."""

    view: StepView
    kernels: tuple[KernelInfo, ...] = ()

    @property
    def name(self) -> str:
        return self.view.name

    @property
    def kind(self) -> str:
        return self.view.kind

    @property
    def inputs(self) -> tuple[TensorSig, ...]:
        return self.view.inputs

    @property
    def outputs(self) -> tuple[TensorSig, ...]:
        return self.view.outputs

    @property
    def file(self) -> str | None:
        """A segment's ONNX (its engine when no plan runs it)."""
        return self.view.file if self.kind == "segment" else None

    @property
    def reads(self) -> tuple[str, ...]:
        """Tensors this step needs from earlier steps (a kernel step's from its contracts)."""
        if self.kind == "segment":
            return tuple(t.name for t in self.inputs)
        made: set[str] = set()
        out: list[str] = []
        for k in self.kernels:
            out += [n for n in k.reads if n not in made and n not in out]
            made.update(k.writes)
        return tuple(out)

    @property
    def writes(self) -> tuple[str, ...]:
        if self.kind == "segment":
            return tuple(t.name for t in self.outputs)
        return tuple(n for k in self.kernels for n in k.writes)


@dataclass(frozen=True, slots=True)
class Phase:
    """Consecutive steps that run in one place. A device phase is captured as one CUDA graph per
    bucket; `upload` lists the host tensors copied in before it. A host phase is an engine on the
    CPU; `download` lists the device tensors copied out (and synchronized on) before it."""

    where: str                              # "device" | "host"
    steps: tuple[str, ...]
    reads: tuple[str, ...]                  # tensors read from outside the phase
    upload: tuple[str, ...] = ()
    download: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Schedule:
    phases: tuple[Phase, ...]
    final_download: tuple[str, ...]         # device tensors among the outputs, copied out at the end
    device_tensors: tuple[str, ...]         # every tensor that needs a device buffer


def site_aliases(contract: Contract, params: Mapping[str, Any], site: Sequence[TensorSig],
                 where: str) -> dict[str, str]:
    """Contract tensor names -> plan tensor names for the inputs that declare `site_input` (a position
    among the step's inputs, e.g. yolov8_decode's box_i/cls_i are the cut's head maps)."""
    out = {}
    for name, pos in site_inputs(contract, params).items():
        if pos >= len(site):
            raise BundleError(f"{where}: input '{name}' reads site input {pos}, but the step has {len(site)} "
                              f"inputs: {', '.join(t.name for t in site)}")
        out[name] = site[pos].name
    return out


def _kernel(k: KernelView, inputs: Sequence[TensorSig], view: BundleView) -> KernelInfo:
    contract = view.contract(k)
    sigs = signature(contract, k.params)
    return KernelInfo(k.step, k.index, k, contract, k.params, sigs,
                      site_aliases(contract, k.params, inputs, f"kernel {k.name}"))


def _planned_kernel(step, index: int, ref: str, facts: Mapping[str, Any], given: Mapping[str, Any], sm: int,
                    spec_dir: Path | None) -> KernelInfo:
    """A kernel of a build plan's step as the bundle will record it, before it is compiled (no files yet)."""
    contract = load_contract(ref, spec_dir=spec_dir)
    params = resolve_params(contract, given, facts)
    view = KernelView(step.name, index, ref, params, sm, {}, {})
    return KernelInfo(step.name, index, view, contract, params, signature(contract, params),
                      site_aliases(contract, params, step.inputs, f"kernel {view.name}"))


def _planned_input(t: TensorSig, declared) -> InputView:
    """A plan input as the bundle will record it: the spec's profile and buckets (ending at the max), or its
    own static shape when the spec declares none."""
    lo, opt, hi = (declared.min_shape, declared.opt_shape, declared.max_shape) if declared else (t.shape,) * 3
    buckets = declared.batch_buckets if declared else ()
    return InputView(t.name, t.dtype, t.shape, tuple(lo), tuple(opt), tuple(hi), tuple(sorted({*buckets, hi[0]})))


@dataclass(frozen=True, slots=True)
class Layout:
    """What a bundle runs, in order, and over which tensors."""

    name: str
    digest: str
    target_sm: int | None
    target_gpu: str | None
    inputs: tuple[InputView, ...]
    outputs: tuple[TensorSig, ...]
    steps: tuple[StepInfo, ...]
    engine: EngineView

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_bundle(cls, view: BundleView) -> Layout:
        """The bundle's run plan; each kernel's contract is the bundle's copy."""
        steps = tuple(StepInfo(s, tuple(_kernel(k, s.inputs, view) for k in s.kernels))
                      for s in view.steps)
        return cls(view.name, view.digest, view.target_sm, view.target_gpu, view.inputs, view.outputs, steps,
                   view.engine)

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> Layout:
        """The run plan of a manifest alone (no files, so contracts by name): what a test edits."""
        return cls.from_bundle(BundleView(Path("."), {**manifest, "files": {}}))

    @classmethod
    def from_plan(cls, plan, spec, spec_dir: Path | None = None) -> Layout:
        """The run plan a build's Plan makes, before its kernels are compiled (their records hold the
        contract as the spec names it and the resolved params, no files): what the build checks launches
        on, so they are bound from the shapes the runtime will see."""
        sm = spec.target.resolved_sm
        steps = []
        for s in plan.steps:
            kernels = () if s.kind == "segment" else tuple(
                _planned_kernel(s, i, str(k.contract), plan.kernel_facts(s), k.params, sm, spec_dir)
                for i, k in enumerate(s.kernels))
            view = StepView(s.name, s.kind, s.inputs, s.outputs, "", tuple(k.view for k in kernels))
            steps.append(StepInfo(view, kernels))
        inputs = tuple(_planned_input(t, spec.inputs.get(t.name)) for t in plan.inputs)
        engine = EngineView(spec.engine.backend, False, "not decided yet", spec.engine.precision, {}, {}, {})
        return cls(spec.name, "", sm, spec.target.gpu, inputs, plan.outputs, tuple(steps), engine)

    # -- batch -----------------------------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        return min(i.max[0] for i in self.inputs)

    @property
    def min_batch(self) -> int:
        return max(i.min[0] for i in self.inputs)

    @property
    def buckets(self) -> tuple[int, ...]:
        """The inputs' buckets (all inputs share the batch), always ending at the max batch."""
        found = {i.buckets for i in self.inputs}
        if len(found) > 1:
            raise BundleError(f"manifest: inputs have different batch buckets {sorted(found)}; they share one batch")
        return next(iter(found)) if found else (1,)

    @property
    def launch_batches(self) -> tuple[int, ...]:
        """Every batch a kernel launches at: the buckets (a call runs at its bucket's), the min and the max."""
        return tuple(sorted({self.min_batch, self.max_batch, *(b for i in self.inputs for b in i.buckets)}))

    def bucket_for(self, batch: int) -> int:
        return bucket_for(batch, self.buckets)

    # -- inputs ----------------------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Any]) -> int:
        """The batch of `feeds`; RuntimeInputError naming the input and what is allowed otherwise."""
        return check_feeds(self.inputs, feeds, max(1, self.min_batch), self.max_batch, self.buckets)

    # -- steps and phases ------------------------------------------------------------------------
    def step(self, name: str) -> StepInfo:
        for s in self.steps:
            if s.name == name:
                return s
        raise BundleError(f"no step '{name}'{closest(name, [s.name for s in self.steps])}")

    @property
    def kernels(self) -> tuple[KernelInfo, ...]:
        return tuple(k for s in self.steps for k in s.kernels)

    @property
    def detections(self) -> tuple[Detections, ...]:
        """The outputs that are detections, as the kernels' contracts declare them."""
        return tuple(k.contract.model.roles.detections for k in self.kernels if k.contract.model.roles.detections)

    def schedule(self, engines_on_device: bool) -> Schedule:
        """Group the steps into phases and plan the copies between them; BundleError when a step
        reads a tensor no earlier step (or input) makes, or two steps make the same tensor."""
        if not self.steps or not self.outputs:
            raise BundleError(f"manifest: plan.{'steps' if not self.steps else 'outputs'} is empty: nothing to run")
        groups: list[tuple[str, list[StepInfo]]] = []
        for s in self.steps:
            where = "device" if s.kind != "segment" or engines_on_device else "host"
            if groups and groups[-1][0] == where == "device":
                groups[-1][1].append(s)
            else:
                groups.append((where, [s]))
        on_host = {i.name for i in self.inputs}
        on_device: set[str] = set()
        made = set(on_host)
        phases, device = [], []
        for where, steps in groups:
            reads: list[str] = []
            inside: set[str] = set()
            for s in steps:
                for n in s.reads:
                    if n not in made:
                        raise BundleError(f"step '{s.name}' reads '{n}', which no input or earlier step makes"
                                          f"{closest(n, made)}")
                    if n not in inside and n not in reads:
                        reads.append(n)
                for n in s.writes:
                    if n in made:
                        raise BundleError(f"step '{s.name}' makes '{n}', which an input or earlier step made already")
                    made.add(n)
                    inside.add(n)
            if where == "device":
                upload = tuple(n for n in reads if n not in on_device)
                on_device |= set(upload) | inside
                device += [*upload, *(n for s in steps for n in s.writes)]
                phases.append(Phase("device", tuple(s.name for s in steps), tuple(reads), upload=upload))
            else:
                download = tuple(n for n in reads if n not in on_host)
                on_host |= set(download) | inside
                phases.append(Phase("host", tuple(s.name for s in steps), tuple(reads), download=download))
        for o in self.outputs:
            if o.name not in made:
                raise BundleError(f"pipeline output '{o.name}' is made by no step{closest(o.name, made)}")
        final = tuple(o.name for o in self.outputs if o.name not in on_host)
        return Schedule(tuple(phases), final, tuple(dict.fromkeys(device)))

    def dtypes(self) -> dict[str, str]:
        """Every tensor's dtype, as the inputs, segments and kernels that make it declare; BundleError
        where a kernel reads a tensor in a dtype other than the one the pipeline makes it in (its
        buffer would be read as the wrong type)."""
        dtypes = {i.name: i.dtype for i in self.inputs}
        for step in self.steps:
            dtypes.update({t.name: t.dtype for t in step.outputs} if step.kind == "segment" else {})
            for k in step.kernels:
                for sig in k.sigs:
                    name = k.plan_name(sig.name)
                    if sig.role == "output":
                        dtypes[name] = sig.dtype
                    elif name in dtypes and dtypes[name] != sig.dtype:
                        raise BundleError(f"kernel {k.name} reads '{sig.name}' ({name}) as {sig.dtype}, but the "
                                          f"pipeline makes it {dtypes[name]}")
        return dtypes

    # -- shapes ----------------------------------------------------------------------------------
    def symbols(self) -> dict[str, tuple[str, int]]:
        """Symbolic input dims -> (input, axis), e.g. 'batch' -> ('images', 0)."""
        out: dict[str, tuple[str, int]] = {}
        for inp in self.inputs:
            for axis, d in enumerate(inp.shape):
                if isinstance(d, str):
                    out.setdefault(d, (inp.name, axis))
        return out

    def engine_output_shape(self, t: TensorSig, batch: int,
                            input_shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...] | None:
        """An engine output's shape at `batch`, with symbolic dims taken from the inputs' actual
        shapes (same symbol); None when a dim is not an input's (then the runtime asks the engine)."""
        syms = self.symbols()
        out = []
        for axis, d in enumerate(t.shape):
            if axis == 0:
                out.append(batch)           # every plan tensor is batch-major
            elif isinstance(d, int):
                out.append(d)
            elif d in syms and syms[d][0] in input_shapes:
                name, a = syms[d]
                out.append(int(input_shapes[name][a]))
            else:
                return None
        return tuple(out)

    def shapes(self, steps: Sequence[StepInfo], known: Mapping[str, tuple[int, ...]], batch: int,
               engine_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
        """Concrete shapes of every tensor `steps` make, given the shapes of what they read
        (`known`); kernel outputs through their contracts (bind_dims + concrete_shape), engine
        outputs from the manifest or `engine_shapes`."""
        shapes = dict(known)
        for s in steps:
            if s.kind == "segment":
                for t in s.outputs:
                    shape = (engine_shapes or {}).get(t.name) or self.engine_output_shape(t, batch, shapes)
                    if shape is None:
                        raise BundleError(f"segment '{s.name}': the shape of output '{t.name}' {show_shape(t.shape)} "
                                          "depends on dims the inputs do not name; the runtime must ask the engine")
                    shapes[t.name] = tuple(shape)
                continue
            for k in s.kernels:
                shapes.update(kernel_outputs(k, kernel_dims(k, shapes)))
        return shapes

    def planned_launches(self, batch: int) -> Iterator[tuple[KernelInfo, tuple[Launch, ...]]]:
        """Each kernel's launches at `batch`, the inputs' other dims at their max, as the runtime prepares
        that batch's bucket when it loads: their args resolved against buffers not allocated (None pointers)
        and the workspace sized, so an arg that names nothing or a workspace that does not evaluate is
        refused here, before any work, not on the GPU. A kernel that reads an engine output whose shape only
        the engine tells (a dim no input names) is left out, and so is any kernel that reads what such a
        kernel makes: the runtime checks their launches when it makes them."""
        shapes = {i.name: (batch, *i.max[1:]) for i in self.inputs}
        for s in self.steps:
            if s.kind == "segment":
                outputs = {t.name: self.engine_output_shape(t, batch, shapes) for t in s.outputs}
                shapes.update({name: shape for name, shape in outputs.items() if shape is not None})
                continue
            for k in s.kernels:
                if all(name in shapes for name in k.reads):
                    dims = kernel_dims(k, shapes)
                    shapes.update(kernel_outputs(k, dims))
                    kernel_workspace(k, dims)  # its size is the runtime's to use: here only refused if bad
                    yield k, launches(k.contract, k.params, dims, _unallocated(k, dims))


def kernel_dims(k: KernelInfo, shapes: Mapping[str, tuple[int, ...]]) -> Mapping[str, int]:
    """The contract's symbolic dims from the shapes of the plan tensors the kernel reads."""
    ins = {s.name: shapes[k.plan_name(s.name)] for s in k.sigs if s.role == "input"}
    return bind_dims(k.contract, k.params, ins)


def kernel_outputs(k: KernelInfo, dims: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """The plan tensors the kernel writes, with their shapes at bound dims."""
    return {k.plan_name(sig.name): concrete_shape(sig, k.params, dims, f"kernel {k.name}: output '{sig.name}'")
            for sig in k.sigs if sig.role == "output"}


def _unallocated(k: KernelInfo, dims: Mapping[str, int]) -> dict[str, Any]:
    """What a kernel's args read at launch, with no buffer behind the tensors and the workspace."""
    return {**{s.name: None for s in k.sigs}, "workspace": None, **host_values(k.contract, k.params, dims)}


def kernel_workspace(k: KernelInfo, dims: Mapping[str, int]) -> int:
    return workspace_bytes(k.contract, k.params, dims)


def nbytes(shape: Sequence[int], dtype) -> int:
    return math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize


class LayoutFacts:
    """What a loaded pipeline (GPU or CPU) tells about its bundle, from its `layout`."""

    layout: Layout

    @property
    def inputs(self) -> tuple[InputView, ...]:
        return self.layout.inputs

    @property
    def outputs(self) -> tuple[TensorSig, ...]:
        return self.layout.outputs

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.layout.buckets

    @property
    def max_batch(self) -> int:
        return self.layout.max_batch
