"""int8: explicit Q/DQ quantization (`quantize_int8`), its calibration data and calibration cache.

The data is either a folder of samples or seeded random data:

- a folder of images (.jpg, .png, ...) for a segment whose one input takes them, [B, 3, S, S]: each
  image letterboxed on the host to S x S as the validation data is (docs/semantics.md), one sample
  each;
- a folder of `*.npz` files, one per sample, holding one array per segment input (keyed by input
  name); for a segment with a single input, `*.npy` files (one array per sample) work too. An array
  one rank short of the input gets a batch axis; arrays are cast to the input's dtype;
- `random`: `samples` draws, uniform in the spec's per-input `[low, high]` (default `[0, 1]`), from a
  generator seeded by (seed, sample index), so the same spec always calibrates on the same bytes.

A folder's files are read in name order and the first `samples` are used (images before .npz before
.npy: a folder holds one kind).

The cache is a folder of ONNX Runtime calibration caches (`quantize_static(calibration_cache_path=)`),
one JSON of tensor ranges per key: sha256 over the segment's bytes, the data's digest, the
calibration method, the op types calibrated, the ONNX Runtime version and a format number. A rebuild
with the same key loads the ranges and never runs the calibration model. An entry that does not load
counts as a miss and is rewritten.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)
from onnxruntime.quantization.calibrate import load_tensors_data

from ..errors import MissingDependency, SpecError, closest
from ..images import IMAGE_SUFFIXES, read_image, read_npy, read_npz
from ..log import Progress
from ..surgery.references import letterbox_numpy

log = logging.getLogger("deepjit.calibration")

CACHE_FORMAT = 1
# Entropy is not offered: quantize_static hands its calibrator no bin counts, and the defaults (128
# bins into 128) leave one threshold, the full range, so it gave min-max's ranges (docs/design.md,
# "Accuracy gate defaults").
METHODS = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile}
# TensorRT runs Q/DQ around its compute-heavy layers; quantizing elementwise ops too only adds
# requantization (and error) that TensorRT would have to fuse away.
DEFAULT_OP_TYPES = ("Conv", "ConvTranspose", "MatMul", "Gemm")

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class CalibrationSettings:
    """The spec's `engine.calibration` block plus what random data needs (ranges, shapes)."""

    data: Path | str  # a folder, or "random"
    cache: Path  # a folder of cached tensor ranges
    samples: int = 16
    seed: int = 0
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # fills symbolic dims
    method: str = "minmax"
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpecError(f"engine.calibration.method: must be one of {', '.join(METHODS)}, got "
                            f"'{self.method}'{closest(self.method, METHODS)}")
        if self.samples < 1:
            raise SpecError(f"engine.calibration.samples: must be >= 1, got {self.samples}")
        if not isinstance(self.data, Path) and self.data != "random":
            raise SpecError(f"engine.calibration.data: a folder or 'random', got {self.data!r}")

    @classmethod
    def from_spec(cls, spec) -> CalibrationSettings | None:
        """From a `spec.Spec`: None when the spec has no `engine.calibration` block."""
        cal = spec.engine.calibration
        if cal is None:
            return None
        rnd = spec.validation.data.random
        # Each sample at the profile's min shape (batch 1, usually): ranges depend on the images, not
        # on how they are batched, and calibration runs on the CPU.
        return cls(data=cal.data, cache=Path(cal.cache), samples=cal.samples, method=cal.method,
                   seed=spec.validation.seed, ranges=dict(rnd.ranges) if rnd is not None else {},
                   shapes={name: inp.min_shape for name, inp in spec.inputs.items()})

    @property
    def calibrate_method(self) -> CalibrationMethod:
        return METHODS[self.method]


class CalibrationReader(CalibrationDataReader):
    """ONNX Runtime's data reader over lazily loaded samples; `reads` counts samples handed out;
    `source` says what they are ("16 of 17 images in photos")."""

    def __init__(self, samples: Sequence[Callable[[], Feeds]], digest: str, source: str = ""):
        self._samples, self.digest, self.source = list(samples), digest, source
        self._start, self._end, self._next = 0, len(self._samples), 0
        self.reads = 0
        self.on_read: Callable[[], None] | None = None  # a progress count

    def get_next(self) -> Feeds | None:
        if self._next >= self._end:
            return None
        feeds = self._samples[self._next]()
        self._next += 1
        self.reads += 1
        if self.on_read is not None:
            self.on_read()
        return feeds

    def __len__(self) -> int:
        return len(self._samples)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._start, self._end = start_index, min(end_index, len(self._samples))
        self._next = self._start

    def rewind(self) -> None:
        self._next = self._start


@dataclass(frozen=True, slots=True)
class _Input:
    name: str
    dtype: np.dtype
    dims: tuple[int | str | None, ...]  # ints are static, anything else is symbolic


def _inputs(model: onnx.ModelProto) -> list[_Input]:
    inits = {t.name for t in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        out.append(_Input(vi.name, np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)), dims))
    return out


def reader_for(model: onnx.ModelProto, settings: CalibrationSettings) -> CalibrationReader:
    """A lazy reader over the calibration data for `model`'s inputs (a segment, not the whole net)."""
    inputs = _inputs(model)
    if settings.data == "random":
        return _random_reader(inputs, settings)
    return _folder_reader(inputs, Path(settings.data), settings)


def _concrete_shape(inp: _Input, settings: CalibrationSettings) -> tuple[int, ...]:
    given = settings.shapes.get(inp.name)
    if given is not None:
        if len(given) != len(inp.dims) or any(isinstance(d, int) and d != g for d, g in zip(inp.dims, given)):
            raise SpecError(f"calibration shape for input '{inp.name}' is {tuple(given)}, but the segment "
                            f"takes {_show(inp.dims)}")
        return tuple(int(g) for g in given)
    # Without a given shape, a symbolic leading (batch) dim calibrates at 1; any other is unknowable.
    dims = [1 if i == 0 and not isinstance(d, int) else d for i, d in enumerate(inp.dims)]
    if not all(isinstance(d, int) and d > 0 for d in dims):
        raise SpecError(f"random calibration data for input '{inp.name}' {_show(inp.dims)}: its symbolic "
                        f"dims need a concrete shape (the spec's inputs.{inp.name}.profile)")
    return tuple(dims)


def _random_reader(inputs: list[_Input], settings: CalibrationSettings) -> CalibrationReader:
    plan = []
    for inp in inputs:
        low, high = settings.ranges.get(inp.name, (0.0, 1.0))
        if not low < high:
            raise SpecError(f"random data range for input '{inp.name}': need low < high, got [{low}, {high}]")
        plan.append((inp.name, _concrete_shape(inp, settings), inp.dtype, float(low), float(high)))
    recipe = json.dumps({"seed": settings.seed, "samples": settings.samples,
                         "inputs": [[n, list(s), str(t), lo, hi] for n, s, t, lo, hi in plan]}, sort_keys=True)

    def sample(k: int) -> Feeds:
        rng = np.random.default_rng([settings.seed, k])
        feeds = {}
        for name, shape, dtype, low, high in plan:
            if np.issubdtype(dtype, np.integer):
                feeds[name] = rng.integers(int(low), int(high), size=shape, endpoint=True).astype(dtype)
            else:
                feeds[name] = rng.uniform(low, high, size=shape).astype(dtype)
        return feeds

    digest = "random:" + hashlib.sha256(recipe.encode()).hexdigest()
    return CalibrationReader([lambda k=k: sample(k) for k in range(settings.samples)], digest,
                             f"{settings.samples} seeded random samples")


def _folder_reader(inputs: list[_Input], folder: Path, settings: CalibrationSettings) -> CalibrationReader:
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise SpecError(f"engine.calibration.data: folder {folder} {what} (give a folder of samples or 'random')")
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    npz = sorted(folder.glob("*.npz"))
    found = images or npz or sorted(folder.glob("*.npy"))
    kind = "images" if images else ".npz files" if npz else ".npy files"
    if not found:
        raise SpecError(f"engine.calibration.data: no images ({', '.join(IMAGE_SUFFIXES)}), .npz or .npy files "
                        f"in {folder}")
    if not npz and len(inputs) != 1:
        raise SpecError(f"engine.calibration.data: {folder} holds {kind}, but the segment has "
                        f"{len(inputs)} inputs ({', '.join(i.name for i in inputs)}): give one .npz per "
                        "sample with an array per input")
    files = found[:settings.samples]
    h = hashlib.sha256()
    if images:
        size = _image_size(inputs[0], settings, folder)
        h.update(f"letterbox {size} {inputs[0].dtype}\0".encode())  # how the images become samples
        load = partial(_load_image, inp=inputs[0], size=size)
    else:
        load = partial(_load_sample, inputs=inputs)
    for f in files:
        h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return CalibrationReader([partial(load, f) for f in files], "folder:" + h.hexdigest(),
                             f"{len(files)} of {len(found)} {kind} in {folder.name}")


def _image_size(inp: _Input, settings: CalibrationSettings, folder: Path) -> int:
    """S of a segment input [B, 3, S, S] that takes letterboxed images."""
    shape = _concrete_shape(inp, settings)
    if len(shape) != 4 or shape[1] != 3 or shape[2] != shape[3]:
        raise SpecError(f"engine.calibration.data: {folder} holds images, but the segment's input '{inp.name}' "
                        f"{_show(inp.dims)} takes none (a square [B, 3, S, S] input does): give .npy or .npz files")
    return shape[2]


def _load_image(path: Path, inp: _Input, size: int) -> Feeds:
    """An image letterboxed like the validation data (validation/data.py: read as BGR, swapped back)."""
    bgr = read_image(path)[..., ::-1]
    return {inp.name: letterbox_numpy(bgr[None], size=size, dtype=str(inp.dtype), swap_rb=True)["images"]}


def _load_sample(path: Path, inputs: list[_Input]) -> Feeds:
    # an .npy holds one array, not an archive; a file that is no array is exit 2 naming it
    arrays = read_npz(path, {i.name for i in inputs}) if path.suffix == ".npz" else {inputs[0].name: read_npy(path)}
    feeds = {}
    for inp in inputs:
        if inp.name not in arrays:
            raise SpecError(f"calibration sample {path}: no array '{inp.name}'{closest(inp.name, arrays)}; "
                            f"it holds {', '.join(arrays) or 'nothing'}")
        arr = np.asarray(arrays[inp.name])
        if arr.ndim == len(inp.dims) - 1:
            arr = arr[None]
        if arr.ndim != len(inp.dims) or any(isinstance(d, int) and d != a for d, a in zip(inp.dims, arr.shape)):
            raise SpecError(f"calibration sample {path}: '{inp.name}' has shape {arr.shape}, the segment "
                            f"takes {_show(inp.dims)}")
        feeds[inp.name] = np.ascontiguousarray(arr, dtype=inp.dtype)
    return feeds


def _show(dims) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in dims) + "]"


def cache_key(model: onnx.ModelProto, data_digest: str, settings: CalibrationSettings) -> str:
    """sha256 over everything that decides the tensor ranges."""
    parts = {
        "format": CACHE_FORMAT,
        "onnxruntime": onnxruntime.__version__,
        "model": hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest(),
        "data": data_digest,
        "method": settings.method,
        "op_types": sorted(settings.op_types),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_file(model: onnx.ModelProto, reader: CalibrationReader, settings: CalibrationSettings) -> tuple[Path, bool]:
    """(the cache entry for this model and data, whether it holds usable ranges). A broken entry is
    deleted, so ONNX Runtime recalibrates and rewrites it."""
    folder = Path(settings.cache)
    if folder.exists() and not folder.is_dir():
        raise SpecError(f"engine.calibration.cache: {folder} exists and is not a folder; the cache is a folder of "
                        "calibration caches")
    path = folder / f"{cache_key(model, reader.digest, settings)}.json"
    if path.exists() and not path.is_file():
        raise SpecError(f"engine.calibration.cache: {path} is not a file")
    if not path.is_file():
        return path, False
    try:
        ranges = load_tensors_data(path)
        if ranges.calibration_method != settings.calibrate_method:
            raise ValueError(f"holds {ranges.calibration_method}, not {settings.calibrate_method}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("calibration cache entry %s is unreadable (%s): recalibrating", path, e)
        path.unlink(missing_ok=True)
        return path, False
    return path, True


def quantize_int8(model: onnx.ModelProto, settings: CalibrationSettings, *,
                  exclude: Iterable[str] = ()) -> onnx.ModelProto:
    """`model` with explicit Q/DQ int8 quantization for TensorRT, ranges from the cache or calibrated
    on `settings`' data (and cached); the nodes named in `exclude` stay fp32."""
    if "calibration_cache_path" not in inspect.signature(quantize_static).parameters:
        raise MissingDependency("int8 needs ONNX Runtime's calibration cache (quantize_static's "
                                "calibration_cache_path, in 1.30 and later); this is onnxruntime "
                                f"{onnxruntime.__version__}: upgrade it")
    reader = reader_for(model, settings)
    cache, hit = cache_file(model, reader, settings)
    log.info("int8: %s (%s)", "calibration cache hit, skipping calibration" if hit else
             f"calibrating on {reader.source}", cache)
    with tempfile.TemporaryDirectory(prefix="deepjit-int8-") as tmp, _without_preprocess_advice(), \
            Progress("int8 calibration", 0 if hit else len(reader), unit="samples", logger=log.name) as progress:
        reader.on_read = progress.advance
        out = Path(tmp) / "int8.onnx"
        quantize_static(model, out, reader, quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=list(settings.op_types), nodes_to_exclude=sorted(exclude),
                        calibrate_method=settings.calibrate_method, calibration_cache_path=cache,
                        # TensorRT takes symmetric int8 only (zero point 0), rejects an int32 bias
                        # behind a DequantizeLinear ("only activation types allowed"), and wants Q/DQ
                        # on the inputs of its int8 layers: the Conv output stays fp32 into SiLU.
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                                       "QuantizeBias": False,
                                       "OpTypesToExcludeOutputQuantization": list(settings.op_types)})
        return onnx.load(out)


class _DropPreprocessAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-process" not in record.getMessage()


@contextlib.contextmanager
def _without_preprocess_advice():
    """quantize_static warns on the root logger that the model was not run through ORT's
    pre-processing (shape inference + ORT optimizations). Segments are already shape-inferred, and
    ORT's optimizer would rename the nodes that keep_fp32 names; the advice is noise here."""
    root, drop = logging.getLogger(), _DropPreprocessAdvice()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)
