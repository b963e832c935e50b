"""The spec language: pydantic models for a pipeline YAML (extra keys forbidden, frozen).

Relative paths resolve against the spec file's folder (the `base` of the validation context)."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..config import INT32_MAX, MAX_DEVICE_BYTES
from .targets import PRECISION_MIN_SM, TENSORRT_RTX_SM, compute_capability, sm_for_gpu

LEVELS = ("graph", "precision", "kernels", "end_to_end", "engine")
BACKENDS = ("auto", "tensorrt", "tensorrt-rtx", "onnxruntime")
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
CALIBRATED = ("int8",)  # precisions whose ranges come from calibration data
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_compute_capability")
DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool")
# A dim or a batch size: an int as YAML writes one (pydantic's lax int took `true` as 1 and 640.0 as 640)
Dim = Annotated[int, Strict()]


def _resolve(value: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get("base")
    return value if value.is_absolute() or base is None else (Path(base) / value).resolve()


SpecPath = Annotated[Path, AfterValidator(_resolve)]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def _bytes(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"expected a size such as 2GiB, 512MiB or a number of bytes, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


# A pipeline's name, also its bundle's: it names files (build/NAME, NAME.tar.gz, NAME.report), Triton
# models and report steps, so it is plain (never a path, never an option) and short enough that every
# such file name fits a file system's 255 bytes. Bundles, their steps and `export triton` check it too.
NAME = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$"
NAME_RULE = "1 to 200 letters, digits, '_', '.' and '-', not starting with '.' or '-'"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(_Model):
    """The ONNX model; synthesized when the file is missing and `synthesize` is set."""

    path: SpecPath
    synthesize: Literal["yolov8n", "yolov8s"] | None = None
    seed: int = 0
    head_layout: Literal["split", "separate"] = "separate"
    dynamic: bool = False


class Target(_Model):
    """The GPU the bundle is for: a name (T4, A10, L4, H100, ...) and/or its SM."""

    gpu: str | None = None
    sm: int | None = Field(None, ge=75, description="compute capability as an integer, e.g. 75; NVRTC 13 needs >= 75")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, name: str | None) -> str | None:
        if name is not None:
            sm_for_gpu(name)
        return name

    @model_validator(mode="after")
    def _consistent(self) -> "Target":
        if self.gpu is None and self.sm is None:
            raise ValueError("give `gpu` (e.g. T4), `sm` (e.g. 75) or both")
        if self.gpu is not None:
            known = sm_for_gpu(self.gpu)
            if self.sm is not None and self.sm != known:
                raise ValueError(f"gpu {self.gpu} is sm_{known}, but sm is {self.sm}")
        return self

    @property
    def resolved_sm(self) -> int:
        return self.sm if self.sm is not None else sm_for_gpu(self.gpu)


class Profile(_Model):
    """An optimization profile: the min/opt/max shapes an engine must accept."""

    min: list[Dim]
    opt: list[Dim]
    max: list[Dim]


class InputSpec(_Model):
    shape: list[Union[Dim, str]] = Field(min_length=1, description="dims, the batch first; strings are symbolic "
                                         "(e.g. batch)")
    dtype: Literal[DTYPES] = "float32"  # type: ignore[valid-type]
    profile: Profile | None = None
    buckets: list[Dim] | None = Field(None, min_length=1, description="batch sizes to capture CUDA graphs for")

    @model_validator(mode="after")
    def _check_profile(self) -> "InputSpec":
        if self.profile is None:
            self._check_static_dims()
        else:
            self._check_profile_dims(self.profile)
        # A static shape is its own min, opt and max: the size and bucket bounds hold for it too.
        what = "profile.max" if self.profile else "shape"
        nbytes = math.prod(self.max_shape) * np.dtype(self.dtype if self.dtype != "bfloat16" else "float16").itemsize
        if nbytes > MAX_DEVICE_BYTES:
            raise ValueError(f"{what} {list(self.max_shape)} of {self.dtype} is {nbytes} bytes a batch; at most "
                             f"{MAX_DEVICE_BYTES} (1 TiB, more than any GPU holds)")
        lo, hi = self.min_shape[0], self.max_shape[0]
        bad = [b for b in self.buckets or () if not lo <= b <= hi]
        if bad:
            raise ValueError(f"buckets {bad} lie outside the {what.split('.')[0]}'s batch range {lo}..{hi}")
        return self

    def _check_static_dims(self) -> None:
        symbolic = [d for d in self.shape if isinstance(d, str)]
        if symbolic:
            raise ValueError(f"shape has symbolic dims {symbolic}: give profile min/opt/max")
        for i, dim in enumerate(self.shape):
            if not 1 <= dim <= INT32_MAX:
                raise ValueError(f"shape dim {i}: need 1 <= dim <= {INT32_MAX} (TensorRT's dims are int32), got {dim}")

    def _check_profile_dims(self, p: Profile) -> None:
        rank = len(self.shape)
        for key in ("min", "opt", "max"):
            if len(getattr(p, key)) != rank:
                raise ValueError(f"profile.{key} has {len(getattr(p, key))} dims, shape has {rank}")
        for i, dim in enumerate(self.shape):
            lo, mid, hi = p.min[i], p.opt[i], p.max[i]
            if not (1 <= lo <= mid <= hi <= INT32_MAX):
                raise ValueError(f"profile dim {i}: need 1 <= min <= opt <= max <= {INT32_MAX} (TensorRT's dims are "
                                 f"int32), got {lo}, {mid}, {hi}")
            if isinstance(dim, int) and not (lo == mid == hi == dim):
                raise ValueError(f"profile dim {i}: shape fixes it to {dim}, profile gives {lo}/{mid}/{hi}")

    @property
    def min_shape(self) -> tuple[int, ...]:
        return tuple(self.profile.min) if self.profile else tuple(self.shape)  # type: ignore[arg-type]

    @property
    def opt_shape(self) -> tuple[int, ...]:
        return tuple(self.profile.opt) if self.profile else tuple(self.shape)  # type: ignore[arg-type]

    @property
    def max_shape(self) -> tuple[int, ...]:
        return tuple(self.profile.max) if self.profile else tuple(self.shape)  # type: ignore[arg-type]

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """Explicit buckets, else 1, 2, 4, 8 within the profile's batch range (plus its max)."""
        if self.buckets is not None:
            return tuple(sorted(set(self.buckets)))
        lo, hi = self.min_shape[0], self.max_shape[0]
        return tuple(sorted({b for b in (1, 2, 4, 8) if lo <= b <= hi} | {hi}))


class Calibration(_Model):
    """int8 calibration: a folder of images, .npz or .npy samples, or seeded random data."""

    data: Union[SpecPath, Literal["random"]] = Field(
        description="a folder of images (letterboxed to the input like the validation data), of .npz files (one "
        "per sample, an array per segment input) or of .npy files (one-input segments); or 'random'")
    cache: SpecPath = Field(description="a folder of calibration caches (tensor ranges), reused by later builds")
    samples: int = Field(16, ge=1, description="how many: a folder's first files in name order, or random draws")
    method: Literal["minmax", "percentile"] = Field(
        "minmax", description="each tensor's range: its min and max over the samples, or the 99.999th percentile "
        "of its magnitude (clips rare outliers)")


class Engine(_Model):
    backend: Literal[BACKENDS] = Field("auto", description=(  # type: ignore[valid-type]
        "auto: TensorRT when it builds for the target here, else TensorRT-RTX when it supports the target's "
        "compute capability, else a deferred TensorRT plan; or tensorrt, tensorrt-rtx, onnxruntime"))
    precision: Literal[PRECISIONS] = "fp32"  # type: ignore[valid-type]
    keep_fp32: list[str] | None = Field(None, description="op types or node names kept in fp32; default: DFL Softmax and friends")
    workspace: int = Field(2**30, gt=0, le=MAX_DEVICE_BYTES, description="TensorRT workspace pool, e.g. 2GiB; at "
                           "most 1 TiB")
    timing_cache: SpecPath | None = Field(None, description="TensorRT's timing cache (TensorRT-RTX times nothing "
                                                            "at build: it keeps a runtime cache where it runs)")
    optimization_level: int = Field(3, ge=0, le=5)
    hardware_compatibility: Literal[HARDWARE_COMPATIBILITY] = "none"  # type: ignore[valid-type]
    calibration: Calibration | None = None
    tf32: bool = Field(False, description="let ONNX Runtime's CUDA engine use TF32 in fp32 segments (faster on "
                       "Ampere and newer, about 1e-3 relative error); off: fp32 means fp32")

    @field_validator("workspace", mode="before")
    @classmethod
    def _parse_workspace(cls, value: Any) -> int:
        return _bytes(value)

    @model_validator(mode="after")
    def _calibrated(self) -> "Engine":
        problem = calibration_problem(self.precision, self.calibration)
        if problem:
            raise ValueError(problem)
        return self


def calibration_problem(precision: str, calibration) -> str | None:
    """Why `precision` cannot be built with `calibration` (None when it can): int8 needs calibration data."""
    if precision in CALIBRATED and calibration is None:
        return f"precision {precision} needs `calibration` (data: a folder or random, cache: a folder)"
    return None


class KernelRef(_Model):
    """A replacement kernel: a contract in kernels/ (by name) or a path to a user's contract YAML."""

    contract: str
    params: dict[str, Any] = Field(default_factory=dict)


class Cut(_Model):
    """A region cut out of the model (by tensor names or a preset), or a stage added before/after it."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                      description="an identifier (letters, digits and '_', not starting with a digit)")
    preset: Literal["yolov8_decode"] | None = None
    inputs: list[str] | None = None
    outputs: list[str] | None = None
    add: Literal["before", "after"] | None = None
    at: str | None = None
    kernels: list[KernelRef] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_boundary(self) -> "Cut":
        forms = {"preset": self.preset is not None,
                 "inputs/outputs": self.inputs is not None or self.outputs is not None,
                 "add/at": self.add is not None or self.at is not None}
        given = [k for k, v in forms.items() if v]
        if len(given) != 1:
            raise ValueError(f"give exactly one boundary: preset, inputs+outputs, or add+at; got {given or 'none'}")
        if given == ["inputs/outputs"] and not (self.inputs and self.outputs):
            raise ValueError("a cut by tensor names needs both `inputs` and `outputs`")
        if given == ["add/at"] and not (self.add and self.at):
            raise ValueError("an added stage needs both `add` (before|after) and `at` (a model tensor)")
        return self


# NVRTC options a spec may not pass. Those that add to the include path or read or write other files
# (precompiled headers, dependency lists, timing and trace files): headers come from the contract only,
# and a compile writes nothing (jit/includes.py checks them again at compile time). And those that pick
# the architecture: the target's SM does, and the binaries are named and recorded by it. NVRTC takes
# some long options with one dash too (`-time=f` writes f, `-use-pch=f` reads it): both forms are here.
FILE_OPTIONS = ("-I", "--include-path", "-include", "--pre-include", "--use-bundled-headers", "-pch", "--pch",
                "--create-pch", "-create-pch", "--use-pch", "-use-pch", "-M", "--dependency",
                "--generate-dependencies", "--time", "-time", "--fdevice-time-trace", "-fdevice-time-trace")
TARGET_OPTIONS = ("-arch", "--gpu-architecture")


class Compile(_Model):
    """NVRTC options for the replacement kernels."""

    options: list[str] = Field(default_factory=list)
    fast_math: bool = False
    debug: bool = False
    cache_dir: SpecPath | None = None

    @field_validator("options")
    @classmethod
    def _allowed(cls, options: list[str]) -> list[str]:
        for opt in options:
            if opt.strip().startswith(FILE_OPTIONS):
                raise ValueError(f"{opt!r}: options that read or write files are not allowed (kernel headers come "
                                 "from the contract's `headers:`, and a compile writes nothing)")
            if opt.strip().startswith(TARGET_OPTIONS):
                raise ValueError(f"{opt!r}: the architecture comes from `target` (gpu or sm), which also names "
                                 "the binaries; set it there")
        return options

    @field_validator("cache_dir")
    @classmethod
    def _a_folder(cls, folder: Path | None) -> Path | None:
        if folder is not None and folder.exists() and not folder.is_dir():
            raise ValueError(f"{folder} exists and is not a folder (the compile cache is a folder)")
        return folder


class Tolerance(_Model):
    atol: float = Field(1e-5, ge=0)
    rtol: float = Field(1e-5, ge=0)
    check_error_stat: Literal["max", "mean", "median", "elemwise"] = "elemwise"


class RandomData(_Model):
    ranges: dict[str, tuple[float, float]] = Field(default_factory=dict, description="per input [low, high]")

    @field_validator("ranges")
    @classmethod
    def _finite_and_ordered(cls, ranges: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        for name, (low, high) in ranges.items():
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise ValueError(f"{name}: [{low}, {high}]: a range is [low, high], both finite numbers, low < high")
        return ranges


class Data(_Model):
    random: RandomData | None = None
    folder: SpecPath | None = Field(None, description="images (all of them, letterboxed, batched by the buckets) or "
                                    "<input>_<k>.npy batches")

    @model_validator(mode="after")
    def _one_source(self) -> "Data":
        if (self.random is None) == (self.folder is None):
            raise ValueError("give exactly one of `random` or `folder`")
        return self


class DetectionTolerance(_Model):
    """Detection outputs are compared as sets: the pipeline's detections scored with the reference's as
    ground truth, COCO-style (docs/semantics.md, "Detection metrics"). These defaults are the exact
    levels' (`tolerances`); `precision_tolerances` has lossy ones."""

    min_map: float = Field(0.99, ge=0, le=1, description="mAP50-95 at least this")
    min_map50: float = Field(0.99, ge=0, le=1, description="mAP50 at least this")
    min_recall: float = Field(0.99, ge=0, le=1, description="recall at IoU 0.5 at least this (over all images)")
    min_precision: float = Field(0.99, ge=0, le=1, description="precision at IoU 0.5 at least this")
    min_iou: float = Field(0.99, ge=0, le=1, description="every pair matched at IoU 0.5 overlaps at least this much")
    score_atol: float = Field(1e-3, ge=0, description="every matched pair's scores differ by at most this")
    margin: float = Field(0.02, ge=0, le=1, description="borderline band: a detection whose score is within this of "
                          "the confidence threshold (or of the last score of an image full at max_det) may be "
                          "missing on the other side")


class Tolerances(_Model):
    default: Tolerance = Tolerance()
    outputs: dict[str, Tolerance] = Field(default_factory=dict)
    detections: DetectionTolerance = DetectionTolerance()


# The levels' defaults, measured (docs/design.md, "Accuracy gate defaults"): exact for fp32 kernels and
# engines against ONNX Runtime; lossy for fp16/bf16/int8, where fp16 on a trained YOLOv8n loses
# nothing (mAP50-95 1.000) and int8, min-max calibrated on the same photos, loses 0.17.
EXACT_TOLERANCES = Tolerances()
LOSSY_TOLERANCES = Tolerances(
    default=Tolerance(atol=0.05, rtol=0.05, check_error_stat="mean"),
    detections=DetectionTolerance(min_map=0.9, min_map50=0.95, min_recall=0.9, min_precision=0.9, min_iou=0.5,
                                  score_atol=0.1))


def merged_tolerances(defaults: Tolerances, given: Any) -> Any:
    """`given` (a spec's tolerances mapping) over `defaults`, field by field: a field the spec sets
    replaces that field only, and each `outputs` entry starts from the merged `default`."""
    if not isinstance(given, dict):
        return given
    base = defaults.model_dump()
    out = {**base, **given}
    for key in ("default", "detections"):
        if isinstance(given.get(key), dict):
            out[key] = {**base[key], **given[key]}
    if isinstance(given.get("outputs"), dict):
        default = out["default"] if isinstance(out["default"], dict) else base["default"]
        out["outputs"] = {name: {**default, **t} if isinstance(t, dict) else t for name, t in given["outputs"].items()}
    return out


class Validation(_Model):
    reference: Literal["onnxruntime"] = "onnxruntime"
    samples: int = Field(2, ge=1, description="random data: how many batches (a folder's files are all used)")
    seed: int = 0
    batch: int = Field(2, ge=1, description="batch size of the random samples (clamped to the profile)")
    data: Data = Data(random=RandomData())
    tolerances: Tolerances = Field(EXACT_TOLERANCES, description="kernels and engine levels, and end_to_end with an "
                                   "fp32 engine")
    precision_tolerances: Tolerances = Field(
        LOSSY_TOLERANCES, description="the precision level (the rewritten engine segments against fp32), and "
        "end_to_end when the engine is not fp32")
    gate: bool = True

    @model_validator(mode="before")
    @classmethod
    def _merge_tolerances(cls, data: Any) -> Any:
        """Tolerances given in the spec keep the level's defaults for every field they do not set."""
        if not isinstance(data, dict):
            return data
        return {**data, **{key: merged_tolerances(defaults, data[key]) for key, defaults in
                           (("tolerances", EXACT_TOLERANCES), ("precision_tolerances", LOSSY_TOLERANCES))
                           if key in data}}


class BundleOut(_Model):
    path: SpecPath = Path("build")
    archive: bool = Field(False, description="also write the reproducible <path>.tar.gz (a push packs one anyway)")
    reference_model: bool = Field(False, description="carry the fp32 model, for `deepjit validate` end to end "
                                                     "elsewhere; a deployed bundle does not need it")


class Publish(_Model):
    store: str = Field(pattern=r"^(file|oci)://.+", description="file://PATH or oci://HOST[:PORT]/REPO")
    tag: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$",
                     description="1 to 128 letters, digits, '_', '.' and '-', not starting with '.' or '-'")
    require: list[Literal[LEVELS]] = Field(default_factory=lambda: ["graph", "precision"])  # type: ignore[valid-type]

    @field_validator("store")
    @classmethod
    def _resolve_file_store(cls, url: str, info: ValidationInfo) -> str:
        """file:// paths are relative to the spec's folder, like every other path in it. Credentials
        never go in a spec (it travels inside every bundle)."""
        if url.startswith("oci://") and "@" in url[len("oci://"):].split("/", 1)[0]:
            raise ValueError("credentials in a store URL are refused: the spec travels inside every bundle; set "
                             "DEEPJIT_REGISTRY_USER, DEEPJIT_REGISTRY_PASSWORD and DEEPJIT_REGISTRY_HOST, or `docker login`")
        if url.startswith("file://"):
            return "file://" + str(_resolve(Path(url[len("file://"):]), info))
        return url


class Spec(_Model):
    """A DeepJIT pipeline."""

    name: str = Field(pattern=NAME, description=NAME_RULE)
    model: ModelSource
    target: Target
    inputs: dict[str, InputSpec] = Field(min_length=1)
    engine: Engine = Engine()
    compile: Compile = Compile()
    cuts: list[Cut] = Field(default_factory=list)
    validation: Validation = Validation()
    bundle: BundleOut = BundleOut()
    publish: Publish | None = None

    @field_validator("engine")
    @classmethod
    def _backend_builds_for_target(cls, engine: Engine, info: ValidationInfo) -> Engine:
        """`tensorrt-rtx` only for a target whose compute capability TensorRT-RTX supports (`auto`
        defers the plan instead)."""
        target = info.data.get("target")
        if engine.backend == "tensorrt-rtx" and target is not None and target.resolved_sm not in TENSORRT_RTX_SM:
            name = f"{target.gpu} is " if target.gpu else ""
            raise ValueError(f"backend tensorrt-rtx: TensorRT-RTX 1.7 builds plans for compute capabilities "
                             f"{', '.join(map(compute_capability, TENSORRT_RTX_SM))}; the target {name}sm_"
                             f"{target.resolved_sm} ({compute_capability(target.resolved_sm)}), which it does not "
                             "support: use backend auto (a deferred TensorRT plan) or tensorrt")
        return engine

    @field_validator("engine")
    @classmethod
    def _precision_on_target(cls, engine: Engine, info: ValidationInfo) -> Engine:
        target = info.data.get("target")
        need = PRECISION_MIN_SM.get(engine.precision, 0)
        if target is not None and target.resolved_sm < need:
            name = f"{target.gpu} " if target.gpu else ""
            raise ValueError(f"precision {engine.precision} needs sm_{need} or newer, but the target {name}is "
                             f"sm_{target.resolved_sm} and has no {engine.precision}: use fp16 (or int8)")
        return engine

    @field_validator("cuts")
    @classmethod
    def _unique_cut_names(cls, cuts: list[Cut]) -> list[Cut]:
        names = [c.name for c in cuts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"cut names must be unique, repeated: {dupes}")
        return cuts
