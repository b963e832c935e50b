"""YAML as DeepJIT reads it (specs, kernel contracts, a bundle's spec): safe_load only, and bounded.

A spec is a few kilobytes; a hostile one must fail at once, not after minutes and gigabytes. So a
document is refused past MAX_BYTES, past MAX_NODES nodes once its aliases are expanded (the "billion
laughs" alias bomb composes small and expands to billions), past MAX_DEPTH levels of nesting (checked
as it is composed, and again with aliases expanded), with a recursive alias, or with a key given twice
in one mapping (which would otherwise silently keep the last). Each refusal names the file, line and
column.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..files import open_regular

MAX_BYTES = 1 << 20
MAX_NODES = 100_000
MAX_DEPTH = 64
_MERGE = "tag:yaml.org,2002:merge"


def _where(path: Path, node: yaml.Node) -> str:
    return f"{path}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


def read_text(path: Path, error: type[Exception], what: str) -> str:
    """The file's text, refused (as `error`) past MAX_BYTES, missing or unreadable."""
    try:
        with open_regular(path) as f:  # a FIFO is refused at once, not waited on
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


class _TooDeep(Exception):
    """Where the composer stopped; load_yaml turns it into the caller's error type."""

    def __init__(self, mark: yaml.Mark):
        self.mark = mark


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses nesting past MAX_DEPTH as it goes: PyYAML's composer
    recurses once per level, so `[[[[...` thousands deep would hit Python's recursion limit before
    `_check` ever sees the tree. Depth here counts like `_check` (the root is level 0)."""

    _depth = -1

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _too_deep(where: str, how: str = "") -> str:
    return f"{where}: nested deeper than {MAX_DEPTH} levels{how}; refused"


def _check(root: yaml.Node, path: Path, error: type[Exception]) -> None:
    """Expanded size, depth, recursion and duplicate keys, without expanding anything."""
    # node -> (nodes it expands to, levels below it): an alias reuses its anchor's node, so a node met
    # again deeper down is checked from the memo (else chained aliases nest thousands deep).
    seen_nodes: dict[int, tuple[int, int]] = {}
    active: set[int] = set()

    def size(node: yaml.Node, depth: int) -> tuple[int, int]:
        key = id(node)
        if depth + seen_nodes.get(key, (0, 0))[1] > MAX_DEPTH:
            raise error(_too_deep(_where(path, node), " once its aliases are expanded" if key in seen_nodes else ""))
        if key in seen_nodes:
            return seen_nodes[key]
        if key in active:
            raise error(f"{_where(path, node)}: a recursive alias; refused")
        active.add(key)
        below = [size(child, depth + 1) for child in _children(node, path, error)]
        total, height = 1 + sum(t for t, _ in below), max((h + 1 for _, h in below), default=0)
        if total > MAX_NODES:
            raise error(f"{_where(path, node)}: expands to more than {MAX_NODES} nodes (aliases included); refused")
        active.discard(key)
        seen_nodes[key] = total, height
        return total, height

    size(root, 0)


def _children(node: yaml.Node, path: Path, error: type[Exception]) -> list[yaml.Node]:
    """A collection's keys and values (refusing a key given twice in one mapping); a scalar has none."""
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if not isinstance(node, yaml.MappingNode):
        return []
    seen: dict[Any, yaml.Node] = {}
    for k, _ in node.value:
        if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE:
            if k.value in seen:
                raise error(f"{_where(path, k)}: key '{k.value}' is given twice in this mapping "
                            f"(first at line {seen[k.value].start_mark.line + 1}); give it once")
            seen[k.value] = k
    return [n for pair in node.value for n in pair]


def load_yaml(text: str, path: Path, error: type[Exception]) -> tuple[Any, yaml.Node | None]:
    """(the document as plain data, its node tree for locating later errors); `error` names the problem
    with file:line:col. Only plain YAML: no Python tags."""
    if len(text.encode()) > MAX_BYTES:
        raise error(f"{path}: larger than {MAX_BYTES // 1024} KiB; refused")
    loader = _BoundedLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, None
        _check(root, path, error)
        return loader.construct_document(root), root
    except _TooDeep as e:
        raise error(_too_deep(f"{path}:{e.mark.line + 1}:{e.mark.column + 1}")) from None
    except RecursionError:  # a path through PyYAML that recurses and that the bound above misses
        raise error(_too_deep(str(path))) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise error(f"{where}: YAML error: {e.problem or e.context}"
                    + (" (only plain YAML is allowed: no Python tags)" if "python" in str(e) else "")) from None
    except yaml.YAMLError as e:
        raise error(f"{path}: YAML error: {e}") from None
    finally:
        loader.dispose()
