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

from .bundle.folder import read_bundle
from .bundle.view import BundleView
from .model.info import describe_model, load_model
from .surgery.suggest import format_suggestions
from .surgery.suggest import suggest_cuts as find

PIPED_WIDTH = 200  # columns of a table written to a file or a pipe: tensor names and digests stay whole


def _console(file=None) -> Console:
    """A console for stdout (or `file`): the terminal's width on a TTY, PIPED_WIDTH otherwise."""
    tty = (file if file is not None else sys.stdout).isatty()
    return Console(file=file, highlight=False, soft_wrap=True, width=None if tty else PIPED_WIDTH)


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
            detail += f"\n{out_name}: " + (o["detail"] or f"max abs {o['max_abs']:.3g}, median abs {o['median_abs']:.3g}")
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
        data["suggested_cuts"] = [s.to_dict() for s in found]
        text += "\nsuggested cuts (the small-kernel wall, largest first):\n" + format_suggestions(found)
    return Inspection(data, text)


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
        if isinstance(value, (dict, list)):
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
        "validation": {lvl: rec.get("status", "unknown") if isinstance(rec, dict) else "unknown"
                       for lvl, rec in sorted(levels.items())},
    }


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
