"""The typed read side of a bundle: its manifest parsed once into `BundleView` (inputs with their
profiles and buckets, the plan's steps with their files and kernels, the engine record), so no
other module reads `manifest[...]` keys. A malformed manifest is a BundleError naming the field.

    view = read_bundle("build/yolov8s_t4")        # verified; see folder.py
    view.steps[1].kernels[0].files["cubin"]         # 'kernels/decode/yolov8_decode.sm_75.cubin'
    view.file(view.engine.segments["segment"][0])   # the segment's ONNX on disk
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import onnx
from pydantic import ValidationError

from ..engines.flavours import flavour_of_plan
from ..errors import BundleError, KernelError, closest
from ..graph.tensors import TensorSig
from ..jit.contracts import Contract, DetectionOutputs, detection_outputs, load_contract
from ..jit.nvrtc import CompiledKernel
from ..spec.models import Spec
from ..spec.safeyaml import load_yaml, read_text

STEP_KINDS = ("segment", "kernel", "added")


def _field(mapping: Any, key: str, where: str) -> Any:
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise BundleError(f"manifest: '{where}.{key}' is missing (a bundle from another DeepJIT version?)")
    return mapping[key]


def _tensors(items: Any, where: str) -> tuple[TensorSig, ...]:
    try:
        return tuple(TensorSig(t["name"], t["dtype"], tuple(t["shape"])) for t in items)
    except (KeyError, TypeError) as e:
        raise BundleError(f"manifest {where}: malformed tensor list ({e})") from None


def sm_of(arch: Any, where: str) -> int:
    """75 from 'sm_75'; BundleError naming the kernel otherwise."""
    arch = str(arch)
    if not arch.startswith("sm_") or not arch[3:].isdigit():
        raise BundleError(f"kernel {where}: manifest arch {arch!r} is not sm_XX")
    return int(arch[3:])


@dataclass(frozen=True, slots=True)
class InputView:
    """A pipeline input: its shape, profile (min/opt/max) and the batch buckets graphs are captured for."""

    name: str
    dtype: str
    shape: tuple[Any, ...]
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]
    buckets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KernelView:
    """A compiled kernel of a step as the manifest records it; its binaries stay in the bundle's files
    (`files`: source, cubin, ptx and contract, bundle paths)."""

    step: str
    index: int
    contract: str
    params: Mapping[str, Any]
    sm: int
    files: Mapping[str, str]
    entry: Mapping[str, Any]  # the whole manifest entry: what rebuilds its CompiledKernel

    @property
    def name(self) -> str:
        return f"{self.step}/{self.contract}"


@dataclass(frozen=True, slots=True)
class StepView:
    """A plan step: `segment` (an engine), `kernel` (a cut site) or `added` (a stage before/after).
    `file`: the segment's ONNX, or the ONNX reference a kernel step is checked against."""

    name: str
    kind: str
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    file: str
    kernels: tuple[KernelView, ...] = ()
    facts: Mapping[str, Any] = field(default_factory=dict)  # a site's facts; an added stage's params
    position: str | None = None  # an added stage's: "before" | "after"


@dataclass(frozen=True, slots=True)
class PlanView:
    """A plan of a segment as the manifest records it (engines.PlanInfo's record): its file, the flavour
    and library version it needs at run time, the compute capabilities it runs on, the network
    TensorRT parsed (layer count, I/O tensors with dtypes and TensorRT shapes) and its profile."""

    segment: str
    file: str
    flavour: str
    library: str
    version: str
    compute_capabilities: tuple[str, ...]
    network_layers: int | None
    inputs: tuple[Mapping[str, Any], ...]
    outputs: tuple[Mapping[str, Any], ...]
    profiles: Mapping[str, Any]
    key: str

    def runs_on(self, sm: int) -> bool | None:
        """Whether the plan was built for compute capability `sm` (None: the record does not say)."""
        if not self.compute_capabilities:
            return None
        return f"{sm // 10}.{sm % 10}" in self.compute_capabilities


@dataclass(frozen=True, slots=True)
class EngineView:
    """How the segments run: the backend decision, the precision, the settings a deferred plan is built
    with, each segment's ONNX (`segments`) and its plans (built with the bundle, or by `deepjit materialize`)."""

    backend: str
    deferred: bool
    reason: str
    precision: str
    settings: Mapping[str, Any]
    segments: Mapping[str, tuple[str, ...]]
    plans: Mapping[str, tuple[PlanView, ...]]

    def plan_files(self, segment: str) -> tuple[str, ...]:
        return tuple(p.file for p in self.plans.get(segment, ()))


def _kernel(step: str, index: int, entry: Any) -> KernelView:
    where = f"plan.steps[{step}].kernels[{index}]"
    contract = str(_field(entry, "contract", where))
    files = _field(entry, "files", where)
    if not isinstance(files, Mapping) or not all(isinstance(v, str) for v in files.values()):
        raise BundleError(f"manifest: '{where}.files' is not a mapping of bundle paths")
    return KernelView(step, index, contract, dict(_field(entry, "params", where)),
                      sm_of(entry.get("arch", ""), f"{step}/{contract}"), dict(files), entry)


def _step(i: int, s: Any) -> StepView:
    kind, name = _field(s, "kind", f"plan.steps[{i}]"), _field(s, "name", f"plan.steps[{i}]")
    if kind not in STEP_KINDS:
        raise BundleError(f"manifest: step '{name}' has kind {kind!r}; known: {', '.join(STEP_KINDS)}")
    file = _field(s, "file" if kind == "segment" else "reference", f"plan.steps[{name}]")
    kernels = tuple(_kernel(name, j, k) for j, k in enumerate(s.get("kernels") or ()))
    if kind != "segment" and not kernels:
        raise BundleError(f"manifest: step '{name}' ({kind}) has no compiled kernels")
    return StepView(name, kind, _tensors(s.get("inputs", ()), f"step {name} inputs"),
                    _tensors(s.get("outputs", ()), f"step {name} outputs"), file, kernels,
                    dict(s.get("facts") or s.get("params") or {}), s.get("position"))


def _inputs(manifest: Mapping[str, Any], plan: Mapping[str, Any]) -> tuple[InputView, ...]:
    declared = manifest.get("inputs") or {}
    out = []
    for t in _tensors(_field(plan, "inputs", "plan"), "plan.inputs"):
        d = declared.get(t.name) or {}
        if not d and not t.is_static:
            raise BundleError(f"manifest: input '{t.name}' has symbolic dims {list(t.shape)} but no "
                              "inputs.<name>.min/max profile")
        lo, opt, hi = (tuple(d.get(k) or t.shape) for k in ("min", "opt", "max"))
        buckets = tuple(sorted({int(b) for b in (d.get("buckets") or ()) if lo[0] <= int(b) <= hi[0]} | {hi[0]}))
        out.append(InputView(t.name, t.dtype, t.shape, lo, opt, hi, buckets))
    return tuple(out)


def _files_by_segment(value: Any, where: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        raise BundleError(f"manifest: '{where}' is not a mapping of segment names to files")
    return {str(k): tuple(v) if isinstance(v, (list, tuple)) else (str(v),) for k, v in value.items()}


def _plan(segment: str, entry: Any) -> PlanView:
    if isinstance(entry, str):  # a bare file name: what is known is its flavour, by its name
        f = flavour_of_plan(entry)
        return PlanView(segment, entry, f.name, f.module_name, "", (), None, (), (), {}, "")
    where = f"engine.plans[{segment}]"
    try:
        return PlanView(segment, str(_field(entry, "file", where)), str(_field(entry, "flavour", where)),
                        str(entry.get("library", "")), str(entry.get("version", "")),
                        tuple(str(c) for c in entry.get("compute_capabilities") or ()),
                        entry.get("network_layers"), tuple(entry.get("inputs") or ()), tuple(entry.get("outputs") or ()),
                        dict(entry.get("profiles") or {}), str(entry.get("key", "")))
    except (TypeError, ValueError) as e:
        raise BundleError(f"manifest: '{where}' is malformed ({e})") from None


def _plans(value: Any) -> dict[str, tuple[PlanView, ...]]:
    if not isinstance(value, Mapping):
        raise BundleError("manifest: 'engine.plans' is not a mapping of segment names to plans")
    return {str(k): tuple(_plan(str(k), p) for p in (v if isinstance(v, (list, tuple)) else [v]))
            for k, v in value.items()}


def _engine(e: Any) -> EngineView:
    if not isinstance(e, Mapping):
        return EngineView("onnxruntime", False, "", "fp32", {}, {}, {})
    return EngineView(str(e.get("backend", "")), bool(e.get("deferred")), str(e.get("reason", "")),
                      str(e.get("precision", "fp32")), dict(e.get("settings") or {}),
                      _files_by_segment(e.get("segments") or {}, "engine.segments"), _plans(e.get("plans") or {}))


class BundleView:
    """A bundle: its folder (`root`), what read_bundle was given (`source`), the manifest as written, and
    the manifest's content, typed and parsed once on first use (a bundle of other fields, as the store
    tests write, is still a bundle). Made by `read_bundle` (verified) or over a build's staged files."""

    def __init__(self, root: Path, manifest: Mapping[str, Any], source: Path | None = None, keep: Any = None):
        self.root, self.manifest = Path(root), manifest
        self.source = Path(source) if source is not None else self.root
        self._keep = keep  # a temporary folder that lives as long as this view

    def __repr__(self) -> str:
        return f"BundleView({str(self.source)!r}, {self.digest or 'unsealed'})"

    @property
    def digest(self) -> str:
        return str(self.manifest.get("digest", ""))

    @property
    def name(self) -> str:
        return str(self.manifest.get("name") or "")

    @property
    def files(self) -> Mapping[str, Mapping[str, Any]]:
        return self.manifest.get("files") or {}

    def file(self, path: str) -> Path:
        """The on-disk path of the bundle file `path` (as listed in the manifest)."""
        if path not in self.files:
            raise BundleError(f"{self.source}: no file '{path}' in the bundle{closest(path, self.files)}")
        return self.root / path

    def onnx(self, path: str) -> onnx.ModelProto:
        return onnx.load(str(self.file(path)))

    # -- the content, typed --------------------------------------------------------------------------
    @cached_property
    def _plan(self) -> Mapping[str, Any]:
        return _field(self.manifest, "plan", "")

    @cached_property
    def inputs(self) -> tuple[InputView, ...]:
        return _inputs(self.manifest, self._plan)

    @cached_property
    def outputs(self) -> tuple[TensorSig, ...]:
        return _tensors(_field(self._plan, "outputs", "plan"), "plan.outputs")

    @cached_property
    def steps(self) -> tuple[StepView, ...]:
        return tuple(_step(i, s) for i, s in enumerate(_field(self._plan, "steps", "plan")))

    @cached_property
    def engine(self) -> EngineView:
        return _engine(self.manifest.get("engine"))

    @property
    def precision(self) -> str:
        return self.engine.precision

    @property
    def target_sm(self) -> int | None:
        return (self.manifest.get("target") or {}).get("sm")

    @property
    def target_gpu(self) -> str | None:
        return (self.manifest.get("target") or {}).get("gpu")

    @property
    def toolchain(self) -> Mapping[str, str]:
        """The versions that made the bundle: DeepJIT, NVRTC, ONNX, ONNX Runtime, Polygraphy, ..."""
        value = self.manifest.get("toolchain")
        return {str(k): str(v) for k, v in value.items()} if isinstance(value, Mapping) else {}

    @property
    def spec_sha256(self) -> str | None:
        spec = self.manifest.get("spec")
        return spec.get("sha256") if isinstance(spec, Mapping) else None

    @property
    def model_sha256(self) -> str | None:
        """The sha256 of the model the bundle was built from (its file is in the bundle only on request)."""
        model = self.manifest.get("model")
        return model.get("sha256") if isinstance(model, Mapping) else None

    @property
    def levels(self) -> Mapping[str, Any]:
        """The validation record: level -> {status, reason, outputs}."""
        return (self.manifest.get("validation") or {}).get("levels") or {}

    def step(self, name: str) -> StepView:
        for s in self.steps:
            if s.name == name:
                return s
        raise BundleError(f"{self.source}: no step '{name}'{closest(name, [s.name for s in self.steps])}")

    def contract(self, kernel: KernelView) -> Contract:
        """The kernel's contract as the bundle carries it (YAML, template, headers), so a user's own
        contract loads where it is not installed."""
        bundled = kernel.files.get("contract")
        bundled = bundled if bundled in self.files else None
        try:
            return load_contract(self._contract_ref(kernel, bundled))
        except (KernelError, BundleError) as e:
            copy = f"its copy '{bundled}' in the bundle is unusable" if bundled else "the bundle carries no copy of it"
            raise BundleError(f"step '{kernel.step}': kernel contract '{kernel.contract}' cannot be loaded ({e}); "
                              f"{copy}: rebuild it with this DeepJIT") from None

    def _contract_ref(self, kernel: KernelView, bundled: str | None) -> str:
        """What load_contract gets: the bundle's copy, else a built-in contract by name. A manifest never
        makes it read a path of this machine (absolute, or relative to the working folder): a path it
        names must be one of the bundle's files."""
        if bundled:
            return str(self.file(bundled))
        ref = kernel.contract
        if ref.endswith((".yaml", ".yml")) or "/" in ref or "\\" in ref:  # what load_contract takes for a path
            if ref not in self.files:
                raise BundleError(f"manifest: '{ref}' is a path, not one of the bundle's files; a bundle's "
                                  "contract loads only from its own files or by a built-in name")
            return str(self.file(ref))
        return ref

    def compiled(self, kernel: KernelView) -> CompiledKernel:
        """The kernel as it was compiled: its record and its binaries, read from the bundle."""
        try:
            cubin, ptx = self.file(kernel.files["cubin"]).read_bytes(), self.file(kernel.files["ptx"]).read_text()
        except KeyError as e:
            raise BundleError(f"{self.source}: kernel {kernel.name} lists no {e} file") from None
        source = kernel.files.get("source")
        contract = kernel.files.get("contract")
        try:
            return CompiledKernel.from_dict(kernel.entry, cubin=cubin, ptx=ptx,
                                            code=self.file(source).read_text() if source else "",
                                            filename=(source or "").rsplit("/", 1)[-1],
                                            contract_path=str(self.file(contract)) if contract else "")
        except KernelError as e:
            raise BundleError(f"{self.source}: manifest: {e}") from None

    @cached_property
    def detections(self) -> tuple[DetectionOutputs, ...]:
        """The outputs that are detections, as the kernels' contracts declare them, with the threshold
        each kernel cut them at."""
        return tuple(d for s in self.steps for k in s.kernels if (d := detection_outputs(self.contract(k), k.params)))

    @property
    def reference_model(self) -> str | None:
        """The bundle path of the fp32 model it was built from, when it carries it (`bundle.reference_model`)."""
        model = self.manifest.get("model")
        file = model.get("file") if isinstance(model, Mapping) else None
        return file if isinstance(file, str) and file in self.files else None

    def model_file(self) -> str:
        if self.reference_model is None:
            raise BundleError(f"{self.source}: the bundle carries no reference model (build it with "
                              "`bundle.reference_model: true` to re-validate it end to end)")
        return self.reference_model

    def spec(self) -> Spec:
        """The spec the bundle was built from (its text is in the bundle); paths resolve inside it."""
        path = self.file(str(_field(self.manifest.get("spec"), "file", "spec")))
        data, _ = load_yaml(read_text(path, BundleError, "the bundle's spec"), path, BundleError)
        try:
            return Spec.model_validate(data, context={"base": self.root})
        except ValidationError as e:
            raise BundleError(f"{self.source}: its spec.yaml is not a valid spec ({e.error_count()} problems: "
                              f"{e.errors()[0]['msg']})") from None
