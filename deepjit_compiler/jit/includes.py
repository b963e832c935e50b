"""What NVRTC may read besides the rendered kernel: the contract's headers (passed in memory, part of
the cache key) and CUDA's headers by <name> on the include path DeepJIT passes. NVRTC itself would open
any file an #include names (a quoted name in the working folder first) and put it in the PTX, unseen by
the cache key, so the kernel text and the spec's options are checked before it runs."""
from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Iterator, Sequence
from pathlib import PurePosixPath

from ..errors import KernelError
from ..spec.models import FILE_OPTIONS
from .render import KernelSource

# What could make NVRTC open a file: '#', spaces or comments, then `include`/`import` (or a UCN that might
# spell them), and __has_include. Matched over the whole text, strings and comments too: a false alarm
# refuses a kernel, a miss would read any file into the PTX behind the cache key's back.
_DIRECTIVE = re.compile(r"#(?:\s|/\*.*?\*/)*(?:include|import|\\[uU])|__has_include", re.DOTALL)
_PLAIN_INCLUDE = re.compile(r'[ \t]*#[ \t]*include[ \t]*("[^"\n]*"|<[^>\n]*>)[ \t]*(?://[^\n]*)?')
_SPLICE = re.compile(r"\\[ \t]*\n")


def _preprocessor_view(text: str) -> tuple[str, list[int]]:
    """`text` as the preprocessor finds directives in it (lines spliced, '??/', '??=' and '%:' spelled
    plainly), and where each splice was, to count lines. Replacements after the split keep lengths."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("??/", "\\")
    pieces = _SPLICE.split(text)
    joined = "".join(pieces).replace("??=", "#  ").replace("%:", "# ")
    return joined, list(itertools.accumulate(len(p) for p in pieces))[:-1]


def _includes(text: str) -> Iterator[tuple[int, str | None]]:
    """(line, target) of each include-like directive in `text`; target is '"name"' or '<name>' for a plain
    `#include` alone on its line (a trailing // comment allowed), None for any other form."""
    view, splices = _preprocessor_view(text)
    for m in _DIRECTIVE.finditer(view):
        start = view.rfind("\n", 0, m.start()) + 1
        end = view.find("\n", m.start())
        plain = _PLAIN_INCLUDE.fullmatch(view[start:end if end >= 0 else len(view)])
        line = 1 + view.count("\n", 0, m.start()) + bisect.bisect_right(splices, m.start())
        yield line, plain.group(1) if plain and view.find("#", start) == m.start() else None


def _include_refusal(target: str | None, declared: set[str]) -> str | None:
    """Why NVRTC must not see this include (None: it may). NVRTC looks a quoted name up in the working
    directory, and an angled one only on the include path DeepJIT passes (CUDA's headers)."""
    if target is None:
        return ('only a plain #include "header" or #include <header> is allowed (no macro, comment, '
                "#import or __has_include)")
    name = target[1:-1]
    if name in declared:
        return None
    if target.startswith('"'):
        return "it is not one of the contract's `headers:` (include CUDA's own headers as <name>)"
    if not name or name.startswith("/") or "\\" in name or ":" in name or ".." in PurePosixPath(name).parts:
        return "a CUDA header is a relative name on the CUDA include path (no absolute path, no '..')"
    return None


def check_includes(source: KernelSource, contract_path: str = "") -> None:
    """Refuse, before NVRTC runs, any include other than the contract's headers (passed in memory, part of
    the cache key) and CUDA's headers by <name>: NVRTC would read any other file from disk."""
    declared = {name for name, _ in source.headers}
    for file, text in ((source.filename, source.code), *source.headers):
        for line, target in _includes(text):
            why = _include_refusal(target, declared)
            if why:
                origin = source.origin(line) if file == source.filename else None
                where = f"{origin[0]}:{origin[1]}" if origin else f"{file}:{line}"
                raise KernelError(f"{contract_path or source.contract}: kernel '{source.contract}' includes "
                                  f"{target or 'a file'} at {where}: {why}")


def check_options(extra: Sequence[str], source: KernelSource, contract_path: str = "") -> None:
    """The spec's extra options may not widen what NVRTC reads (check_includes assumes CUDA's path only)
    nor make it write files."""
    for opt in extra:
        if opt.strip().startswith(FILE_OPTIONS):
            raise KernelError(f"{contract_path or source.contract}: compile option {opt!r} is not allowed: kernel "
                              "headers come from the contract's `headers:` and CUDA's include path only, and a "
                              "compile writes no files")
