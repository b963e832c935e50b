"""Kernel contracts: what a JIT kernel needs, takes, makes and how it is launched (kernels/*.yaml).

A contract names its template, its params (types, defaults, allowed values, which kernel-site fact
supplies them), its tensors (dtypes and shapes as expressions of params and symbolic dims), its
entry points (C++ name expressions, launch geometry, typed args) and its scratch workspace. The
format is documented in docs/kernel-contracts.md; its pydantic models are in contract_models.py.

Every string in a contract that computes something is a Jinja expression, evaluated in a sandbox
with StrictUndefined: `4 * reg_max`, `ceil_div(A, block)`. It may also hold `{{ }}` / `{% %}`,
expanded first with the params (and `i` inside `repeat`), which is how a contract spells a name per
level (`box_{{ i }}`) or a sum over levels. A bare name that is neither a param nor a bound dim
(`B`, `A`, `H0`) is a symbolic dim, bound at launch from the tensors' actual shapes.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from ..config import data_dir
from ..errors import KernelError, RuntimeInputError, closest
from ..graph.tensors import TensorSig
from ..spec.locate import describe_errors
from ..spec.safeyaml import load_yaml, read_text
from .contract_models import ContractModel, Detections, ParamSpec
from .expressions import CTYPES, _repeats, _truthy, evaluate, expand


@dataclass(frozen=True, slots=True)
class Contract:
    """A loaded contract: its model, where it lives, and the files its template is made of."""

    model: ContractModel
    path: Path
    template_path: Path
    header_paths: tuple[Path, ...]

    @property
    def name(self) -> str:
        return self.model.name

    def digest(self) -> str:
        h = hashlib.sha256(self.path.read_bytes())
        for p in (self.template_path, *self.header_paths):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        return h.hexdigest()


def contract_file(name: str, folders: list[Path], what: str, owner: Path) -> Path:
    """A file a contract names: a relative path inside one of `folders` (its own folder, then DeepJIT's
    templates), never outside them, through a link neither. Errors print only the name: the file may be
    anything a hostile contract points at."""
    parts = PurePosixPath(name).parts
    if not name or name.startswith(("/", "~")) or "\\" in name or "\x00" in name or ".." in parts:
        raise KernelError(f"{owner}: {what} '{name}' must be a relative path inside the contract's folder or "
                          "DeepJIT's templates (no absolute path, no '..')")
    searched = list(dict.fromkeys(f.resolve() for f in folders))  # a built-in's own folder is DeepJIT's templates
    for folder in searched:
        candidate = folder / name
        if candidate.is_file():
            real = candidate.resolve()
            if not real.is_relative_to(folder):
                raise KernelError(f"{owner}: {what} '{name}' is a link out of {folder}; a contract reaches only its "
                                  "own folder and DeepJIT's templates")
            return real
        if candidate.exists():
            raise KernelError(f"{owner}: {what} '{name}' is not a file in {folder}; allowed: a file")
    raise KernelError(f"{owner}: {what} '{name}' not found in {', '.join(str(f) for f in searched)}")


def is_contract_path(ref: str) -> bool:
    """Whether load_contract reads `ref` as a path to a user's YAML (else it is a built-in's name)."""
    return ref.endswith((".yaml", ".yml")) or "/" in ref or "\\" in ref


def load_contract(ref: str, *, spec_dir: Path | None = None) -> Contract:
    """A contract by name (kernels/<name>.yaml) or by path (relative to spec_dir) to a user's YAML."""
    builtin = data_dir("kernels")
    if is_contract_path(ref):
        path = Path(ref) if Path(ref).is_absolute() or spec_dir is None else Path(spec_dir) / ref
    else:
        path = builtin / f"{ref}.yaml"
        if not path.is_file():
            names = sorted(p.stem for p in builtin.glob("*.yaml"))
            raise KernelError(f"unknown kernel contract '{ref}'{closest(ref, names)}; built-in: "
                              f"{', '.join(names)} (or give a path to your own .yaml)")
    text = read_text(path, KernelError, "kernel contract")
    model = _parse_contract(text, path)
    folders = [path.parent.resolve(), data_dir("templates")]
    template = contract_file(model.template, folders, "template", path)
    headers = tuple(contract_file(h, [template.parent, *folders], "header", path) for h in model.headers)
    return Contract(model, path.resolve(), template, headers)


@lru_cache(maxsize=64)
def _parse_contract(text: str, path: Path) -> ContractModel:
    """The validated model of a contract's text (parsed once per text: a build, its bundle and the
    runtime load the same few contracts many times). `path` only names the file in errors."""
    data, root = load_yaml(text, path, KernelError)
    if not isinstance(data, dict):
        raise KernelError(f"{path}:1:1: a contract is a mapping with keys {', '.join(ContractModel.model_fields)}")
    try:
        model = ContractModel.model_validate(data)
    except ValidationError as e:  # only now the node tree, for the file:line:col of each problem
        raise KernelError(describe_errors(e, path, root, ContractModel)) from None
    for name, spec in model.params.items():  # a default out of its own bounds was named only when a spec
        if spec.default is not None:         # left the param out, as if the spec had given it
            _check_param(name, spec, spec.default, f"{path}: params.{name}.default")
    return model


def _check_param(name: str, spec: ParamSpec, value: Any, where: str) -> Any:
    if spec.symbolic and isinstance(value, str):
        return value
    kinds = {"int": int, "float": (int, float), "bool": bool, "str": str, "list": (list, tuple)}
    ok = isinstance(value, kinds[spec.type]) and not (spec.type in ("int", "float") and isinstance(value, bool))
    if not ok:
        raise KernelError(f"{where}: param '{name}' must be {spec.type}, got {value!r}")
    if spec.allowed is not None and value not in spec.allowed:
        raise KernelError(f"{where}: param '{name}' must be one of {spec.allowed}, got {value!r}"
                          + closest(str(value), [str(a) for a in spec.allowed]))
    if spec.min is not None and value < spec.min or spec.max is not None and value > spec.max:
        raise KernelError(f"{where}: param '{name}' must be in [{spec.min}, {spec.max}], got {value!r}")
    return float(value) if spec.type == "float" else list(value) if spec.type == "list" else value


def _sym(value: Any, name: str) -> Any:
    """An int dim stays; anything else (None, 'height/8', 'batch') becomes the symbolic dim `name`."""
    return value if isinstance(value, int) and not isinstance(value, bool) else name


def normalize_facts(facts: Mapping[str, Any]) -> dict[str, Any]:
    """Kernel-site facts as surgery writes them (presets.py) -> the values contracts infer from:
    levels as [[H, W], ...] with symbolic sides named H{i}/W{i}, anchors an int or 'A',
    input_dtype from dtypes.head, input_size an int for a square input."""
    out = dict(facts)
    levels = facts.get("levels")
    if isinstance(levels, (list, tuple)):
        rows = []
        for i, lv in enumerate(levels):
            h, w = (lv.get("height"), lv.get("width")) if isinstance(lv, Mapping) else tuple(lv)
            rows.append([_sym(h, f"H{i}"), _sym(w, f"W{i}")])
        out["levels"] = rows
    if "anchors" in facts:
        out["anchors"] = _sym(facts["anchors"], "A")
    if "input_dtype" not in facts and isinstance(facts.get("dtypes"), Mapping):
        out["input_dtype"] = facts["dtypes"].get("head")
    size = facts.get("input_size")
    if isinstance(size, (list, tuple)):
        out["input_size"] = size[0] if len(set(size)) == 1 and isinstance(size[0], int) else None
    return out


def resolve_params(contract: Contract, given: Mapping[str, Any],
                   facts: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """Params for rendering: given > kernel-site fact > default, checked, plus the derived values."""
    model, facts, where = contract.model, normalize_facts(facts or {}), str(contract.path)
    unknown = sorted(set(given) - set(model.params))
    if unknown:
        raise KernelError(f"{where}: unknown param '{unknown[0]}'{closest(unknown[0], model.params)}; "
                          f"params: {', '.join(model.params)}")
    values: dict[str, Any] = {}
    for name, spec in model.params.items():
        if name in given:
            value = given[name]
            _check_agrees(name, spec, value, facts, where)
        elif spec.infer is not None and facts.get(spec.infer) is not None:
            value = facts[spec.infer]
        elif "default" in spec.model_fields_set:
            value = spec.default
        else:
            hint = f" (normally inferred from the kernel site's '{spec.infer}')" if spec.infer else ""
            raise KernelError(f"{where}: param '{name}' was neither given nor inferable{hint}: "
                              f"set it under the cut's kernels[].params")
        values[name] = _check_param(name, spec, value, where) if value is not None else None
    for name, expr in model.derived.items():
        values[name] = evaluate(expr, values, f"{where}: derived.{name}")
    return MappingProxyType(values)


def _check_agrees(name: str, spec: ParamSpec, value: Any, facts: Mapping[str, Any], where: str) -> None:
    """A given param that the kernel site also tells (its `infer` fact, when concrete) must agree with
    it, unless the contract marks it overridable: a kernel built for another value reads the model's
    tensors wrong (an 80-class decode on an 18-class head)."""
    fact = facts.get(spec.infer) if spec.infer is not None and not spec.overridable else None
    if fact is None or _symbolic(fact) or value is None:
        return
    if _check_param(name, spec, value, where) != _check_param(name, spec, fact, where):
        raise KernelError(f"{where}: param '{name}' is given as {value!r}, but the kernel site has {fact!r} "
                          f"(its '{spec.infer}', found in the model): remove '{name}' from the cut's params or "
                          f"set it to {fact!r}")


def _symbolic(value: Any) -> bool:
    """Whether a fact holds a symbolic dim (a string) anywhere: then it is no concrete value to agree with."""
    if isinstance(value, str):
        return True
    return isinstance(value, (list, tuple)) and any(_symbolic(v) for v in value)


def done_before(contract: Contract, params: Mapping[str, Any]) -> bool:
    """Whether the kernel before this one in its chain does this one's work (the bool param its
    roles.done_before.when names is true): then it has no tensors, launches or workspace of its own."""
    done = contract.model.roles.done_before
    return bool(done and params.get(done.when))


def signature(contract: Contract, params: Mapping[str, Any]) -> tuple[TensorSig, ...]:
    """Inputs then outputs, with dtypes resolved and shapes as far as the params allow."""
    if done_before(contract, params):
        return ()
    out, seen = [], {}
    for role, specs in (("input", contract.model.inputs), ("output", contract.model.outputs)):
        for k, spec in enumerate(specs):
            where = f"{contract.path}: {role}s[{k}]"
            for ctx in _repeats(spec, params, where):
                name, dtype = expand(spec.name, ctx, f"{where}.name"), evaluate(spec.dtype, ctx, f"{where}.dtype")
                _check_tensor_name(name, seen, where)
                seen[name] = f"{role}s[{k}]"
                if not isinstance(dtype, str) or dtype not in CTYPES:  # a list's `in` raised a bare TypeError
                    raise KernelError(f"{where}: dtype must be one of {', '.join(CTYPES)}, got {dtype!r}")
                shape = tuple(evaluate(d, ctx, f"{where}.shape") for d in spec.shape)
                out.append(TensorSig(name, dtype, shape, role, spec.zero_init))
    return tuple(out)


def _check_tensor_name(name: str, seen: Mapping[str, str], where: str) -> None:
    """A kernel's tensors bind by name: a second tensor of one name took the first one's buffer, and one
    named `workspace` the scratch buffer's (the arg of that name), silently."""
    if name == "workspace":
        raise KernelError(f"{where}.name: 'workspace' names the kernel's scratch buffer (the `workspace:` size, "
                          "the arg of that name); allowed: another name")
    if name in seen:
        raise KernelError(f"{where}.name: '{name}' is already the name of {seen[name]}; allowed: one tensor a name")


def site_inputs(contract: Contract, params: Mapping[str, Any]) -> dict[str, int]:
    """{input name: position among the kernel site's inputs} for the inputs that declare `site_input`;
    the others read the pipeline tensor of their own name."""
    out = {}
    for k, spec in enumerate(contract.model.inputs):
        if spec.site_input is None:
            continue
        where = f"{contract.path}: inputs[{k}]"
        for ctx in _repeats(spec, params, where):
            pos = evaluate(spec.site_input, ctx, f"{where}.site_input")
            if not isinstance(pos, int) or isinstance(pos, bool) or pos < 0:
                raise KernelError(f"{where}.site_input: must be a position (an int >= 0), got {pos!r}")
            out[expand(spec.name, ctx, f"{where}.name")] = pos
    return out


@dataclass(frozen=True, slots=True)
class DetectionOutputs:
    """Outputs a kernel declares as detections (roles.detections) and the confidence threshold it cut
    them at (its roles.score_threshold param; None when it declares none)."""

    declared: Detections
    threshold: float | None = None

    @property
    def names(self) -> tuple[str, str, str, str]:
        return self.declared.names

    @property
    def count(self) -> str:
        return self.declared.count


def score_threshold(contract: Contract, params: Mapping[str, Any]) -> float | None:
    """The value of the param the contract's roles.score_threshold names: given, else its default."""
    name = contract.model.roles.score_threshold
    if name is None:
        return None
    value = params.get(name, contract.model.params[name].default)
    return None if value is None else float(value)


def detection_outputs(contract: Contract, params: Mapping[str, Any]) -> DetectionOutputs | None:
    """The detection outputs of a kernel with these params, or None if its contract declares none."""
    declared = contract.model.roles.detections
    return None if declared is None else DetectionOutputs(declared, score_threshold(contract, params))


def declared_detections(kernels: Iterable[tuple[str, Mapping[str, Any]]],
                        spec_dir: Path | None = None) -> tuple[DetectionOutputs, ...]:
    """The detection outputs the kernels `(contract name or path, params)` declare (roles.detections)."""
    found = (detection_outputs(load_contract(str(ref), spec_dir=spec_dir), params) for ref, params in kernels)
    return tuple(d for d in found if d is not None)


def image_channels(contract: Contract, params: Mapping[str, Any]) -> str:
    """'bgr' or 'rgb': the channel order the contract's image input reads (roles.image_input)."""
    role = contract.model.roles.image_input
    order = evaluate(role.channels, params, f"{contract.path}: roles.image_input.channels")
    if order not in ("bgr", "rgb"):
        raise KernelError(f"{contract.path}: roles.image_input.channels must give 'bgr' or 'rgb', got {order!r}")
    return order


def bind_dims(contract: Contract, params: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
              extra: Mapping[str, int] | None = None) -> Mapping[str, int]:
    """Symbolic dims from the actual input shapes (and `extra`), then the contract's `dims:` section.
    A shape that contradicts the contract is a RuntimeInputError naming the tensor and the dim."""
    dims: dict[str, int] = dict(extra or {})
    if done_before(contract, params):
        return MappingProxyType(dims)
    origin = {name: "extra dims" for name in dims}
    sigs = [s for s in signature(contract, params) if s.role == "input"]
    for sig in sigs:
        if sig.name not in shapes:
            raise RuntimeInputError(f"kernel {contract.name}: input '{sig.name}' is missing; "
                                    f"inputs: {', '.join(s.name for s in sigs)}")
        actual = tuple(int(d) for d in shapes[sig.name])
        if len(actual) != len(sig.shape):
            raise RuntimeInputError(f"kernel {contract.name}: input '{sig.name}' has shape {actual}, "
                                    f"expected rank {len(sig.shape)} {sig.shape}")
        for axis, (want, got) in enumerate(zip(sig.shape, actual)):
            if isinstance(want, str) and want.isidentifier() and want not in params:
                if want not in dims:
                    origin[want] = f"input '{sig.name}' dim {axis}"
                want = dims.setdefault(want, got)
            if isinstance(want, int) and want != got:
                raise RuntimeInputError(f"kernel {contract.name}: input '{sig.name}' dim {axis} is {got}, "
                                        f"expected {want} (shape {sig.shape})")
    ctx = {**params, **dims}
    for name, expr in contract.model.dims.items():
        value = evaluate(expr, ctx, f"{contract.path}: dims.{name}")
        if name in dims and dims[name] != value:
            raise RuntimeInputError(f"kernel {contract.name}: dim {name} is {dims[name]} from {origin[name]}, "
                                    f"but the contract makes it {value} ({expand(expr, ctx)})")
        dims[name] = ctx[name] = int(value)
    for sig in sigs:  # expressions over dims (e.g. 4 + nc, H0 * W0) are checked once all are bound
        want = concrete_shape(sig, params, dims, f"kernel {contract.name}: input '{sig.name}'")
        if want != tuple(int(d) for d in shapes[sig.name]):
            raise RuntimeInputError(f"kernel {contract.name}: input '{sig.name}' has shape "
                                    f"{tuple(shapes[sig.name])}, expected {want}")
    return MappingProxyType(dims)


def concrete_shape(sig: TensorSig, params: Mapping[str, Any], dims: Mapping[str, int],
                   where: str = "") -> tuple[int, ...]:
    """A tensor's shape with every symbolic dim bound."""
    shape = tuple(evaluate(d, {**params, **dims}, where or sig.name) for d in sig.shape)
    unbound = [d for d in shape if not isinstance(d, int)]
    if unbound:
        raise RuntimeInputError(f"{where or f'tensor {sig.name!r}'}: dims {unbound} are not bound by the inputs")
    return shape


@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch: which symbol, its geometry and its typed args (name, type, value)."""

    entry: str
    symbol: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    args: tuple[tuple[str, str, Any], ...]
    overlap: bool = False  # the entry's overlaps_previous


def _number(expr, ctx, where) -> int:
    """An expression that must give a number (a grid, block, shared_mem or workspace size), as an int. A
    bare name that is neither a param nor a bound dim comes back from `evaluate` as that name, and a str
    param as its text: int() of those raised ValueError (exit 3). A float must be whole: int() truncated
    `N / 256` to fewer blocks than the data needs, and raised on NaN or infinity (exit 3)."""
    value = evaluate(expr, ctx, where)
    if isinstance(value, float) and not value.is_integer():
        raise KernelError(f"{where}: {expr!r} gives {value!r}, not a whole number; allowed: an int expression of "
                          "the contract's params and bound dims (ceil_div(a, b) rounds a division up)")
    if not isinstance(value, (int, float)):
        bare = isinstance(value, str) and value == str(expr).strip()
        what = (f"'{value}' is neither a param nor a bound dim{closest(value, ctx)}" if bare
                else f"{expr!r} gives {value!r}, not a number")
        raise KernelError(f"{where}: {what}; allowed: an int expression of the contract's params and bound dims")
    return int(value)


def _dim3(values, ctx, where) -> tuple[int, int, int]:
    """1 to 3 ints, padded with 1s; whether CUDA launches them is geometry.check_launch's to say (it knows
    the batch and the SM)."""
    vals = [_number(v, ctx, where) for v in values]
    if not 1 <= len(vals) <= 3:
        raise KernelError(f"{where}: need 1 to 3 ints, got {vals}")
    return tuple(vals + [1] * (3 - len(vals)))  # type: ignore[return-value]


def entry_symbols(contract: Contract, params: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """(entry name, C++ name expression) of the entry points that `when` selects; an entry's from_batch
    instantiation, where it applies and differs, as '<name> (batch <at>+)'."""
    if done_before(contract, params):
        return ()
    out = []
    for e, at, large in _selected_entries(contract, params):
        where = f"{contract.path}: entry_points[{e.name}].symbol"
        out.append((e.name, expand(e.symbol, params, where)))
        if at is not None and (symbol := expand(e.symbol, large, where)) != out[-1][1]:
            out.append((f"{e.name} (batch {at}+)", symbol))
    if not out:
        raise KernelError(f"{contract.path}: no entry point applies to params {dict(params)}")
    return tuple(out)


def _selected_entries(contract: Contract, params: Mapping[str, Any]):
    """The entry points whose `when` holds for params, each with its from_batch (at, params; _from_batch)."""
    for k, e in enumerate(contract.model.entry_points):
        where = f"{contract.path}: entry_points[{k}]"
        if _truthy(e.when, params, f"{where}.when"):
            yield (e, *_from_batch(e, contract.model.params, params, where))


def _from_batch(entry, specs: Mapping[str, ParamSpec], params: Mapping[str, Any],
                where: str) -> tuple[int | None, Mapping[str, Any]]:
    """An entry's from_batch: its first batch and the params it launches with from there (None and the
    params themselves where it has none, its `when` is false, or it changes no param). Each value is
    checked as its param is (type, allowed, min, max): the large-batch kernel takes it as that param."""
    fb = entry.from_batch
    if fb is None or not _truthy(fb.when, params, f"{where}.from_batch.when"):
        return None, params
    at = evaluate(fb.at, params, f"{where}.from_batch.at")
    if not isinstance(at, int) or isinstance(at, bool) or at < 1:
        raise KernelError(f"{where}.from_batch.at: need a batch of at least 1, got {at!r}")
    large = {n: _check_param(n, specs[n], evaluate(v, params, f"{where}.from_batch.params.{n}"),
                             f"{where}.from_batch.params.{n}") for n, v in fb.params.items()}
    if all(params.get(n) == v for n, v in large.items()):
        return None, params
    return at, {**params, **large}


def batch_thresholds(contract: Contract, params: Mapping[str, Any]) -> tuple[int, ...]:
    """The batches from which some entry point launches another kernel (its from_batch), ascending: between
    two of them (and below the first) every batch launches the same kernels."""
    if done_before(contract, params):
        return ()
    return tuple(sorted({at for _, at, _ in _selected_entries(contract, params) if at is not None}))


def launches(contract: Contract, params: Mapping[str, Any], dims: Mapping[str, int],
             values: Mapping[str, Any]) -> tuple[Launch, ...]:
    """The launches for bound dims; `values` maps tensor/workspace names to device pointers."""
    if done_before(contract, params):
        return ()
    return tuple(_launch(entry, _args(entry, values)) for entry in _launched(contract, params, dims))


@dataclass(frozen=True, slots=True)
class _Launched:
    """An entry point that launches at some dims: where it is in the contract, and the params (its
    from_batch's from that batch on) and context (params and dims) its expressions see."""

    where: str
    entry: Any
    params: Mapping[str, Any]
    ctx: Mapping[str, Any]


def _launched(contract: Contract, params: Mapping[str, Any], dims: Mapping[str, int]):
    """The entry points whose `when` holds at these dims, in order."""
    for k, e in enumerate(contract.model.entry_points):
        where = f"{contract.path}: entry_points[{k}]"
        if not _truthy(e.when, {**params, **dims}, f"{where}.when"):
            continue
        at, large = _from_batch(e, contract.model.params, params, where)
        if at is not None and not isinstance(dims.get("B"), int):
            raise KernelError(f"{where}.from_batch: the launch has no batch dim B bound")
        eparams = large if at is not None and dims["B"] >= at else params
        yield _Launched(where, e, eparams, {**eparams, **dims})


def _launch(it: _Launched, args: tuple[tuple[str, str, Any], ...]) -> Launch:
    e, where, ctx = it.entry, it.where, it.ctx
    return Launch(e.name, expand(e.symbol, it.params, f"{where}.symbol"), _dim3(e.grid, ctx, f"{where}.grid"),
                  _dim3(e.block, ctx, f"{where}.block"), _number(e.shared_mem, ctx, f"{where}.shared_mem"),
                  args, e.overlaps_previous)


def _args(it: _Launched, values: Mapping[str, Any]) -> tuple[tuple[str, str, Any], ...]:
    """An entry's typed args: its `value:` expression, else the tensor, dim or param of its name."""
    where, out = it.where, []
    for j, a in enumerate(it.entry.args):
        for actx in _repeats(a, it.ctx, f"{where}.args[{j}]"):
            name = expand(a.name, actx, f"{where}.args[{j}].name")
            if a.value is not None:
                value = evaluate(a.value, {**actx, **values}, f"{where}.args[{j}].value")
            elif name in values:
                value = values[name]
            elif name in actx:
                value = actx[name]
            else:
                raise KernelError(f"{where}.args[{j}]: no tensor, dim or param named '{name}'"
                                  f"{closest(name, [*values, *actx])}")
            out.append((name, a.type, value))
    return tuple(out)


def workspace_bytes(contract: Contract, params: Mapping[str, Any], dims: Mapping[str, int]) -> int:
    if done_before(contract, params):
        return 0
    size = _number(contract.model.workspace, {**params, **dims}, f"{contract.path}: workspace")
    if size < 0:  # it passed the build and failed when the bundle loaded, as a manifest tampered with
        raise KernelError(f"{contract.path}: workspace: {contract.model.workspace!r} gives {size} bytes at {dict(dims)}; "
                          "allowed: 0 or more")
    return size
