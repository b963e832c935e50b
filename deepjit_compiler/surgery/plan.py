"""What surgery gives: the Plan, the pipeline's steps in run order (engine segments, kernel sites
and added stages), each with its tensors and the ONNX graph it runs or is checked against."""
from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import onnx
import onnx.utils

from ..errors import closest
from ..files import atomic_write
from ..graph.serialize import model_bytes
from ..graph.tensors import TensorSig


@dataclass(frozen=True, slots=True)
class KernelRequest:
    contract: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CutRequest:
    """What surgery reads from a spec cut; the lead passes pydantic `Cut`s with the same attributes."""

    name: str
    preset: str | None = None
    inputs: Sequence[str] | None = None
    outputs: Sequence[str] | None = None
    add: str | None = None
    at: str | None = None
    kernels: Sequence[Any] = ()


# --- the plan -----------------------------------------------------------------------------------


def _ops(model: onnx.ModelProto) -> dict[str, int]:
    return dict(sorted(Counter(n.op_type for n in model.graph.node if n.op_type != "Constant").items()))


@dataclass(frozen=True, slots=True, eq=False)
class Segment:
    """A piece of the model left to the engine (TensorRT or ONNX Runtime)."""

    kind: ClassVar[str] = "segment"
    folder: ClassVar[str] = "segments"
    name: str
    model: onnx.ModelProto
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]

    @property
    def onnx(self) -> onnx.ModelProto:
        return self.model

    def summary(self) -> dict[str, Any]:
        return {"nodes": sum(1 for n in self.model.graph.node if n.op_type != "Constant"), "ops": _ops(self.model)}


@dataclass(frozen=True, slots=True, eq=False)
class KernelSite:
    """A region cut out of the model; `reference` is the exact subgraph its kernel must match."""

    kind: ClassVar[str] = "kernel"
    folder: ClassVar[str] = "references"
    name: str
    reference: onnx.ModelProto
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    facts: Mapping[str, Any]
    kernels: tuple[Any, ...]

    @property
    def onnx(self) -> onnx.ModelProto:
        return self.reference

    def summary(self) -> dict[str, Any]:
        return {"facts": dict(self.facts), "kernels": [k.contract for k in self.kernels]}


@dataclass(frozen=True, slots=True, eq=False)
class AddedStage:
    """A kernel the model lacks (letterbox before it, NMS after it), with an ONNX reference graph."""

    kind: ClassVar[str] = "added"
    folder: ClassVar[str] = "references"
    name: str
    position: str  # "before" | "after"
    reference: onnx.ModelProto
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    params: Mapping[str, Any]
    kernels: tuple[Any, ...]

    @property
    def onnx(self) -> onnx.ModelProto:
        return self.reference

    def summary(self) -> dict[str, Any]:
        return {"position": self.position, "params": dict(self.params), "kernels": [k.contract for k in self.kernels]}


Step = Segment | KernelSite | AddedStage

# Facts about one site's own tensors, which an added stage does not inherit (it has tensors of its own).
SITE_OWN_FACTS = frozenset({"input_dtype"})


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """The pipeline in run order. A step reads pipeline inputs or outputs of earlier steps by name.
    `model_dtypes`: the tensors handed between steps in another dtype than the model's (a segment's
    fp16 outputs for the kernel after it), with the model's dtype."""

    steps: tuple[Step, ...]
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    model_dtypes: Mapping[str, str] = field(default_factory=dict)

    def step(self, name: str) -> Step:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(f"no step '{name}'{closest(name, [s.name for s in self.steps])}")

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.steps if isinstance(s, Segment))

    @property
    def sites(self) -> tuple[KernelSite, ...]:
        return tuple(s for s in self.steps if isinstance(s, KernelSite))

    @property
    def added(self) -> tuple[AddedStage, ...]:
        return tuple(s for s in self.steps if isinstance(s, AddedStage))

    def kernel_facts(self, step: KernelSite | AddedStage) -> dict[str, Any]:
        """What fills a step's inferable kernel params: a cut site's own facts; for an added stage, its
        params over the sites' facts (NMS sizes its buffers by the decode's anchor count), less the
        dtype a site's own inputs have."""
        if isinstance(step, KernelSite):
            return dict(step.facts)
        sites = {k: v for site in self.sites for k, v in site.facts.items() if k not in SITE_OWN_FACTS}
        return {**sites, **step.params}

    def summary(self) -> list[dict[str, Any]]:
        return [{"name": s.name, "kind": s.kind, "inputs": [t.to_dict() for t in s.inputs],
                 "outputs": [t.to_dict() for t in s.outputs], **s.summary()} for s in self.steps]

    def relpath(self, step: Step) -> str:
        return f"{step.folder}/{step.name}.onnx"

    def write(self, folder: str | Path) -> dict[str, str]:
        """Write segments/<name>.onnx and references/<name>.onnx (atomic, byte-deterministic);
        returns {step name: path relative to folder}."""
        folder = Path(folder)
        paths = {}
        for s in self.steps:
            rel = self.relpath(s)
            atomic_write(folder / rel, model_bytes(s.onnx))
            paths[s.name] = rel
        return paths

    def digest(self) -> str:
        h = hashlib.sha256()
        for s in self.steps:
            h.update(f"{s.kind}:{s.name}\0".encode())
            h.update(model_bytes(s.onnx))
        return h.hexdigest()
