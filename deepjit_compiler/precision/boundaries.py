"""The dtype of the tensors an engine segment hands to a kernel, and the plan that says so.

An fp16 engine whose outputs are cast back to fp32 for the kernel after it moves twice the bytes it
needs to (the decode reads 155 MB of fp32 head maps at batch 32, at the memory limit). So a segment
output that only kernels read is stored in the dtype those kernels read. What a kernel reads is its
contract's: an input whose dtype follows a param with `infer: input_dtype` (yolov8_decode's `dtype`)
reads the engine's dtype when every such param of the step allows it and the spec does not set it;
otherwise, as for a user's contract that reads float32 only, the boundary keeps the model's dtype.
Nothing here knows a kernel by name.

The plan then says it in its graphs, so every level and runtime reads the dtype from the plan: the
segment casts those outputs where it makes them (the precision rewrite turns the producer itself
fp16), each kernel step's reference casts them back to its own dtype on entry, and the site records
`input_dtype`. fp32 and int8 engines keep every boundary as the model has it.

bf16 engines keep fp32 boundaries for now: ONNX Runtime's Python API takes and gives no bfloat16
arrays ("No corresponding Numpy type for Tensor Type. bfloat16"), so neither the graph and precision
levels nor `--device cpu` could run a bf16 boundary; yolov8_decode reads float32 and float16.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..graph.casts import FLOAT_TYPES, cast_inputs, cast_outputs
from ..jit.contracts import load_contract, resolve_params, signature, site_inputs
from ..surgery.plan import AddedStage, KernelSite, Plan, Segment

log = logging.getLogger("deepjit.precision")

# The dtype an engine of this precision hands to kernels (int8 engines hand over fp32; bf16 ones too
# for now: see above).
ENGINE_DTYPES = {"fp16": "float16"}
FACT = "input_dtype"  # the site fact a contract param infers its input dtype from


def plan_at_precision(plan: Plan, precision: str, spec_dir: Path | None = None) -> Plan:
    """`plan` with each segment -> kernel boundary in the dtype its kernels read under `precision`."""
    low = ENGINE_DTYPES.get(precision)
    if low is None:
        return plan
    dtypes, lowered = boundary_dtypes(plan, low, spec_dir)
    if dtypes:
        log.info("%s engine: %s handed to the kernels in %s", precision, ", ".join(sorted(dtypes)), low)
    return retyped(plan, dtypes, {name: low for name in lowered})


def boundary_dtypes(plan: Plan, low: str, spec_dir: Path | None = None) -> tuple[dict[str, str], set[str]]:
    """({segment output: the dtype its kernels read}, for those that change; the kernel steps that read
    `low` because their `input_dtype` fact becomes it)."""
    kernel_steps = [*plan.sites, *plan.added]
    base = {s.name: _reads(s, plan.kernel_facts(s), spec_dir) for s in kernel_steps}
    as_low = {s.name: _reads(s, {**plan.kernel_facts(s), FACT: low}, spec_dir)
              for s in kernel_steps if _allows(s, low, spec_dir)}
    # a step is lowered only where that changes what it reads
    lowered = {n for n, reads in as_low.items() if reads != base[n]}
    candidates = _handed_to_kernels(plan)
    while True:
        wanted: dict[str, set[str]] = {}
        for s in kernel_steps:
            for t, ds in (as_low if s.name in lowered else base)[s.name].items():
                wanted.setdefault(t, set()).update(ds)
        dtypes = {t: d for t, (d,) in ((t, wanted[t]) for t in candidates if t in wanted and len(wanted[t]) == 1)
                  if d != candidates[t] and d in FLOAT_TYPES and candidates[t] in FLOAT_TYPES}
        # a lowered step must get every tensor it now reads differently in that dtype; else it reads as before
        stuck = {n for n in lowered
                 if any({dtypes.get(t, candidates.get(t))} != ds for t, ds in as_low[n].items() if base[n].get(t) != ds)}
        if not stuck:
            return dtypes, lowered
        for n in sorted(stuck):
            log.info("kernel step %s reads the model's dtypes: not all it reads can be handed over in %s", n, low)
        lowered -= stuck


def retyped(plan: Plan, dtypes: Mapping[str, str], facts: Mapping[str, str]) -> Plan:
    """`plan` with the tensors in `dtypes` stored in that dtype between the steps (segments cast them
    where they make them, kernel steps' references cast them back on entry), and `facts[step]` as
    the input_dtype fact of those kernel steps."""
    if not dtypes and not facts:
        return plan
    steps = []
    for s in plan.steps:
        if isinstance(s, Segment):
            mine = {t.name: dtypes[t.name] for t in s.outputs if t.name in dtypes}
            if mine:
                s = dataclasses.replace(s, model=cast_outputs(s.model, mine), outputs=_sigs(s.outputs, mine))
        else:
            mine = {t.name: dtypes[t.name] for t in s.inputs if t.name in dtypes}
            inputs = _sigs(s.inputs, mine)
            changes = {"reference": cast_inputs(s.reference, mine), "inputs": inputs} if mine else {}
            if isinstance(s, KernelSite) and (mine or s.name in facts):
                extra = {FACT: facts[s.name]} if s.name in facts else {}
                changes["facts"] = {**s.facts, **extra, "inputs": [t.to_dict() for t in inputs]}
            elif isinstance(s, AddedStage) and s.name in facts:
                changes["params"] = {**s.params, FACT: facts[s.name]}
            s = dataclasses.replace(s, **changes) if changes else s
        steps.append(s)
    made = {t.name: t.dtype for s in plan.segments for t in s.outputs}
    model_dtypes = {**plan.model_dtypes, **{t: plan.model_dtypes.get(t, made[t]) for t in dtypes}}
    return dataclasses.replace(plan, steps=tuple(steps), model_dtypes=model_dtypes)


def _handed_to_kernels(plan: Plan) -> dict[str, str]:
    """{tensor: dtype} of the segment outputs that only kernel steps read (not a pipeline output,
    not read by another segment): the ones whose dtype is the kernels' to choose."""
    kept = {t.name for t in plan.outputs} | {t.name for s in plan.segments for t in s.inputs}
    return {t.name: t.dtype for s in plan.segments for t in s.outputs if t.name not in kept}


def _kernels(step: KernelSite | AddedStage, spec_dir: Path | None) -> Iterable:
    return ((load_contract(str(k.contract), spec_dir=spec_dir), dict(k.params or {})) for k in step.kernels)


def _allows(step: KernelSite | AddedStage, dtype: str, spec_dir: Path | None) -> bool:
    """Every param of the step's kernels that infers its value from input_dtype, and that the spec
    does not set, allows `dtype`."""
    return all(p.allowed is None or dtype in p.allowed
               for contract, given in _kernels(step, spec_dir)
               for name, p in contract.model.params.items() if p.infer == FACT and name not in given)


def _reads(step: KernelSite | AddedStage, facts: Mapping, spec_dir: Path | None) -> dict[str, set[str]]:
    """{plan tensor: the dtypes the step's kernels read it in}, with `facts` filling their params: two
    kernels of a step may read one tensor in two (then no one dtype can be handed to both)."""
    out: dict[str, set[str]] = {}
    for contract, given in _kernels(step, spec_dir):
        params = resolve_params(contract, given, facts)
        at = site_inputs(contract, params)
        for sig in signature(contract, params):
            if sig.role == "input":
                pos = at.get(sig.name)
                name = step.inputs[pos].name if pos is not None and pos < len(step.inputs) else sig.name
                out.setdefault(name, set()).add(sig.dtype)
    return out


def _sigs(sigs, dtypes: Mapping[str, str]):
    return tuple(dataclasses.replace(t, dtype=dtypes[t.name]) if t.name in dtypes else t for t in sigs)
