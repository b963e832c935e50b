"""Turn pydantic validation errors into `file:line:col: field: problem (did you mean ...?)` lines."""
from __future__ import annotations

import re
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import closest


def _child(node: yaml.Node | None, part) -> tuple[yaml.Node | None, yaml.Node | None]:
    """(key node, value node) of `part` inside a YAML mapping or sequence node."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == str(part):
                return key, value
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part], node.value[part]
    return None, None


def _locate(root: yaml.Node, loc: tuple) -> tuple[yaml.Node, list]:
    """The deepest YAML node along `loc`, and the loc parts that exist in the document."""
    node, found = root, []
    for part in loc:
        key, value = _child(node, part)
        if key is None:
            continue  # pydantic adds union/validator tags to loc that the YAML does not have
        found.append(part)
        node = value if value is not None else key
        last_key = key
    return (last_key if found else root), found


def _model_at(cls: type, loc: list) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at `loc` (for suggesting valid names)."""
    current: typing.Any = cls
    for part in loc:
        model = _as_model(current)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            current = model.model_fields[part].annotation
        elif isinstance(part, (int, str)):
            args = [a for a in typing.get_args(current) if a is not type(None)]
            current = args[-1] if args else None
        if current is None:
            return None
    return _as_model(current)


def _as_model(tp) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _explain(err: dict, parent_model: type[BaseModel] | None) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        name = str(err["loc"][-1])
        allowed = list(parent_model.model_fields) if parent_model else []
        return f"unknown key '{name}'{closest(name, allowed)}" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    if kind == "missing":
        return f"required key '{err['loc'][-1]}' is missing"
    if kind in ("literal_error", "enum"):
        choices = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        return f"{msg}, got {err.get('input')!r}{closest(str(err.get('input')), choices)}"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    field = parent_model.model_fields.get(str(err["loc"][-1])) if parent_model else None
    if kind == "string_pattern_mismatch" and field is not None and field.description:
        return f"should be {field.description}, got {err.get('input')!r}"  # the rule in words, not its regex
    return f"{msg}, got {err.get('input')!r}" if "input" in err and not isinstance(err["input"], dict) else msg


def describe_errors(error: ValidationError, path: Path, root: yaml.Node, spec_cls: type[BaseModel]) -> str:
    """One line per problem, each naming file, line, column and the dotted field."""
    lines = []
    for err in error.errors():
        loc = tuple(err["loc"])
        is_key_error = err["type"] == "extra_forbidden"
        node, found = _locate(root, loc)
        field = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in found).replace(".[", "[") or "(top level)"
        parent = _model_at(spec_cls, found[:-1]) if is_key_error or len(found) == len(loc) else None
        mark = node.start_mark
        lines.append(f"{path}:{mark.line + 1}:{mark.column + 1}: {field}: {_explain(err, parent)}")
    return "\n".join(dict.fromkeys(lines))
