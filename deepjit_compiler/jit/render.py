"""Rendering kernel templates: the one jinja2 Environment (StrictUndefined), params in, CUDA out.

Every rendered line remembers the template file and line it came from, so NVRTC's errors can be
reported against the template the user wrote, not the generated source (see `KernelSource.origin`).
"""
from __future__ import annotations

import hashlib
import logging
import re
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.exceptions import SecurityError

from ..config import data_dir
from ..errors import KernelError, closest
from .bounds import deadline, memory_bound
from .contracts import Contract, contract_file, entry_symbols, load_contract, resolve_params
from .sandbox import BoundedSandbox

log = logging.getLogger("deepjit.render")

_MARK = re.compile(r"/\*@@(\d+):(\d+)@@\*/")

# Bounds on one render. The sandbox bounds each `range`, `*` and `**`, not loops nested in each other:
# a template from a pulled bundle could otherwise print until memory ends, loop silently for hours, or
# build ever larger strings it never prints. Real kernels render to well under 1 MB in milliseconds.
MAX_SOURCE_CHARS = 1 << 24
RENDER_SECONDS = 30.0
RENDER_BYTES = 1 << 30


class _LineMarks(jinja2.ext.Extension):
    """Appends /*@@file:line@@*/ to each template line that can emit text; render() strips them
    and keeps, for each output line, where it came from (a loop's lines map to the loop body)."""

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        environment.extend(deepjit_files=[])

    def preprocess(self, source: str, name: str | None, filename: str | None = None) -> str:
        files: list[str] = self.environment.deepjit_files  # type: ignore[attr-defined]
        where = filename or name or "<template>"
        if where not in files:
            files.append(where)
        fid = files.index(where)
        out = []
        for n, line in enumerate(source.split("\n"), 1):
            body = line.rstrip()
            if not body or body.endswith(("%}", "#}")):
                out.append(line)
            elif body.endswith("\\"):  # a macro continuation: the mark goes before the backslash
                out.append(f"{body[:-1]}/*@@{fid}:{n}@@*/\\")
            else:
                out.append(f"{body}/*@@{fid}:{n}@@*/")
        return "\n".join(out)


def f32_literal(value: float) -> str:
    """The float32 nearest `value` as an exact C++17 hex literal (comment shows the decimal)."""
    with np.errstate(over="ignore"):  # an overflow is refused below, not printed as numpy's warning
        v = float(np.float32(value))
    if not np.isfinite(v):
        raise KernelError(f"kernel param {value!r} is not a finite float32")
    return f"{v.hex()}f /* {np.float32(v)} */"


class _ContractLoader(jinja2.BaseLoader):
    """Loads the template and what it includes, imports or extends through contracts.contract_file, so each
    name is confined as the template and headers are: a relative path inside the contract's folder or
    DeepJIT's templates, no link out of them (FileSystemLoader follows links anywhere)."""

    def __init__(self, folders: tuple[str, ...], owner: str):
        self.folders, self.owner = [Path(f) for f in folders], Path(owner)

    def get_source(self, environment: jinja2.Environment, template: str):
        path = contract_file(template, self.folders, "template include", self.owner)
        mtime = path.stat().st_mtime
        return path.read_text(encoding="utf-8"), str(path), lambda: _mtime(path) == mtime


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


@lru_cache(maxsize=16)
def environment(search_path: tuple[str, ...], owner: str) -> jinja2.Environment:
    """The template environment for a contract (`owner`, named in errors) and its search path (its
    folder, then templates/). It is Jinja's immutable sandbox with `*` and `**` bounded: templates come
    from users and from pulled bundles, so one must not reach Python (`cycler.__init__.__globals__`,
    attributes starting with '_'), change its params, or exhaust memory."""
    env = BoundedSandbox(loader=_ContractLoader(search_path, owner), undefined=jinja2.StrictUndefined,
                         trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False,
                         extensions=[_LineMarks])
    env.filters["f32"] = f32_literal
    return env


@dataclass(frozen=True, slots=True)
class KernelSource:
    """A rendered kernel: the code NVRTC compiles, the headers it includes, and its provenance."""

    contract: str
    filename: str                                   # the name NVRTC reports errors under
    code: str
    symbols: tuple[tuple[str, str], ...]            # (entry point, C++ name expression)
    headers: tuple[tuple[str, str], ...]            # (include name, text)
    origin_files: tuple[str, ...]
    line_origin: tuple[tuple[int, int], ...]        # per rendered line: (file index, line) or (-1, 0)
    params: Mapping[str, Any] = field(default_factory=dict)
    contract_digest: str = ""

    def digest(self) -> str:
        """sha256 over what NVRTC sees: code, headers, name expressions."""
        h = hashlib.sha256(self.code.encode())
        for name, text in self.headers:
            h.update(b"\0h" + name.encode() + b"\0" + text.encode())
        for entry, sym in self.symbols:
            h.update(b"\0s" + entry.encode() + b"\0" + sym.encode())
        return h.hexdigest()

    def header_digest(self) -> str:
        return hashlib.sha256(b"".join(n.encode() + b"\0" + t.encode() + b"\0" for n, t in self.headers)).hexdigest()

    def origin(self, line: int) -> tuple[str, int] | None:
        """(template file, template line) of rendered line `line` (1-based), if known."""
        if 1 <= line <= len(self.line_origin):
            fid, n = self.line_origin[line - 1]
            if fid >= 0:
                return self.origin_files[fid], n
        return None

    def excerpt(self, line: int, context: int = 3) -> str:
        """Rendered lines around `line`, numbered, the line itself marked with '>'."""
        lines = self.code.splitlines()
        lo, hi = max(1, line - context), min(len(lines), line + context)
        return "\n".join(f"{'>' if n == line else ' '}{n:5d} | {lines[n - 1]}" for n in range(lo, hi + 1))


def _strip_marks(text: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    lines, origin = [], []
    for raw in text.split("\n"):
        m = _MARK.search(raw)
        origin.append((int(m.group(1)), int(m.group(2))) if m else (-1, 0))
        lines.append(_MARK.sub("", raw))
    return "\n".join(lines), tuple(origin)


def _template_line(exc: BaseException, template: Path) -> int | None:
    """The template line a Jinja runtime error happened on (Jinja rewrites tracebacks to it)."""
    line = getattr(exc, "lineno", None)
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).name == template.name:
            line = frame.lineno
    return line


def _render_error(e: Exception, contract: Contract, params: Mapping[str, Any]) -> KernelError:
    """A template's failure as a KernelError at its file:line, the original message kept."""
    if isinstance(e, jinja2.TemplateSyntaxError):
        return KernelError(f"{e.filename or contract.template_path}:{e.lineno}: template syntax error: {e.message}")
    line = _template_line(e, contract.template_path)  # none for a bound the whole render broke
    where = f"{contract.template_path}" + (f":{line}" if line is not None else "")
    if isinstance(e, jinja2.UndefinedError):
        missing = re.findall(r"'([^']+)' is undefined", str(e))
        hint = closest(missing[0], params) if missing else ""
        return KernelError(f"{where}: {e.message}{hint}; the template sees the params {', '.join(params)} "
                           f"of {contract.path}")
    if isinstance(e, SecurityError):
        return KernelError(f"{where}: the template tried an unsafe operation ({e}); templates render in "
                           "Jinja's sandbox: params, filters and plain expressions only")
    if isinstance(e, (jinja2.TemplateError, KernelError)):  # KernelError: a filter's, or an include refused
        return KernelError(f"{where}: {e}")
    return KernelError(f"{where}: rendering the template of {contract.path} failed: {type(e).__name__}: {e}")


def _bounded_render(env: jinja2.Environment, name: str, context: Mapping[str, Any]) -> str:
    """The template's text, refused past MAX_SOURCE_CHARS or RENDER_SECONDS (OverflowError, TimeoutError).
    Loading it is bounded too: compiling folds constants (`[1]|slice(1000000000000000)|max` ran for days)."""
    parts, size = [], 0
    with deadline(RENDER_SECONDS, "the template renders"):
        for chunk in env.get_template(name).generate(**context):
            size += len(chunk)
            if size > MAX_SOURCE_CHARS:
                raise OverflowError(f"the template renders more than {MAX_SOURCE_CHARS} characters; the sandbox "
                                    "refuses it")
            parts.append(chunk)
    return "".join(parts)


def render(contract: Contract, params: Mapping[str, Any]) -> KernelSource:
    """Render a contract's template with resolved params (see contracts.resolve_params)."""
    search = (str(contract.template_path.parent), str(data_dir("templates")))
    env = environment(search, str(contract.path))
    name = contract.template_path.name
    try:
        with memory_bound(RENDER_BYTES, "the template"):
            text = _bounded_render(env, name, {**params, "contract_name": contract.name})
    except Exception as e:  # the template is user input: any failure is its fault (exit 2), not DeepJIT's bug
        raise _render_error(e, contract, params) from None
    code, origin = _strip_marks(text)
    headers = tuple((p.name, p.read_text(encoding="utf-8")) for p in contract.header_paths)
    files = tuple(env.deepjit_files)  # type: ignore[attr-defined]
    source = KernelSource(contract.name, name.removesuffix(".j2"), code, entry_symbols(contract, params), headers,
                          files, origin, MappingProxyType(dict(params)), contract.digest())
    log.debug("rendered %s: %d lines, symbols %s", contract.name, code.count("\n"), [s for _, s in source.symbols])
    return source


def render_kernel(contract_ref: str, params: Mapping[str, Any], facts: Mapping[str, Any] | None = None, *,
                  spec_dir: Path | None = None) -> tuple[Contract, KernelSource]:
    """Load a contract (name or path), resolve params from the spec and the site's facts, render."""
    contract = load_contract(contract_ref, spec_dir=spec_dir)
    return contract, render(contract, resolve_params(contract, params, facts))
