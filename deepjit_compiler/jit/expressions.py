"""The expression language of kernel contracts: Jinja expressions in a sandbox, StrictUndefined.

`4 * reg_max`, `ceil_div(A, block)`: a string may also hold `{{ }}` / `{% %}`, expanded first with the
params (and `i` inside `repeat`). A bare name that is neither a param nor a bound dim is a symbolic
dim, bound at launch from the tensors' actual shapes."""
from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import KernelError, closest

CTYPES = {"float32": "float", "float16": "__half", "int32": "int", "uint8": "unsigned char",
          "int64": "long long", "uint32": "unsigned int"}


# ---------------------------------------------------------------------------------------------
# Expressions

def _ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _is_static(value: Any) -> bool:
    """True when every leaf of a (nested) list is an int: no symbolic dims."""
    if isinstance(value, (list, tuple)):
        return all(_is_static(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


_GLOBALS = {"is_static": _is_static, "ceil_div": _ceil_div, "pow2ceil": _pow2ceil, "min": min, "max": max, "len": len, "sum": sum,
            "prod": math.prod, "int": int, "float": float, "ctype": lambda d: CTYPES[d]}


@lru_cache(maxsize=1)
def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
    env.globals.update(_GLOBALS)
    return env


@lru_cache(maxsize=4096)
def _compiled(text: str):
    """Compiled once per expression text: launch plans evaluate the same few expressions often."""
    return _env().compile_expression(text, undefined_to_none=False)


@lru_cache(maxsize=4096)
def _template(text: str) -> jinja2.Template:
    return _env().from_string(text)


def expand(text: Any, ctx: Mapping[str, Any]) -> Any:
    """Expand `{{ }}` / `{% %}` in a contract string with ctx; non-strings pass through."""
    if not isinstance(text, str) or ("{{" not in text and "{%" not in text):
        return text
    return _template(text).render(**ctx).strip()


@lru_cache(maxsize=4096)
def undeclared(expr: str) -> frozenset[str]:
    """Names an expression uses that are not Jinja globals."""
    return frozenset(meta.find_undeclared_variables(_env().parse("{{ " + expr + " }}")) - set(_GLOBALS))


def evaluate(expr: Any, ctx: Mapping[str, Any], where: str) -> Any:
    """Value of a contract expression. A bare unknown name is a symbolic dim and comes back as str."""
    text = expand(expr, ctx)
    if not isinstance(text, str):
        return text
    text = text.strip()
    try:
        missing = undeclared(text) - set(ctx)
    except jinja2.TemplateSyntaxError as e:
        raise KernelError(f"{where}: bad expression {text!r}: {e.message}") from None
    if missing:
        if text.isidentifier():
            return text
        raise KernelError(f"{where}: {text!r} uses {', '.join(sorted(missing))}, which are neither params "
                          f"nor bound dims{closest(sorted(missing)[0], ctx)}")
    try:
        return _compiled(text)(**ctx)
    except Exception as e:  # the expression is user input: any failure is the contract's fault
        raise KernelError(f"{where}: cannot evaluate {text!r}: {e}") from None


def _truthy(when: str | None, ctx: Mapping[str, Any], where: str) -> bool:
    return True if when is None else bool(evaluate(when, ctx, where))


def _repeats(item, ctx: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """Contexts for each repetition of an item (`i` set when `repeat` is given)."""
    if not _truthy(item.when, ctx, f"{where}.when"):
        return []
    if item.repeat is None:
        return [dict(ctx)]
    n = evaluate(item.repeat, ctx, f"{where}.repeat")
    if not isinstance(n, int):
        raise KernelError(f"{where}.repeat: must be an int once params are known, got {n!r}")
    return [{**ctx, "i": i} for i in range(n)]
