"""The expression language of kernel contracts: Jinja expressions in a sandbox, StrictUndefined.

`4 * reg_max`, `ceil_div(A, block)`: a string may also hold `{{ }}` / `{% %}`, expanded first with the
params (and `i` inside `repeat`). A bare name that is neither a param nor a bound dim is a symbolic
dim, bound at launch from the tensors' actual shapes."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

from ..errors import KernelError, closest
from .bounds import deadline, memory_bound

CTYPES = {"float32": "float", "float16": "__half", "int32": "int", "uint8": "unsigned char",
          "int64": "long long", "uint32": "unsigned int"}


# ---------------------------------------------------------------------------------------------
# Expressions

def _ceil_div(a: int, b: int) -> int:
    _check_division(int(a), int(b))
    return -(-int(a) // int(b))


def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _is_static(value: Any) -> bool:
    """True when every leaf of a (nested) list is an int: no symbolic dims."""
    if isinstance(value, (list, tuple)):
        return all(_is_static(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


def _each(values):
    """values one at a time from Python code: a C loop over them (`sum`) is deaf to the deadline's SIGALRM,
    this generator is not. A `sum` of 4M lists copies 8 * 10**12 items, for days."""
    for v in values:
        yield v


def _sum(values, start=0):
    return sum(_each(values), start)


def _prod(values, start=1):
    """math.prod with `*`'s bounds: prod([2 ** 4000] * 30000) multiplied for hours, unchecked and deaf to SIGALRM."""
    for v in values:
        _check_times(start, v)
        start = start * v
    return start


_GLOBALS = {"is_static": _is_static, "ceil_div": _ceil_div, "pow2ceil": _pow2ceil, "min": min, "max": max, "len": len, "sum": _sum,
            "prod": _prod, "int": int, "float": float, "ctype": lambda d: CTYPES[d]}


MAX_REPEAT = 1 << 22     # items a `*` may make of a str/list/tuple: jinja2's MAX_RANGE bounds range() only
MAX_POW_BITS = 1 << 12   # bits an int `**` or `*` may make: 10**10**10 would hold the build for hours
EXPRESSION_BYTES = 1 << 30  # memory one expression may take: `list` of a long `map` is bounded by nothing else
MAX_EXPANDED = 1 << 16     # characters a contract string may expand to
EXPRESSION_SECONDS = 30.0   # time one expression or contract string may take: filters loop too (`[1]|slice(10**15)|max`)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with `*` and `**` bounded: contracts and templates come from users
    and pulled bundles, and `'a' * 10**10` or `9**9**9` would exhaust memory or time before any
    error. Intercepting also stops Jinja folding such constants at compile time. So are the str
    methods and filters whose arguments choose their result's size (`'a'.ljust(10**10)`, `|center`,
    `replace`): one call builds it, before any bound on the whole render could see it."""

    intercepted_binops = frozenset({"*", "**", "//", "%"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        del self.globals["lipsum"]  # n paragraphs of lorem ipsum, n unbounded: no kernel needs it
        for name, check in _FILTER_CHECKS.items():
            self.filters[name] = _checked(self.filters[name], check)
        sum_filter = self.filters["sum"]  # takes the environment first
        self.filters["sum"] = functools.wraps(sum_filter)(lambda env, values, *a, **kw: sum_filter(env, _each(values), *a, **kw))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_times(left, right)
        elif operator in ("//", "%"):
            _check_division(left, right)
        else:
            _check_power(left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs) -> Any:
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str) and getattr(obj, "__name__", "") in _STR_CHECKS:
            _STR_CHECKS[obj.__name__](owner, *args, **kwargs)
        return super().call(context, obj, *args, **kwargs)


def _check_times(a: Any, b: Any) -> None:
    _check_repeat(a, b)
    _check_repeat(b, a)
    _check_product(a, b)


def _check_size(size: int, what: str) -> None:
    if size > MAX_REPEAT:
        raise OverflowError(f"{what} makes more than {MAX_REPEAT} characters; the sandbox refuses it")


def _check_width(s: Any, width: Any = 0, *_, **__) -> None:
    if _int(width):
        _check_size(width, f"padding to a width of {width}")


def _check_replace(s: Any, old: Any = "", new: Any = "", count: Any = -1, *_, **__) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        n = s.count(old) if old else len(s) + 1
        if _int(count) and count >= 0:
            n = min(n, count)
        _check_size(len(s) + n * (len(new) - len(old)), f"replacing {n} times")


def _check_tabs(s: Any, tabsize: Any = 8, *_, **__) -> None:
    if isinstance(s, str) and _int(tabsize):
        _check_size(len(s) + s.count("\t") * tabsize, f"tabs of {tabsize}")


def _check_indent(s: Any, width: Any = 4, *_, **__) -> None:
    step = width if _int(width) else len(width) if isinstance(width, str) else 0
    if isinstance(s, str):
        _check_size(len(s) + (s.count("\n") + 1) * step, f"indenting by {width!r}")


def _check_round(value: Any, precision: Any = 0, *_, **__) -> None:
    # `|round` makes 10 ** precision (to an int's negative one, or by 'ceil' and 'floor'), unbounded and deaf to SIGALRM
    if _int(precision):
        _check_power(10, abs(precision))


_STR_CHECKS = {"ljust": _check_width, "rjust": _check_width, "center": _check_width, "zfill": _check_width,
               "replace": _check_replace, "expandtabs": _check_tabs}
# the filters' checks; `replace` takes the evaluation context first
_FILTER_CHECKS = {"center": _check_width, "indent": _check_indent, "round": _check_round,
                  "replace": lambda ctx, *args, **kwargs: _check_replace(*args, **kwargs)}


def _checked(f, check):
    @functools.wraps(f)  # keeps jinja_pass_arg: the replace filter is still handed its context
    def bounded(*args, **kwargs):
        check(*args, **kwargs)
        return f(*args, **kwargs)
    return bounded


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_power(base: Any, exp: Any) -> None:
    if _int(base) and _int(exp) and exp > 0 and exp * (abs(base) - 1).bit_length() > MAX_POW_BITS:
        raise OverflowError(f"{base} ** {exp} has more than {MAX_POW_BITS} bits; the sandbox refuses it")


def _check_product(a: Any, b: Any) -> None:
    # `x*x` nested k deep makes 2**k times x's bits: a 4,096-bit x nested 20 deep multiplies for hours
    if _int(a) and _int(b) and a.bit_length() + b.bit_length() > MAX_POW_BITS:
        raise OverflowError(f"a product of {a.bit_length()} and {b.bit_length()} bits has more than {MAX_POW_BITS} "
                            "bits; the sandbox refuses it")


def _check_division(a: Any, b: Any) -> None:
    # `int('f' * 4000000, 16)` (or `from_bytes`) is not bounded; dividing two such took minutes, deaf to SIGALRM
    if _int(a) and _int(b) and min(a.bit_length(), b.bit_length()) > MAX_POW_BITS:
        raise OverflowError(f"dividing ints of {a.bit_length()} and {b.bit_length()} bits: over {MAX_POW_BITS} bits, "
                            "the sandbox refuses it")


def _check_repeat(seq: Any, times: Any) -> None:
    if isinstance(seq, (str, bytes, list, tuple)) and _int(times) and len(seq) * times > MAX_REPEAT:
        raise OverflowError(f"repeating a {type(seq).__name__} of {len(seq)} items {times} times makes more "
                            f"than {MAX_REPEAT} items; the sandbox refuses it")


def _check_result(value: Any, budget: int = MAX_REPEAT) -> int:
    """budget less the items and characters a (nested) result prints as; OverflowError past it, or for an int
    over MAX_POW_BITS. A result is printed in messages and written to manifests whole, outside any bound:
    `['a' * 4000000] * 4000000` takes 32 MB yet prints as 16 TB, and an int of 15,000 bits cannot print."""
    if _int(value) and value.bit_length() > MAX_POW_BITS:
        raise OverflowError(f"the value is an int of {value.bit_length()} bits, over {MAX_POW_BITS}; the sandbox refuses it")
    budget -= len(value) if isinstance(value, (str, bytes)) else 1
    for v in value.items() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ():
        if budget < 0:
            break
        budget = _check_result(v, budget)
    if budget < 0:
        raise OverflowError(f"the value prints as more than {MAX_REPEAT} items and characters; the sandbox refuses it")
    return budget


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
def _env() -> ImmutableSandboxedEnvironment:
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
        with memory_bound(EXPRESSION_BYTES, "the expression"), deadline(EXPRESSION_SECONDS, "the expression runs"):
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
        with memory_bound(EXPRESSION_BYTES, "the expression"), deadline(EXPRESSION_SECONDS, "the expression runs"):
            missing = undeclared(text) - set(ctx)
            if not missing:
                value = _compiled(text)(**ctx)
                _check_result(value)
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
    if not _int(n) or not 0 <= n <= MAX_RANGE:
        raise KernelError(f"{where}.repeat: must be an int from 0 to {MAX_RANGE} once params are known, got {n!r}")
    return [{**ctx, "i": i} for i in range(n)]
