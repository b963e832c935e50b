"""Human-readable output of the CLI (rich tables on stdout); `--json` bypasses this module."""
from __future__ import annotations

import io
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.filesize import decimal as human_size
from rich.table import Table
from rich.text import Text

from .bundle.folder import read_bundle
from .bundle.view import BundleView
from .engines import TENSORRT, TENSORRT_RTX
from .engines.tensorrt import parse_network
from .errors import BundleError, DeepJITError
from .graph.serialize import model_bytes
from .model.info import describe_model, load_model
from .spec.models import LEVELS
from .surgery.cut import plan_from_model
from .surgery.plan import CutRequest
from .surgery.suggest import format_suggestions
from .surgery.suggest import suggest_cuts as find

SHOWN_SUGGESTIONS = 5  # format_suggestions' default
PIPED_WIDTH = 200  # columns of a table written to a file or a pipe: tensor names and digests stay whole


def _console(file=None) -> Console:
    """A console for stdout (or `file`): the terminal's width on a TTY, PIPED_WIDTH otherwise. No markup:
    what it prints comes from manifests, models and stores (a pulled bundle's name may hold `[red]` or an
    unmatched `[/x]`); the few styles are Text spans."""
    tty = (file if file is not None else sys.stdout).isatty()
    return Console(file=file, highlight=False, soft_wrap=True, markup=False, width=None if tty else PIPED_WIDTH)


def print_build(result) -> None:
    d = result.to_dict()
    spec = result.spec.spec
    out = _console()
    model = d["model"]
    out.print(Text.assemble((d["name"], "bold"), f": target {d['target']['gpu'] or ''} sm_{d['target']['sm']}"))
    out.print(f"model {model['path']} (sha256 {model['sha256'][:12]}…"
              + (", synthesized" if model["synthesized"] else "") + ")")
    _print_steps(out, "pipeline, in run order", [
        (st, ", ".join(st.get("kernels", [])) or _engine_text(d["engine"], spec.engine.precision))
        for st in d["plan"] or []])
    for line in d["notes"]:
        out.print(line)
    if d["cached"]:
        out.print(f"cached: {', '.join(d['cached'])} (nothing they read changed since an earlier build)")
    for p in (d["engine"] or {}).get("plans", []):
        made = "from the plan cache" if p["from_cache"] else f"built in {p['build_seconds']:.1f} s"
        out.print(f"plan {p['segment']}: {p['flavour']} {p['version']} for compute capability "
                  f"{', '.join(p['compute_capabilities'])}, {p['size'] / 1e6:.1f} MB, {p['network_layers']} network "
                  f"layers, {made}")
    for stage, ks in d["kernels"].items():
        for k in ks:
            out.print(f"kernel {stage}/{k['contract']}: {k['arch']} cubin + {k['ptx_arch']} PTX, NVRTC {k['nvrtc_version']}"
                      f"{' (compile cache hit)' if k['from_cache'] else ''}")
    if d["plan"] is not None and not d["kernels"] and d["bundle"] is None:
        out.print("dry run: nothing built")
        return
    levels = Table(title="validation")
    for col in ("level", "status", "detail"):
        levels.add_column(col)
    style = {"passed": "green", "failed": "bold red", "not_run": "yellow"}
    for name, lv in d["validation"]["levels"].items():
        levels.add_row(name, Text(lv["status"], style=style[lv["status"]]), _outputs_detail(lv))
    out.print(levels)
    if d["bundle"]:
        where = "REJECTED, written to" if d["rejected"] else "bundle"
        out.print(f"{where} {d['bundle']['path']} ({d['bundle']['digest']})")
    if d["published"]:
        out.print(f"published {d['published']['ref']}")


def _engine_text(engine: Mapping[str, Any] | None, precision: str) -> str:
    if engine is None:
        return f"engine ({precision})"
    if engine["deferred"]:
        return f"{engine['backend']} {precision}, plan deferred\n(ONNX Runtime here)"
    return f"{engine['backend']} {precision}"


_STATISTIC = {"elemwise": "per element", "max": "on the max", "mean": "on the mean", "median": "on the median"}


def _figures(o: Mapping[str, Any]) -> str:
    """An output's record in a line; a field an older bundle's record lacks reads as 0."""
    if o.get("detail"):
        return o["detail"]
    f = {k: o.get(k, 0) for k in ("max_abs", "median_abs", "max_rel", "median_rel")}
    return (f"max abs {f['max_abs']:.3g} (median {f['median_abs']:.3g}), "
            f"max rel {f['max_rel']:.3g} (median {f['median_rel']:.3g}), {'passed' if o.get('passed') else 'FAILED'}")


def _rule(t: Mapping[str, Any]) -> str:
    """The rule an output was held to, from its record (Polygraphy's semantics: a value passes when its
    abs error is within atol or its rel error within rtol; detections are scored as sets)."""
    if "check_error_stat" in t:
        return f"gate: abs <= {t['atol']:g} or rel <= {t['rtol']:g}, {_STATISTIC[t['check_error_stat']]}"
    if t.get("bit_identical"):
        return "gate: bit for bit"
    return "gate: " + ", ".join(k if v is True else f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in sorted(t.items()) if v is not None)  # a cached record's order


@dataclass(frozen=True)
class Inspection:
    data: dict[str, Any]
    text: str


def inspect_target(target: Path, *, suggest_cuts: bool = False) -> Inspection:
    """A bundle (folder with manifest.json, or .tar.gz) or an ONNX model."""
    if target.is_dir() or target.name.endswith(".tar.gz"):  # a folder can only be a bundle
        if suggest_cuts:  # a bundle's steps are cut already, and it may not carry the model
            raise BundleError(f"{target}: --suggest-cuts finds cuts in an ONNX model, and this is a bundle: give "
                              "the model it was built from")
        data = describe(read_bundle(target))
        return Inspection(data, _render_bundle(data))

    model = load_model(target)
    data = describe_model(model).to_dict()
    text = _render_model(target, data)
    if suggest_cuts:
        found = find(model)
        layers = wall_layers(model, found[:SHOWN_SUGGESTIONS])
        counted = layers["cuts"] if layers else []  # the suggestions shown are counted
        data["suggested_cuts"] = [s.to_dict() | ({"network_layers": counted[i]} if i < len(counted) else {})
                                  for i, s in enumerate(found)]
        data["network_layers"] = None if layers is None else {"parser": layers["parser"], "model": layers["model"]}
        text += ("\nsuggested cuts (the small-kernel wall, largest first):\n"
                 + format_suggestions(found, SHOWN_SUGGESTIONS, _layer_notes(layers)) + "\n" + _model_layers(layers))
    return Inspection(data, text)


def wall_layers(model, suggestions) -> dict[str, Any] | None:
    """The small-kernel wall in the builder's own terms: the network layers TensorRT's (else
    TensorRT-RTX's) ONNX parser makes of the whole model, and of the engine segments left when each
    suggested cut is made (fp32: a precision rewrite adds its casts). None without either parser."""
    parser = next((f for f in (TENSORRT, TENSORRT_RTX) if f.importable()), None)
    if parser is None:
        return None
    whole = parse_network(model_bytes(model), parser)["layers"]
    cuts = []
    for s in suggestions:
        cut = CutRequest("wall", preset=s.preset) if s.preset else CutRequest("wall", inputs=s.inputs, outputs=s.outputs)
        try:
            segments = [st for st in plan_from_model(model, [cut]).steps if st.kind == "segment"]
            left = sum(parse_network(model_bytes(st.model), parser, label=f"segment {st.name}")["layers"]
                       for st in segments)
        except DeepJITError as e:
            cuts.append({"model": whole, "segments": None, "removed": None, "error": str(e)})
            continue
        cuts.append({"model": whole, "segments": left, "removed": whole - left})
    return {"parser": f"{parser.module_name} {parser.version()}", "model": whole, "cuts": cuts}


def _layer_notes(layers: dict[str, Any] | None) -> list[str]:
    if layers is None:
        return []
    return [f"network layers: {c['model']} -> {c['segments']} ({c['removed']} fewer) with this cut"
            if c["segments"] is not None else f"network layers: not counted ({c['error']})" for c in layers["cuts"]]


def _model_layers(layers: dict[str, Any] | None) -> str:
    if layers is None:
        return ("network layers: not counted (no TensorRT or TensorRT-RTX ONNX parser is importable here; "
                "install deepjit[tensorrt-rtx])")
    return (f"network layers, as the {layers['parser']} ONNX parser makes them: the whole model {layers['model']}, "
            "the engine segments left by each cut above (fp32; a precision rewrite adds its casts)")


def _render_model(path: Path, d: dict[str, Any]) -> str:
    buf = io.StringIO()
    out = _console(buf)
    out.print(Text.assemble((str(path), "bold"), f": opset {d['opset']}, IR {d['ir_version']}, "
              f"{d['node_count']} nodes, {d['parameter_count']:,} parameters"))
    for kind in ("inputs", "outputs"):
        for t in d[kind]:
            out.print(f"  {kind[:-1]:6} {t['name']}: {t['dtype']} {t['shape']}")
    ops = Table(title="op histogram")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, n in d["ops"].items():
        ops.add_row(op, str(n))
    out.print(ops)
    return buf.getvalue()


def _print_steps(out: Console, title: str, steps: list[tuple[Mapping[str, Any], str]]) -> None:
    """Each step (with what it runs on) as a heading and a line per tensor, not a table: tensor names are
    long and whole, and in a table of any width they squeezed the step's own name and number away."""
    out.print(title)
    for n, (st, runs) in enumerate(steps, 1):
        kind = st["kind"] + (f", {st['position']}" if st.get("position") else "")
        out.print(Text.assemble(f"{n}. ", (st["name"], "bold"), f" ({kind}): " + runs.replace("\n", "; ")))
        for label, sigs in (("in ", st["inputs"]), ("out", st["outputs"])):
            for i, t in enumerate(sigs):
                out.print(f"     {label if i == 0 else '   '} {t['name']} {t['dtype']} {t['shape']}")


def _entries(entries: Mapping[str, str]) -> str:
    """A kernel's C++ entry points, each under its entry's name where there are several (a from_batch kernel,
    'decode (batch 4+)', beside the entry's own)."""
    if len(entries) <= 1:
        return "\n".join(entries.values())
    return "\n".join(f"{name}: {symbol}" for name, symbol in entries.items())


def _params(params: Mapping[str, Any]) -> str:
    return "\n".join(f"{k}={v}" for k, v in params.items())


def _outputs_detail(level: Mapping[str, Any]) -> str:
    """A level's reason, then each output's figures and the rule it was held to (build and inspect)."""
    lines = [str(level.get("reason") or "")]
    for name, o in (level.get("outputs") or {}).items():
        lines.append(f"{name}: {_figures(o)}" + (f"; {_rule(o['tolerance'])}" if o.get("tolerance") else ""))
    return "\n".join(line for line in lines if line)


def _render_bundle(d: dict[str, Any]) -> str:
    buf = io.StringIO()
    out = _console(buf)
    target = d["target"]
    out.print(Text.assemble((d["name"], "bold"), f" {d['digest']}"))
    out.print(f"target: {target['gpu'] or ''} sm_{target['sm']}".replace(":  ", ": "))
    out.print("toolchain: " + ", ".join(f"{k} {v}" for k, v in d["toolchain"].items()))
    out.print(f"spec sha256 {d['spec_sha256']}; model sha256 {d['model_sha256']} "
              + (f"(in the bundle: {d['reference_model']})" if d["reference_model"] else "(not in the bundle)"))
    for i in d["inputs"]:
        out.print(f"input {i['name']}: {i['dtype']} {i['shape']}, profile min {i['min']} opt {i['opt']} "
                  f"max {i['max']}, graph buckets {i['buckets']}")
    _print_steps(out, "steps, in run order", [(st, _runs_on(st)) for st in d["steps"]])
    _render_engine(out, d["engine"])
    kernels = Table(title="kernels")
    for col in ("step", "contract", "binaries", "entry points", "params"):
        kernels.add_column(col)
    for st in d["steps"]:
        for k in st.get("kernels", ()):
            kernels.add_row(st["name"], k["contract"], f"{k['arch']} cubin ({human_size(k['cubin_size'])})\n"
                            f"{k['ptx_arch']} PTX ({human_size(k['ptx_size'])}), NVRTC {k['nvrtc_version']}",
                            _entries(k["entries"]), _params(k["params"]))
    out.print(kernels)
    levels = Table(title="validation")
    for col in ("level", "status", "detail"):
        levels.add_column(col)
    for name, lv in d["validation"].items():
        levels.add_row(name, lv["status"], _outputs_detail(lv))
    out.print(levels)
    files = Table(title=f"files ({len(d['files'])}, {human_size(d['total_size'])})")
    files.add_column("path")
    files.add_column("size", justify="right")
    for f in d["files"]:
        files.add_row(f["path"], human_size(f["size"]))
    out.print(files)
    return buf.getvalue()


def _level_order(name: str) -> tuple[int, str]:
    return (LEVELS.index(name) if name in LEVELS else len(LEVELS), name)


def _runs_on(step: Mapping[str, Any]) -> str:
    if step["kind"] != "segment":
        return "\n".join(f"{k['contract']} ({k['arch']})" for k in step.get("kernels", ()))
    e = step["engine"]
    plans = ", ".join(e["plans"])
    return (f"{e['backend']} {e['precision']}: " + (f"plan {plans}" if plans else "plan deferred to the target")
            + f"\nsegment {', '.join(e['files'])}")


def engine_summary(b: BundleView) -> dict[str, Any]:
    """How the bundle's segments run: the backend decision and why, and each segment's ONNX and plans
    (flavour, library version, compute capabilities, size, network layers, I/O tensors)."""
    e = b.engine
    segments = {}
    for name in dict.fromkeys([*e.segments, *e.plans]):
        plans = [{"file": p.file, "flavour": p.flavour, "library": p.library, "version": p.version,
                  "compute_capabilities": list(p.compute_capabilities),
                  "size": (b.files.get(p.file) or {}).get("size"), "network_layers": p.network_layers,
                  "inputs": [dict(t) for t in p.inputs], "outputs": [dict(t) for t in p.outputs],
                  "profiles": dict(p.profiles)} for p in e.plans.get(name, ())]
        segments[name] = {"onnx": list(e.segments.get(name, ())), "plans": plans}
    return {"backend": e.backend, "deferred": e.deferred, "reason": e.reason, "precision": e.precision,
            "segments": segments}


def describe(bundle: BundleView | Path) -> dict[str, Any]:
    """A JSON-ready summary for `deepjit inspect BUNDLE`, from the typed view: target, toolchain, spec
    and model hashes, inputs, the steps with their engine or kernels (arch, cubin and PTX, params),
    the validation record with its figures, and the files with their sizes."""
    b = read_bundle(bundle)
    files = [{"path": rel, "size": e["size"], "sha256": e["sha256"]} for rel, e in sorted(b.files.items())]
    size = {f["path"]: f["size"] for f in files}
    engine = b.engine

    def kernel(k) -> dict[str, Any]:
        e = k.entry
        return {"contract": k.contract, "arch": e.get("arch"), "ptx_arch": e.get("ptx_arch"),
                "nvrtc_version": e.get("nvrtc_version"), "entries": dict(e.get("entries") or {}),
                "params": dict(k.params), "files": dict(k.files),
                "cubin_size": size.get(k.files.get("cubin", ""), 0), "ptx_size": size.get(k.files.get("ptx", ""), 0)}

    steps = []
    for st in b.steps:
        entry: dict[str, Any] = {"name": st.name, "kind": st.kind, "inputs": [t.to_dict() for t in st.inputs],
                                 "outputs": [t.to_dict() for t in st.outputs], "file": st.file}
        if st.kind == "segment":
            entry["engine"] = {"backend": engine.backend, "precision": engine.precision, "deferred": engine.deferred,
                               "files": list(engine.segments.get(st.name, (st.file,))),
                               "plans": list(engine.plan_files(st.name))}
        else:
            entry["kernels"] = [kernel(k) for k in st.kernels]
            entry["position"] = st.position
        steps.append(entry)
    model = b.manifest.get("model") if isinstance(b.manifest.get("model"), Mapping) else {}
    return {
        "path": str(b.source), "name": b.name, "digest": b.digest, "schema_version": b.manifest["schema_version"],
        "target": {"gpu": b.target_gpu, "sm": b.target_sm}, "toolchain": dict(b.toolchain),
        "spec_sha256": b.spec_sha256, "model_sha256": b.model_sha256,
        "reference_model": model.get("file") if model.get("file") in b.files else None,
        "inputs": [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape), "min": list(i.min),
                    "opt": list(i.opt), "max": list(i.max), "buckets": list(i.buckets)} for i in b.inputs],
        "engine": engine_summary(b),
        "steps": steps,
        "validation": {name: dict(b.levels[name]) for name in sorted(b.levels, key=_level_order)
                       if isinstance(b.levels[name], Mapping)},
        "files": files,
        "total_size": sum(f["size"] for f in files),
    }


def _render_engine(out: Console, e: dict[str, Any]) -> None:
    """The bundle's engine: backend and why, then per segment its ONNX and each plan's flavour,
    library version, compute capabilities, size, network layers and I/O tensors."""
    out.print(Text.assemble(("engine", "bold"), f": {e['backend']}{' (deferred)' if e['deferred'] else ''}, "
                            f"{e['precision']}: {e['reason']}"))
    for name, seg in e["segments"].items():
        out.print(f"  segment {name}: {', '.join(seg['onnx']) or 'no ONNX'}")
        for p in seg["plans"]:
            size = f"{p['size'] / 1e6:.1f} MB" if p["size"] is not None else "size unknown"
            ccs = ", ".join(p["compute_capabilities"]) or "?"
            layers = f", {p['network_layers']} network layers" if p["network_layers"] is not None else ""
            out.print(f"    plan {p['file']}: {p['flavour']} ({p['library']} {p['version']}), compute capability "
                      f"{ccs}, {size}{layers}")
            for kind in ("inputs", "outputs"):
                for t in p[kind]:
                    out.print(f"      {kind[:-1]:6} {t['name']}: {t['dtype']} {t['shape']}")
            for inp, prof in p["profiles"].items():
                out.print(f"      profile {inp}: min {prof['min']}, opt {prof['opt']}, max {prof['max']}")


def validation_summary(levels: Mapping[str, str]) -> str:
    """'graph, precision passed; kernels not run' from {level: status}; what failed comes first."""
    if not levels:
        return "unknown"
    order = {"failed": "FAILED", "passed": "passed", "not_run": "not run"}
    parts = [f"{', '.join(n for n, st in levels.items() if st == status)} {word}" for status, word in order.items()
             if status in levels.values()]
    other = [f"{n} {st}" for n, st in levels.items() if st not in order]
    return "; ".join(parts + other)


def format_store(url: str, entries) -> str:
    """`deepjit ls`: one row per tag, sizes for humans, whether the bundle passed validation."""
    if not entries:
        return f"no tags in {url}\n"
    table = Table(title=url)
    for col in ("tag", "bundle", "validation", "size", "digest"):
        table.add_column(col, justify="right" if col == "size" else "left", overflow="fold")
    for e in entries:
        table.add_row(e.tag, e.name or "", validation_summary(e.levels), human_size(e.size) if e.size else "",
                      e.digest)
    buf = io.StringIO()
    _console(buf).print(table)
    return buf.getvalue()
