"""The expression language of kernel contracts: Jinja expressions in a sandbox, StrictUndefined.

`4 * reg_max`, `ceil_div(A, block)`: a string may also hold `{{ }}` / `{% %}`, expanded first with the
params (and `i` inside `repeat`). A bare name that is neither a param nor a bound dim is a symbolic
dim, bound at launch from the tensors' actual shapes."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import MAX_RANGE

from ..errors import KernelError, closest
from .bounds import deadline, memory_bound
from .sandbox import BoundedSandbox, bounded_prod, bounded_sum, check_division, check_result, is_int

CTYPES = {"float32": "float", "float16": "__half", "int32": "int", "uint8": "unsigned char",
          "int64": "long long", "uint32": "unsigned int"}


# ---------------------------------------------------------------------------------------------
# Expressions

def _ceil_div(a: int, b: int) -> int:
    check_division(int(a), int(b))
    return -(-int(a) // int(b))


def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _is_static(value: Any) -> bool:
    """True when every leaf of a (nested) list is an int: no symbolic dims."""
    if isinstance(value, (list, tuple)):
        return all(_is_static(v) for v in value)
    return is_int(value)


_GLOBALS = {"is_static": _is_static, "ceil_div": _ceil_div, "pow2ceil": _pow2ceil, "min": min, "max": max, "len": len, "sum": bounded_sum,
            "prod": bounded_prod, "int": int, "float": float, "ctype": lambda d: CTYPES[d]}


EXPRESSION_BYTES = 1 << 30  # memory one expression may take: `list` of a long `map` is bounded by nothing else
MAX_EXPANDED = 1 << 16     # characters a contract string may expand to
EXPRESSION_SECONDS = 30.0   # time one expression or contract string may take: filters loop too (`[1]|slice(10**15)|max`)


@contextlib.contextmanager
def _bounded() -> Iterator[None]:
    """The memory and time one expression, or one contract string's expansion, may take."""
    with memory_bound(EXPRESSION_BYTES, "the expression"), deadline(EXPRESSION_SECONDS, "the expression runs"):
        yield


def _undefined_in(value: Any) -> jinja2.Undefined | None:
    """The first Undefined in a (nested) result: an unsafe attribute (`f.__code__`) evaluates to one."""
    if isinstance(value, jinja2.Undefined):
        return value
    if isinstance(value, (list, tuple)):
        return next((u for u in map(_undefined_in, value) if u is not None), None)
    if isinstance(value, dict):
        return _undefined_in(list(value.values()))
    return None


@lru_cache(maxsize=1)
def _env() -> BoundedSandbox:
    env = BoundedSandbox(undefined=jinja2.StrictUndefined)
    env.globals.update(_GLOBALS)
    return env


@lru_cache(maxsize=4096)
def _compiled(text: str):
    """Compiled once per expression text: launch plans evaluate the same few expressions often."""
    return _env().compile_expression(text, undefined_to_none=False)


@lru_cache(maxsize=4096)
def _template(text: str) -> jinja2.Template:
    return _env().from_string(text)


def expand(text: Any, ctx: Mapping[str, Any], where: str = "kernel contract") -> Any:
    """Expand `{{ }}` / `{% %}` in a contract string with ctx; non-strings pass through."""
    if not isinstance(text, str) or ("{{" not in text and "{%" not in text):
        return text
    try:
        with _bounded():
            out = _template(text).render(**ctx).strip()
    except jinja2.TemplateSyntaxError as e:
        raise KernelError(f"{where}: bad template string {text!r}: {e.message}") from None
    except Exception as e:  # the string is user input: any failure (sandbox, overflow, undefined) is its fault
        raise KernelError(f"{where}: cannot expand {text!r}: {type(e).__name__}: {e}") from None
    # What it expands to is evaluated, cached by its text and printed in messages, outside these bounds:
    # a `repeat` of texts each a few hundred MB filled the caches until memory ran out.
    if len(out) > MAX_EXPANDED:
        raise KernelError(f"{where}: {text!r} expands to {len(out)} characters; allowed: at most {MAX_EXPANDED} "
                          "(a name, a dtype or an expression)")
    return out


@lru_cache(maxsize=4096)
def undeclared(expr: str) -> frozenset[str]:
    """Names an expression uses that are not Jinja globals."""
    return frozenset(meta.find_undeclared_variables(_env().parse("{{ " + expr + " }}")) - set(_GLOBALS))


def evaluate(expr: Any, ctx: Mapping[str, Any], where: str) -> Any:
    """Value of a contract expression. A bare unknown name is a symbolic dim and comes back as str."""
    text = expand(expr, ctx, where)
    if not isinstance(text, str):
        return text
    text = text.strip()
    try:  # parsing folds constants (`'%9999999999d' % 1`, `'x'*9|list`) as calling does: both bounded
        with _bounded():
            missing = undeclared(text) - set(ctx)
            if not missing:
                value = _compiled(text)(**ctx)
                check_result(value)
    except jinja2.TemplateSyntaxError as e:
        raise KernelError(f"{where}: bad expression {text!r}: {e.message}") from None
    except Exception as e:  # the expression is user input: any failure is the contract's fault
        raise KernelError(f"{where}: cannot evaluate {text!r}: {type(e).__name__}: {e}") from None
    if missing:
        if text.isidentifier():
            return text
        raise KernelError(f"{where}: {text!r} uses {', '.join(sorted(missing))}, which are neither params "
                          f"nor bound dims{closest(sorted(missing)[0], ctx)}")
    if (undefined := _undefined_in(value)) is not None:  # else int(value) raises jinja2's error later
        raise KernelError(f"{where}: {text!r} is undefined: {undefined._undefined_message}")
    return value


def _truthy(when: str | None, ctx: Mapping[str, Any], where: str) -> bool:
    return True if when is None else bool(evaluate(when, ctx, where))


def _repeats(item, ctx: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """Contexts for each repetition of an item (`i` set when `repeat` is given)."""
    if not _truthy(item.when, ctx, f"{where}.when"):
        return []
    if item.repeat is None:
        return [dict(ctx)]
    n = evaluate(item.repeat, ctx, f"{where}.repeat")
    # bounded as Jinja's range() is: `repeat: 10**9` made a context per item until memory ran out (exit 3),
    # and a negative count (or `true`, an int to Python) made none (or one) silently
    if not is_int(n) or not 0 <= n <= MAX_RANGE:
        raise KernelError(f"{where}.repeat: must be an int from 0 to {MAX_RANGE} once params are known, got {n!r}")
    return [{**ctx, "i": i} for i in range(n)]
