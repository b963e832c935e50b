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
from google.protobuf.message import DecodeError
from onnx.external_data_helper import load_external_data_for_model
from pydantic import ValidationError

from ..engines.flavours import flavour_of_plan
from ..errors import BundleError, KernelError, closest
from ..graph.tensors import TensorSig
from ..jit.contracts import Contract, DetectionOutputs, detection_outputs, is_contract_path, load_contract
from ..jit.nvrtc import CompiledKernel
from ..spec.locate import describe_errors
from ..spec.models import Data, Spec
from ..spec.safeyaml import load_yaml, read_text
from .checks import as_list, check_data_folder, check_external_data, check_manifest, input_profile


def _field(mapping: Any, key: str, where: str) -> Any:
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise BundleError(f"manifest: '{where}.{key}' is missing (a bundle from another DeepJIT version?)")
    return mapping[key]


def _tensors(items: Any) -> tuple[TensorSig, ...]:
    return tuple(TensorSig(t["name"], t["dtype"], tuple(t["shape"])) for t in items)


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


# The parsers below read a manifest that checks.check_manifest has given its shape (types, names).
def _kernel(step: str, index: int, entry: Mapping[str, Any]) -> KernelView:
    contract = entry["contract"]
    return KernelView(step, index, contract, dict(entry["params"]), sm_of(entry.get("arch", ""), f"{step}/{contract}"),
                      dict(entry["files"]), entry)


def _step(s: Mapping[str, Any]) -> StepView:
    kind, name = s["kind"], s["name"]
    file = _field(s, "file" if kind == "segment" else "reference", f"plan.steps[{name}]")
    kernels = tuple(_kernel(name, j, k) for j, k in enumerate(s.get("kernels") or ()))
    if kind != "segment" and not kernels:
        raise BundleError(f"manifest: step '{name}' ({kind}) has no compiled kernels")
    return StepView(name, kind, _tensors(s.get("inputs") or ()), _tensors(s.get("outputs") or ()), file, kernels,
                    dict(s.get("facts") or s.get("params") or {}), s.get("position"))


def _inputs(declared: Mapping[str, Any], plan: Mapping[str, Any]) -> tuple[InputView, ...]:
    out = []
    for t in _tensors(_field(plan, "inputs", "plan")):
        d = declared.get(t.name) or {}
        if not d and not t.is_static:
            raise BundleError(f"manifest: input '{t.name}' has symbolic dims {list(t.shape)} but no "
                              "inputs.<name>.min/max profile")
        lo, opt, hi = input_profile(t, d)
        buckets = tuple(sorted({b for b in (d.get("buckets") or ()) if lo[0] <= b <= hi[0]} | {hi[0]}))
        out.append(InputView(t.name, t.dtype, t.shape, lo, opt, hi, buckets))
    return tuple(out)


def _plan(segment: str, entry: Any) -> PlanView:
    if isinstance(entry, str):  # a bare file name: what is known is its flavour, by its name
        f = flavour_of_plan(entry)
        return PlanView(segment, entry, f.name, f.module_name, "", (), None, (), (), {}, "")
    return PlanView(segment, entry["file"], entry["flavour"], entry.get("library", ""), entry.get("version", ""),
                    tuple(entry.get("compute_capabilities") or ()), entry.get("network_layers"),
                    tuple(entry.get("inputs") or ()), tuple(entry.get("outputs") or ()),
                    dict(entry.get("profiles") or {}), entry.get("key", ""))


def _engine(e: Mapping[str, Any] | None) -> EngineView:
    if e is None:
        return EngineView("onnxruntime", False, "", "fp32", {}, {}, {})
    return EngineView(e.get("backend", ""), bool(e.get("deferred")), e.get("reason", ""),
                      e.get("precision") or "fp32", dict(e.get("settings") or {}),
                      {k: tuple(as_list(v)) for k, v in (e.get("segments") or {}).items()},
                      {k: tuple(_plan(k, p) for p in as_list(v)) for k, v in (e.get("plans") or {}).items()})


class BundleView:
    """A bundle: its folder (`root`), what read_bundle was given (`source`), the manifest as written, and
    the manifest's content, typed and parsed once on first use (a bundle of other fields, as the store
    tests write, is still a bundle). Made by `read_bundle` (verified) or over a build's staged files.
    A pulled bundle is untrusted: the typed content is read only once its shape is checked (checks.py),
    and an ONNX file only once it is known to read no file but the bundle's."""

    def __init__(self, root: Path, manifest: Mapping[str, Any], source: Path | None = None, keep: Any = None):
        self.root, self.manifest = Path(root), manifest
        self.source = Path(source) if source is not None else self.root
        self._keep = keep  # a temporary folder that lives as long as this view
        self._onnx_checked: set[str] = set()
        self._sections_checked: set[str] = set()

    def __repr__(self) -> str:
        return f"BundleView({str(self.source)!r}, {self.digest or 'unsealed'})"

    @property
    def digest(self) -> str:
        return str(self.manifest.get("digest", ""))

    @property
    def name(self) -> str:
        return self._section("name") or ""

    @property
    def files(self) -> Mapping[str, Mapping[str, Any]]:
        return self.manifest.get("files") or {}

    def file(self, path: str) -> Path:
        """The on-disk path of the bundle file `path` (as listed in the manifest). An ONNX file is checked
        first (_load_onnx): whoever reads it (onnx, ONNX Runtime from its bytes, TensorRT's parser) then
        reads no file the bundle does not hold."""
        full = self._listed(path)
        if path.endswith(".onnx") and path not in self._onnx_checked:
            self._load_onnx(path, full)
        return full

    def _listed(self, path: str) -> Path:
        if path not in self.files:
            raise BundleError(f"{self.source}: no file '{path}' in the bundle{closest(path, self.files)}")
        return self.root / path

    def onnx(self, path: str) -> onnx.ModelProto:
        """The bundle's ONNX file `path` with its weights: inline, or for the reference model in bundle
        files beside it (the build copies a model's external data so)."""
        full = self._listed(path)
        model = self._load_onnx(path, full)
        if path == self.reference_model:
            try:
                load_external_data_for_model(model, str(full.parent))
            except (OSError, ValueError, onnx.checker.ValidationError) as e:
                raise BundleError(f"{self.source}: '{path}': its external weights cannot be read ({e})") from None
        return model

    def _load_onnx(self, path: str, full: Path) -> onnx.ModelProto:
        """The model without its external data, refused if it names any (ONNX Runtime would look for it
        in the working folder), but for the reference model's files beside it in the bundle."""
        try:
            model = onnx.load(str(full), load_external_data=False)
        except (DecodeError, OSError, ValueError) as e:
            raise BundleError(f"{self.source}: '{path}' is not a readable ONNX model ({e})") from None
        beside = self.files if path == self.reference_model else ()
        check_external_data(model, path, lambda rel: rel in beside, str(self.source))
        self._onnx_checked.add(path)
        return model

    # -- the content, typed --------------------------------------------------------------------------
    def _section(self, key: str) -> Any:
        """The manifest's top-level field `key` (None when absent), once its shape is what DeepJIT writes:
        what every typed field below reads. Only the fields read are checked (a bundle of other fields,
        as the store tests write, is still a bundle)."""
        if key not in self._sections_checked:
            check_manifest({key: self.manifest[key]} if key in self.manifest else {}, str(self.source))
            self._sections_checked.add(key)
        return self.manifest.get(key)

    @cached_property
    def _plan(self) -> Mapping[str, Any]:
        plan = self._section("plan")
        if plan is None:
            raise BundleError("manifest: 'plan' is missing (a bundle from another DeepJIT version?)")
        return plan

    @cached_property
    def inputs(self) -> tuple[InputView, ...]:
        return _inputs(self._section("inputs") or {}, self._plan)

    @cached_property
    def outputs(self) -> tuple[TensorSig, ...]:
        return _tensors(self._plan["outputs"])

    @cached_property
    def steps(self) -> tuple[StepView, ...]:
        return tuple(_step(s) for s in self._plan["steps"])

    @cached_property
    def engine(self) -> EngineView:
        return _engine(self._section("engine"))

    @property
    def precision(self) -> str:
        return self.engine.precision

    @property
    def target_sm(self) -> int | None:
        return (self._section("target") or {}).get("sm")

    @property
    def target_gpu(self) -> str | None:
        return (self._section("target") or {}).get("gpu")

    @property
    def toolchain(self) -> Mapping[str, str]:
        """The versions that made the bundle: DeepJIT, NVRTC, ONNX, ONNX Runtime, Polygraphy, ..."""
        return {k: str(v) for k, v in (self._section("toolchain") or {}).items()}

    @property
    def spec_sha256(self) -> str | None:
        return (self._section("spec") or {}).get("sha256")

    @property
    def model_sha256(self) -> str | None:
        """The sha256 of the model the bundle was built from (its file is in the bundle only on request)."""
        return (self._section("model") or {}).get("sha256")

    @property
    def levels(self) -> Mapping[str, Any]:
        """The validation record: level -> {status, reason, outputs}."""
        return (self._section("validation") or {}).get("levels") or {}

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
        if is_contract_path(ref):
            if ref not in self.files:
                raise BundleError(f"manifest: '{ref}' is a path, not one of the bundle's files; a bundle's "
                                  "contract loads only from its own files or by a built-in name")
            return str(self.file(ref))
        return ref

    def compiled(self, kernel: KernelView) -> CompiledKernel:
        """The kernel as it was compiled: its record and its binaries, read from the bundle."""
        try:
            cubin, ptx = self.file(kernel.files["cubin"]).read_bytes(), self._text(kernel.files["ptx"])
        except KeyError as e:
            raise BundleError(f"{self.source}: kernel {kernel.name} lists no {e} file") from None
        source = kernel.files.get("source")
        contract = kernel.files.get("contract")
        try:
            return CompiledKernel.from_dict(kernel.entry, cubin=cubin, ptx=ptx,
                                            code=self._text(source) if source else "",
                                            filename=(source or "").rsplit("/", 1)[-1],
                                            contract_path=str(self.file(contract)) if contract else "")
        except KernelError as e:
            raise BundleError(f"{self.source}: manifest: {e}") from None

    def _text(self, path: str) -> str:
        try:
            return self.file(path).read_bytes().decode()
        except UnicodeDecodeError as e:
            raise BundleError(f"{self.source}: '{path}' is not UTF-8 text ({e.reason} at byte {e.start})") from None

    @cached_property
    def detections(self) -> tuple[DetectionOutputs, ...]:
        """The outputs that are detections, as the kernels' contracts declare them, with the threshold
        each kernel cut them at."""
        return tuple(d for s in self.steps for k in s.kernels if (d := detection_outputs(self.contract(k), k.params)))

    @property
    def reference_model(self) -> str | None:
        """The bundle path of the fp32 model it was built from, when it carries it (`bundle.reference_model`)."""
        file = (self._section("model") or {}).get("file")
        return file if file in self.files else None

    def model_file(self) -> str:
        if self.reference_model is None:
            raise BundleError(f"{self.source}: the bundle carries no reference model (build it with "
                              "`bundle.reference_model: true` to re-validate it end to end)")
        return self.reference_model

    def spec(self, data: Path | None = None) -> Spec:
        """The spec the bundle was built from (its text is in the bundle); paths resolve inside it, and
        the validation data it names is generated or inside the bundle. `data`: a folder the user names
        (`--data`) to validate on instead: a bundle never picks this machine's files, its user may."""
        path = self.file(_field(self._section("spec"), "file", "spec"))
        doc, root = load_yaml(read_text(path, BundleError, "the bundle's spec"), path, BundleError)
        try:
            spec = Spec.model_validate(doc, context={"base": self.root})
        except ValidationError as e:  # each problem with its line and field, as `deepjit build` says them
            where = describe_errors(e, Path(path.name), root, Spec) if root is not None else e.errors()[0]["msg"]
            raise BundleError(f"{self.source}: its spec.yaml is not a valid spec:\n{where}") from None
        if data is not None:
            return spec.model_copy(update={"validation": spec.validation.model_copy(
                update={"data": Data(folder=Path(data).resolve())})})
        check_data_folder(spec.validation.data.folder, self.root, str(self.source))
        return spec
