"""`deepjit export triton BUNDLE REPO`: a bundle as a model of a Triton Inference Server repository.

    REPO/NAME/config.pbtxt              inputs, outputs, max_batch_size, dynamic batching, instance groups
    REPO/NAME/VERSION/model.py          a Python-backend model: DeepJITModel (triton_model.py) over ...
    REPO/NAME/VERSION/bundle/           ... the bundle, copied whole (manifest.json + its files)
    REPO/NAME/deepjit-export.json       what this export wrote, with each file's sha256

config.pbtxt is made as tritonclient's ModelConfig protobuf message and printed in protobuf's text
format, so it holds only fields and enum values Triton knows. Inputs and outputs are the bundle's
(dims without the batch; a dim the profile lets vary is -1), `max_batch_size` the profile's max batch
unless asked lower, the dynamic batcher prefers the bundle's batch buckets, and instance groups are
KIND_GPU (`count` instances on each GPU listed, or on every GPU) or KIND_CPU. The model's folder is
written whole, in a hidden folder beside it renamed into place, under an output lock; a folder of
that name is replaced only when it is empty or exactly what an earlier export wrote (the Python
bytecode Python caches beside model.py aside). The other entries of REPO (other models) are never
touched.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from .._optional import lazy_import
from ..bundle.folder import MANIFEST, read_bundle, verify_folder
from ..bundle.view import BundleView
from ..choices import KINDS
from ..config import INT32_MAX
from ..errors import BundleError, ServeError
from ..files import cannot_write, output_lock, replace_dir, staging_dir
from ..runtime.layout import Layout
from ..spec.models import NAME, NAME_RULE
from .batches import box_mapping
from .triton_model import BUNDLE_DIR

log = logging.getLogger("deepjit.serve")

_schema = lazy_import("tritonclient.grpc.model_config_pb2",
                      "`deepjit export triton` writes config.pbtxt with tritonclient's model config schema: "
                      "install deepjit[triton]")
_text_format = lazy_import("google.protobuf.text_format", "config.pbtxt is protobuf text: install protobuf")

MARKER = "deepjit-export.json"
MARKER_FORMAT = 1
_NAME = re.compile(NAME)  # the spec's `name` pattern, so every built bundle fits it
INT64_MAX = 2**63 - 1  # ModelConfig's dims (its max_batch_size and batch sizes are int32: INT32_MAX)
# numpy dtype -> Triton's (the Python backend hands the model numpy arrays, so bfloat16 cannot pass)
TRITON_DTYPES = {"bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "uint16": "TYPE_UINT16", "uint32": "TYPE_UINT32",
                 "uint64": "TYPE_UINT64", "int8": "TYPE_INT8", "int16": "TYPE_INT16", "int32": "TYPE_INT32",
                 "int64": "TYPE_INT64", "float16": "TYPE_FP16", "float32": "TYPE_FP32", "float64": "TYPE_FP64"}


@dataclass(frozen=True, slots=True)
class TritonOptions:
    """What `deepjit export triton` was asked for (None: from the bundle)."""

    name: str | None = None
    version: int = 1
    max_batch: int | None = None
    kind: str = "gpu"
    instances: int = 1                       # per GPU (KIND_GPU) or in all (KIND_CPU)
    gpus: tuple[int, ...] | None = None      # None: every GPU the server sees
    env: str | None = None                   # EXECUTION_ENV_PATH: the serving Python environment
    dynamic_batching: bool = True
    max_queue_delay_us: int = 100


@dataclass(frozen=True, slots=True)
class TritonExport:
    """What an export wrote: the model folder, its name and version, the bundle digest, config.pbtxt."""

    model_dir: Path
    name: str
    version: int
    bundle_digest: str
    config: str
    maps_boxes: bool                          # boxes come back in the pixels of the images sent


# ----------------------------------------------------------------------------- untrusted text
def shown(text: Any) -> str:
    """`text` on one line of printable ASCII (newlines, control characters and the rest escaped): how a
    manifest's strings go into a comment or an error message, which they must not end or restyle."""
    return ascii(str(text))[1:-1]


def _count(value: Any, what: str, most: int, hint: str = "") -> int:
    """`value` if it is a whole number 0..most (what a ModelConfig field holds); ServeError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ServeError(f"{what} is {ascii(value)}: Triton's config.pbtxt holds a whole number from 0 "
                         f"to {most} there{hint}")
    return value


def _check_bundle_name(bundle: BundleView) -> None:
    """The manifest's name reaches config.pbtxt and model.py, and a pulled bundle is untrusted: it must be
    a name the spec allows (every built bundle's is), even where --name replaces it."""
    if bundle.name and not _NAME.fullmatch(bundle.name):
        raise ServeError(f"{bundle.source}: manifest.json field 'name' is '{shown(bundle.name)}': a bundle name "
                         f"is {NAME_RULE}; this bundle was not made by `deepjit build`")


# ----------------------------------------------------------------------------- options
def checked_options(layout: Layout, bundle: BundleView, options: TritonOptions) -> TritonOptions:
    """The options with the bundle's defaults filled in; ServeError naming the option and what is allowed."""
    _check_bundle_name(bundle)
    name = (layout.name or "") if options.name is None else options.name
    if not _NAME.fullmatch(name):
        raise ServeError(f"--name {name!r}: a Triton model name here is {NAME_RULE}"
                         + ("" if options.name is not None else " (the bundle has no usable name)"))
    if not (isinstance(options.version, int) and 1 <= options.version <= INT64_MAX):
        raise ServeError(f"--version {options.version}: Triton model versions are whole numbers from 1 to {INT64_MAX}")
    if options.kind not in KINDS:
        raise ServeError(f"--kind {options.kind!r}: one of {', '.join(KINDS)}")
    if not (isinstance(options.instances, int) and 1 <= options.instances <= INT32_MAX):
        raise ServeError(f"--instances {options.instances}: a whole number from 1 to {INT32_MAX}")
    if options.gpus is not None and (options.kind != "gpu" or not options.gpus or min(options.gpus) < 0 or
                                     max(options.gpus) > INT32_MAX or len(set(options.gpus)) != len(options.gpus)):
        raise ServeError(f"--gpus {','.join(map(str, options.gpus)) or repr('')}: distinct GPU numbers (0, 1, ... "
                         f"up to {INT32_MAX}), and only with --kind gpu")
    if options.env is not None and not Path(options.env).is_absolute():
        raise ServeError(f"--env {options.env}: give the serving environment's absolute path (Triton's "
                         "EXECUTION_ENV_PATH is read on the server)")
    if not 0 <= options.max_queue_delay_us <= INT64_MAX:
        raise ServeError(f"--max-queue-delay-us {options.max_queue_delay_us}: a whole number from 0 to {INT64_MAX}")
    if layout.min_batch > 1:
        raise ServeError(f"{bundle.source}: its profile's min batch is {layout.min_batch}; Triton sends batches "
                         "from 1: rebuild with profile min batch 1")
    return _with_max_batch(layout, options, name)


def _with_max_batch(layout: Layout, options: TritonOptions, name: str) -> TritonOptions:
    """The options with max_batch_size set: the profile's max batch unless asked lower; either must fit
    the int32 field (a pulled bundle's profile can say anything)."""
    if options.max_batch is None:
        max_batch = layout.max_batch
        field = next(f"manifest inputs.{shown(i.name)}.max[0]" for i in layout.inputs if i.max[0] == max_batch)
        _count(max_batch, f"{field} (the profile's max batch)", INT32_MAX, "; pass a smaller --max-batch")
    elif isinstance(options.max_batch, int) and options.max_batch < 1:
        max_batch = options.max_batch  # refused below naming the bundle's batches (the field's 0.. would not)
    else:
        max_batch = _count(options.max_batch, "--max-batch", INT32_MAX)
    if not 1 <= max_batch <= layout.max_batch:
        raise ServeError(f"--max-batch {max_batch}: this bundle takes batches 1..{layout.max_batch} (its profile)")
    return TritonOptions(name, options.version, max_batch, options.kind, options.instances, options.gpus,
                         options.env, options.dynamic_batching, options.max_queue_delay_us)


# ----------------------------------------------------------------------------- config.pbtxt
def _numpy_name(dtype: Any) -> str | None:
    try:
        return str(np.dtype(dtype)) if dtype != "bfloat16" else dtype
    except (TypeError, ValueError):  # not a dtype at all: refused below, as one Triton cannot take
        return None


def _data_type(dtype: Any, what: str) -> int:
    name = TRITON_DTYPES.get(_numpy_name(dtype))
    if name is None:
        raise ServeError(f"{what} is {shown(dtype)}: Triton's Python backend passes numpy arrays of "
                         f"{', '.join(TRITON_DTYPES)}; rebuild the bundle with one of them at its inputs and outputs")
    return _schema.DataType.Value(name)


def _dims(shape: Sequence[Any], what: str, profile: tuple[Sequence[int], Sequence[int]] | None = None) -> list[int]:
    """Dims after the batch: fixed ints, -1 where the profile (or a symbolic dim) lets them vary."""
    if shape is None or len(shape) < 1:
        raise ServeError(f"{what} has no batch dimension; Triton batches along the first dim of every tensor")
    if profile is not None:
        lo, hi = profile
        if not len(lo) == len(hi) == len(shape):
            raise ServeError(f"{what}: its profile min {shown(list(lo))} and max {shown(list(hi))} do not have the "
                             f"{len(shape)} dims of its shape")
        return [_count(lo[a], f"{what} profile min[{a}]", INT64_MAX) if lo[a] == hi[a] else -1
                for a in range(1, len(shape))]
    return [_count(d, f"{what} shape[{a}]", INT64_MAX) if isinstance(d, int) else -1
            for a, d in enumerate(shape) if a]


def _tensor_name(name: Any, what: str) -> str:
    """Protobuf's text format escapes any string, but a name Triton and its clients match on is printable text."""
    if not isinstance(name, str) or not name or not name.isprintable():
        raise ServeError(f"{what}: tensor name {ascii(name)} is not printable text; a Triton tensor name is")
    return name


def _tensor(entry: Any, name: str, data_type: int, dims: list[int]) -> None:
    entry.name, entry.data_type = name, data_type
    if dims:
        entry.dims.extend(dims)
    else:  # a tensor of the batch dim alone (num_dets [B]): Triton wants dims, clients see [B, 1]
        entry.dims.append(1)
        entry.reshape.SetInParent()


def model_config(layout: Layout, options: TritonOptions) -> Any:
    """config.pbtxt as a ModelConfig message (options already checked)."""
    mc = _schema
    config = mc.ModelConfig(name=options.name, backend="python", max_batch_size=options.max_batch)
    for n, i in enumerate(layout.inputs):
        what = f"manifest plan.inputs[{n}] ('{shown(i.name)}')"
        _tensor(config.input.add(), _tensor_name(i.name, what), _data_type(i.dtype, f"{what} dtype"),
                _dims(i.shape, what, (i.min, i.max)))
    for n, o in enumerate(layout.outputs):
        what = f"manifest plan.outputs[{n}] ('{shown(o.name)}')"
        _tensor(config.output.add(), _tensor_name(o.name, what), _data_type(o.dtype, f"{what} dtype"),
                _dims(o.shape, what))
    if options.dynamic_batching:
        # A batch of one needs no preference (it is what the queue delay falls back to); preferring it
        # would send every lone request at once and never wait for a larger batch.
        preferred = [_count(b, "manifest inputs.<input>.buckets", INT32_MAX) for b in layout.buckets
                     if 1 < b <= options.max_batch]
        config.dynamic_batching.preferred_batch_size.extend(preferred)
        config.dynamic_batching.max_queue_delay_microseconds = options.max_queue_delay_us
    group = mc.ModelInstanceGroup
    kind = group.KIND_GPU if options.kind == "gpu" else group.KIND_CPU
    config.instance_group.add(kind=kind, count=options.instances, gpus=list(options.gpus or ()))
    if options.env:
        config.parameters["EXECUTION_ENV_PATH"].string_value = options.env
    return config


def config_text(config: Any, bundle: BundleView) -> str:
    """The message in protobuf's text format (which escapes every string), under a comment whose bundle
    strings are made one line of printable text, so none of them can end the comment."""
    head = (f"# Written by `deepjit export triton` (DeepJIT {__version__}) for bundle {shown(bundle.name or '?')} "
            f"({shown(bundle.digest)}).\n# Edits are refused by the next export into this folder: export again "
            "instead.\n")
    return head + _text_format.MessageToString(config)


def model_py(bundle: BundleView) -> str:
    """The model.py Triton runs. Bundle strings go in only as Python literals (ascii(): quoted, escaped,
    printable ASCII), never into the docstring or code: a pulled bundle must not write code that runs."""
    return f'''"""Triton Python-backend model written by `deepjit export triton` (DeepJIT {__version__}).

Serves the DeepJIT bundle in {BUNDLE_DIR}/ beside this file (BUNDLE_NAME, bundle_digest). Each instance
verifies it, loads it once (KIND_GPU: on its GPU; KIND_CPU: on ONNX Runtime's CPU provider, as
`deepjit run --device cpu`) and answers batches. Its Python environment (config.pbtxt's
EXECUTION_ENV_PATH) needs DeepJIT and numpy < 2.
"""
from deepjit_compiler.serve.triton_model import DeepJITModel

BUNDLE_NAME = {ascii(bundle.name)}


class TritonPythonModel(DeepJITModel):
    bundle_digest = {ascii(bundle.digest)}
'''


# ----------------------------------------------------------------------------- the model folder
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _walk(folder: Path) -> list[str]:
    """Every file under `folder`, relative POSIX paths; ServeError at a link or anything not a plain file."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise ServeError(f"{folder}: '{rel}' is a link or not a plain file, which `deepjit export` never "
                                 "writes; refusing to replace the folder")
            if path.is_file():
                out.append(rel)
    return sorted(out)


def _pycache(rel: str, versions: Sequence[str]) -> bool:
    """Python's cached bytecode of a model.py export wrote (what Triton's loading it leaves beside it)."""
    parts = rel.split("/")
    return len(parts) == 3 and parts[0] in versions and parts[1] == "__pycache__" and \
        parts[2].startswith("model.") and parts[2].endswith(".pyc")


def check_model_dir(model_dir: Path) -> None:
    """Refuse (ServeError) unless `model_dir` is absent, empty, or exactly what an export wrote there."""
    if not model_dir.exists() and not model_dir.is_symlink():
        return
    if model_dir.is_symlink() or not model_dir.is_dir():
        raise ServeError(f"{model_dir}: exists and is not a folder; refusing to replace it")
    if not any(model_dir.iterdir()):
        return
    refuse = f"{model_dir}: holds files `deepjit export triton` did not write"
    try:
        marker = json.loads((model_dir / MARKER).read_text())
        files, bundles = dict(marker["files"]), [str(b) for b in marker["bundles"]]
    except FileNotFoundError:
        raise ServeError(f"{refuse} (no {MARKER}); refusing to replace it: choose another --name or "
                         "move it away") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ServeError(f"{refuse} ({MARKER} is not an export record: {e}); refusing to replace it") from None
    versions = [b.split("/")[0] for b in bundles]
    problems = []
    for rel in _walk(model_dir):
        if rel == MARKER or _pycache(rel, versions) or any(rel.startswith(b + "/") for b in bundles):
            continue
        if rel not in files:
            problems.append(f"'{rel}' is not one of its files")
        elif _sha256(model_dir / rel) != files[rel]:
            problems.append(f"'{rel}' was changed after the export")
    problems += [f"'{rel}' is missing" for rel in files if not (model_dir / rel).is_file()]
    for b in bundles:
        try:
            verify_folder(model_dir / b)
        except BundleError as e:
            problems.append(f"its bundle {b}/ does not verify ({str(e).splitlines()[-1].strip()})")
    if problems:
        raise ServeError(f"{refuse}: " + "; ".join(problems) + "; refusing to replace it: choose another --name "
                         "or move it away")


def _write(root: Path, bundle: BundleView, options: TritonOptions, config: str) -> dict[str, str]:
    """The model folder's files under `root`; {path: sha256} of those outside the bundle."""
    version = str(options.version)
    target = root / version / BUNDLE_DIR
    for rel in [*bundle.files, MANIFEST]:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle.root / rel, target / rel)
    verify_folder(target)  # the copy is the bundle, byte for byte
    written = {"config.pbtxt": config, f"{version}/model.py": model_py(bundle)}
    for rel, text in written.items():
        (root / rel).write_text(text, encoding="utf-8")  # as hashed below
    files = {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in written.items()}
    record = {"format": MARKER_FORMAT, "deepjit": __version__, "model": options.name, "version": options.version,
              "bundles": [f"{version}/{BUNDLE_DIR}"], "bundle_digest": bundle.digest, "files": files}
    (root / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return files


def export_triton(bundle: Path | str | BundleView, repo: Path | str,
                  options: TritonOptions = TritonOptions()) -> TritonExport:
    """Write `repo/<name>/` for the bundle (verified first); see the module docstring."""
    bundle = read_bundle(bundle)
    layout = Layout.from_bundle(bundle)
    options = checked_options(layout, bundle, options)
    config = config_text(model_config(layout, options), bundle)
    repo = Path(repo)
    if repo.exists() and not repo.is_dir():
        raise ServeError(f"{repo}: is not a folder; give the model repository's folder")
    model_dir = repo / options.name
    with output_lock(model_dir):
        check_model_dir(model_dir)
        with staging_dir(model_dir) as stage:
            root = stage / "model"
            try:
                _write(root, bundle, options, config)
            except OSError as e:
                raise cannot_write(model_dir, e) from None
            replace_dir(root, model_dir)
    log.info("wrote %s: %s version %d, %s instances, bundle %s", model_dir, options.name, options.version,
             options.kind, bundle.digest)
    return TritonExport(model_dir, options.name, options.version, bundle.digest, config,
                        box_mapping(layout) is not None)
