"""The kernels level (GPU): the kernels against their references, on the references' own inputs
(computed on the CPU by the bundle's segments and references, so kernels are judged apart from the
engine).

Consecutive kernel steps run as one chain, as in the pipeline (a decode that writes candidates for
the nms after it), from the chain's inputs, against those steps' references run one after the other:
what is compared is the chain's outputs that are also its steps' outputs. A kernel whose contract
declares a twin (roles.twin: the params under which it writes its cut's own outputs) and that does not
write them as configured is also checked alone, as that twin compiled for this GPU. Nothing here knows
a kernel by name: a user's contract is checked the same way as a built-in one.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from ..bundle.view import BundleView, KernelView, StepView
from ..graph.steps import StepRunner
from ..jit.contracts import batch_thresholds, detection_outputs, load_contract, signature
from ..jit.nvrtc import compile_site_kernel
from ..runtime.launch import KernelChain
from ..runtime.layout import site_aliases
from .data import Feeds, row_labels
from .gate import FunctionRunner, LevelResult, OutputResult, compare_runs, from_outputs


def kernels_level(gpu, bundle: BundleView, models: Mapping[str, onnx.ModelProto], envs, spec,
                  report_dir: Path | None = None) -> LevelResult:
    """`models`: each step's ONNX (segment or reference); `envs`: every tensor of the pipeline on the
    CPU, per validation feed."""
    check = _Check(gpu, bundle, models, envs, spec, report_dir)
    outputs: list[OutputResult] = []
    for run in _kernel_runs(bundle.steps):
        for step in run:
            outputs += [r for k in step.kernels if check.needs_twin(step, k) for r in check.twin(step, k)]
        outputs += check.chain(run)
    return from_outputs("kernels", outputs, f"each kernel against its reference on sm_{gpu.sm} ({gpu.name})")


def _report_name(label: str) -> str:
    """`kernels.<steps>`, its RunResults' name: a long chain keeps a digest in place of its tail, within
    what gate.report_file takes (a file name has 255 bytes)."""
    name = f"kernels.{label}"
    return name if len(name) <= 200 else f"{name[:183]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def _kernel_runs(steps: Sequence[StepView]) -> list[list[StepView]]:
    """Maximal runs of consecutive kernel steps (cut sites and added stages) between engine segments."""
    runs: list[list[StepView]] = []
    for prev, step in zip((None, *steps), steps):
        if step.kind == "segment":
            continue
        if prev is not None and prev.kind != "segment" and runs:
            runs[-1].append(step)
        else:
            runs.append([step])
    return runs


class _Check:
    def __init__(self, gpu, bundle: BundleView, models, envs, spec, report_dir):
        self.gpu, self.bundle, self.models, self.envs, self.report_dir = gpu, bundle, models, envs, report_dir
        self.tol = spec.validation.tolerances

    def _aliases(self, step: StepView, kernel: KernelView, params=None) -> dict[str, str]:
        return site_aliases(self.bundle.contract(kernel), params or kernel.params, step.inputs, f"kernel {kernel.name}")

    def needs_twin(self, step: StepView, kernel: KernelView) -> bool:
        """The contract declares a twin and the kernel, as configured, does not write its step's outputs."""
        contract = self.bundle.contract(kernel)
        written = {t.name for t in signature(contract, kernel.params) if t.role == "output"}
        return bool(contract.model.roles.twin) and not {t.name for t in step.outputs} <= written

    def twin(self, step: StepView, kernel: KernelView) -> list[OutputResult]:
        """The kernel in its twin's params, compiled for this GPU, alone against its step's reference."""
        contract = self.bundle.contract(kernel)
        declared = {k: v for k, v in kernel.params.items() if k in contract.model.params}  # not the derived ones
        compiled = compile_site_kernel(str(contract.path), {**declared, **contract.model.roles.twin}, None,
                                       sm=self.gpu.sm)
        aliases = self._aliases(step, kernel, compiled.params)
        return self._compare(step.name, [(compiled, aliases)], [step], (), f"twin of {kernel.contract}")

    def chain(self, run: list[StepView]) -> list[OutputResult]:
        """The run's kernels one after the other, against its steps' references one after the other."""
        kernels = [(self.bundle.compiled(k), self._aliases(s, k)) for s in run for k in s.kernels]
        detections = tuple(d for s in run for k in s.kernels
                           if (d := detection_outputs(self.bundle.contract(k), k.params)))
        return self._compare("+".join(s.name for s in run), kernels, run, detections,
                             "+".join(k.contract for s in run for k in s.kernels))

    def _compare(self, label: str, kernels, steps: list[StepView], detections, name: str) -> list[OutputResult]:
        made, reads = set(), []
        for compiled, aliases in kernels:
            sigs = signature(load_contract(compiled.contract_path), compiled.params)
            reads += [n for n in (aliases.get(t.name, t.name) for t in sigs if t.role == "input")
                      if n not in made and n not in reads]
            made.update(t.name for t in sigs if t.role == "output")
        compared = [t.name for s in steps for t in s.outputs if t.name in made]
        if not compared:
            return [OutputResult(f"{label}/outputs", False, detail=f"{name} writes none of its steps' outputs "
                                 f"({', '.join(t.name for s in steps for t in s.outputs)})")]
        ref_inputs = self._external_inputs(steps)
        absent = [n for n in dict.fromkeys([*reads, *ref_inputs]) if n not in self.envs[0]]
        if absent:
            return [OutputResult(f"{label}/inputs", False, detail=f"{name} reads '{absent[0]}', which no step of "
                                 "the bundle makes on the CPU")]
        reference = StepRunner((s.name, self.models[s.name]) for s in steps)
        feeds = Feeds([{n: env[n] for n in dict.fromkeys([*reads, *ref_inputs])} for env in self.envs],
                      row_labels(self.envs))
        feeds = self._every_bucket(kernels, feeds)

        def expected(feed):
            env = reference.tensors(feed)
            return {n: env[n] for n in compared}

        def run(feed):
            inputs = {n: self.gpu.upload(np.ascontiguousarray(feed[n])) for n in reads}
            chain = KernelChain(self.gpu, kernels, inputs)
            chain.launch()
            return chain.results(compared)

        result = compare_runs("kernels", FunctionRunner(expected, "reference"), FunctionRunner(run, name), feeds,
                              self.tol, detections=detections, report_dir=self.report_dir,
                              report_name=_report_name(label))
        return [dataclasses.replace(o, name=f"{label}/{o.name}") for o in result.outputs]

    def _every_bucket(self, kernels, feeds: Feeds) -> Feeds:
        """The feeds, and where a bucket launches other kernels than every feed's batch does (an entry's
        from_batch), the first feed's rows repeated up to the smallest such bucket, so that each kernel a
        bucket's graph can run is checked."""
        ats = sorted({at for compiled, _ in kernels
                      for at in batch_thresholds(load_contract(compiled.contract_path), compiled.params)})
        if not ats:
            return feeds

        def kind(batch: int) -> int:  # the kernels a batch launches: how many thresholds it has reached
            return sum(batch >= at for at in ats)

        seen = {kind(len(rows)) for rows in feeds.labels}
        arrays, labels = list(feeds), list(feeds.labels)
        first, rows = feeds[0], feeds.labels[0]
        for bucket in sorted({b for i in self.bundle.inputs for b in i.buckets}):
            if kind(bucket) in seen:
                continue
            seen.add(kind(bucket))
            take = np.arange(bucket) % len(rows)
            arrays.append({n: np.take(a, take, axis=0) if a.ndim and a.shape[0] == len(rows) else a
                           for n, a in first.items()})
            labels.append([f"{rows[i]} (batch {bucket})" for i in take])
        return Feeds(arrays, labels)

    @staticmethod
    def _external_inputs(steps: list[StepView]) -> list[str]:
        """What the steps' references read that none of them makes."""
        made, out = set(), []
        for s in steps:
            out += [t.name for t in s.inputs if t.name not in made and t.name not in out]
            made.update(t.name for t in s.outputs)
        return out
