"""YAML as DeepJIT reads it (specs, kernel contracts, a bundle's spec): safe_load only, and bounded.

A spec is a few kilobytes; a hostile one must fail at once, not after minutes and gigabytes. So a
document is refused past MAX_BYTES, past MAX_NODES nodes once its aliases are expanded (the "billion
laughs" alias bomb composes small and expands to billions), past MAX_DEPTH levels of nesting, with a
recursive alias, or with a key given twice in one mapping (which would otherwise silently keep the
last). Each refusal names the file, line and column.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20
MAX_NODES = 100_000
MAX_DEPTH = 64
_MERGE = "tag:yaml.org,2002:merge"


def _where(path: Path, node: yaml.Node) -> str:
    return f"{path}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


def read_text(path: Path, error: type[Exception], what: str) -> str:
    """The file's text, refused (as `error`) past MAX_BYTES, missing or unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise error(f"{path}: {what} is larger than {MAX_BYTES // 1024} KiB; refused")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _check(root: yaml.Node, path: Path, error: type[Exception]) -> None:
    """Expanded size, depth, recursion and duplicate keys, without expanding anything."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise error(f"{_where(path, node)}: nested deeper than {MAX_DEPTH} levels; refused")
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise error(f"{_where(path, node)}: a recursive alias; refused")
        active.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE:
                    if k.value in seen:
                        raise error(f"{_where(path, k)}: key '{k.value}' is given twice in this mapping "
                                    f"(first at line {seen[k.value].start_mark.line + 1}); give it once")
                    seen[k.value] = k
                total += size(k, depth + 1) + size(v, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(size(v, depth + 1) for v in node.value)
        if total > MAX_NODES:
            raise error(f"{_where(path, node)}: expands to more than {MAX_NODES} nodes (aliases included); refused")
        active.discard(key)
        sizes[key] = total
        return total

    size(root, 0)


def load_yaml(text: str, path: Path, error: type[Exception]) -> tuple[Any, yaml.Node | None]:
    """(the document as plain data, its node tree for locating later errors); `error` names the problem
    with file:line:col. Only plain YAML: no Python tags."""
    if len(text.encode()) > MAX_BYTES:
        raise error(f"{path}: larger than {MAX_BYTES // 1024} KiB; refused")
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, None
        _check(root, path, error)
        return loader.construct_document(root), root
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise error(f"{where}: YAML error: {e.problem or e.context}"
                    + (" (only plain YAML is allowed: no Python tags)" if "python" in str(e) else "")) from None
    except yaml.YAMLError as e:
        raise error(f"{path}: YAML error: {e}") from None
    finally:
        loader.dispose()
