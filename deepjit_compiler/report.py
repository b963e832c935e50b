"""Human-readable output of the CLI (rich tables on stdout); `--json` bypasses this module."""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .bundle.folder import read_bundle
from .bundle.view import BundleView
from .engines import TENSORRT, TENSORRT_RTX
from .engines.tensorrt import parse_network
from .errors import DeepJITError
from .graph.serialize import model_bytes
from .model.info import describe_model, load_model
from .surgery.cut import plan_from_model
from .surgery.plan import CutRequest
from .surgery.suggest import format_suggestions
from .surgery.suggest import suggest_cuts as find

SHOWN_SUGGESTIONS = 5  # format_suggestions' default


def _console(file=None) -> Console:
    return Console(file=file, highlight=False, soft_wrap=True)


def print_build(result) -> None:
    d = result.to_dict()
    out = _console()
    model = d["model"]
    out.print(f"[bold]{d['name']}[/bold]: target {d['target']['gpu'] or ''} sm_{d['target']['sm']}")
    out.print(f"model {model['path']} (sha256 {model['sha256'][:12]}…"
              + (", synthesized" if model["synthesized"] else "") + ")")
    steps = Table(title="pipeline, in run order")
    for col in ("#", "step", "kind", "inputs -> outputs", "runs on"):
        steps.add_column(col)
    for i, st in enumerate(d["plan"] or [], 1):
        runs = ", ".join(st.get("kernels", [])) or (d["engine"] or {}).get("backend", "engine")
        steps.add_row(str(i), st["name"], st["kind"], f"{len(st['inputs'])} -> {', '.join(t['name'] for t in st['outputs'])}",
                      runs)
    out.print(steps)
    for line in d["notes"]:
        out.print(line)
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
        detail = lv.get("reason", "")
        for out_name, o in lv.get("outputs", {}).items():
            detail += f"\n{out_name}: " + (o["detail"] or f"max abs {o['max_abs']:.3g}, median abs "
                                                       f"{o['median_abs']:.3g}, mean abs {o['mean_abs']:.3g}")
            if o["tolerance"]:  # what it was judged by, so a pass says how strict it was
                detail += "\n  tolerance: " + ", ".join(k if v is True else f"{k} {v:g}" if isinstance(v, float)
                                                       else f"{k} {v}" for k, v in o["tolerance"].items())
        levels.add_row(name, f"[{style[lv['status']]}]{lv['status']}[/]", detail.strip())
    out.print(levels)
    if d["bundle"]:
        where = "REJECTED, written to" if d["rejected"] else "bundle"
        out.print(f"{where} {d['bundle']['path']} ({d['bundle']['digest']})")
    if d["published"]:
        out.print(f"published {d['published']['ref']}")


@dataclass(frozen=True)
class Inspection:
    data: dict[str, Any]
    text: str


def inspect_target(target: Path, *, suggest_cuts: bool = False) -> Inspection:
    """A bundle (folder with manifest.json, or .tar.gz) or an ONNX model."""
    if (target / "manifest.json").exists() or target.name.endswith(".tar.gz"):
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
    out.print(f"[bold]{path}[/bold]: opset {d['opset']}, IR {d['ir_version']}, "
              f"{d['node_count']} nodes, {d['parameter_count']:,} parameters")
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


def _render_bundle(d: dict[str, Any]) -> str:
    buf = io.StringIO()
    out = _console(buf)
    for key, value in d.items():
        if key == "engine":
            _render_engine(out, value)
        elif isinstance(value, (dict, list)):
            out.print(f"[bold]{key}[/bold]:")
            out.print(value)
        else:
            out.print(f"[bold]{key}[/bold]: {value}")
    return buf.getvalue()


def _summary(value: Any) -> Any:
    """Long texts (rendered sources, logs) shortened for display."""
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_summary(v) for v in value]
    if isinstance(value, str) and (len(value) > 160 or "\n" in value):
        return f"<{len(value)} characters>"
    return value


def _entries(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [_summary({"name": k, **v}) if isinstance(v, dict) else _summary({"name": k, "value": v})
                for k, v in value.items()]
    return _summary(list(value)) if isinstance(value, list) else []


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
    """A JSON-ready summary for `deepjit inspect BUNDLE`: name, digest, target, toolchain, spec and
    model hashes, files (path, size, sha256), kernels, engines and validation level statuses."""
    b = read_bundle(bundle)
    m = b.manifest
    files = [{"path": rel, "size": e["size"], "sha256": e["sha256"]} for rel, e in sorted(b.files.items())]
    validation = m.get("validation") if isinstance(m.get("validation"), dict) else {}
    levels = validation.get("levels") if isinstance(validation.get("levels"), dict) else {}
    return {
        "path": str(b.source),
        "name": m.get("name"),
        "digest": m["digest"],
        "schema_version": m["schema_version"],
        "target": _summary(m.get("target")),
        "toolchain": _summary(m.get("toolchain")),
        "spec_sha256": (m.get("spec") or {}).get("sha256") if isinstance(m.get("spec"), dict) else None,
        "model_sha256": (m.get("model") or {}).get("sha256") if isinstance(m.get("model"), dict) else None,
        "files": files,
        "total_size": sum(f["size"] for f in files),
        "kernels": _entries(m.get("kernels")),
        "engines": _entries(m.get("engines")),
        "engine": engine_summary(b),
        "validation": {lvl: rec.get("status", "unknown") if isinstance(rec, dict) else "unknown"
                       for lvl, rec in sorted(levels.items())},
    }


def _render_engine(out: Console, e: dict[str, Any]) -> None:
    """The bundle's engine: backend and why, then per segment its ONNX and each plan's flavour,
    library version, compute capabilities, size, network layers and I/O tensors."""
    out.print(f"[bold]engine[/bold]: {e['backend']}{' (deferred)' if e['deferred'] else ''}, {e['precision']}: "
              f"{e['reason']}")
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
