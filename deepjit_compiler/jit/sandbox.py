"""Jinja's immutable sandbox, bounded: contract expressions and kernel templates come from users and
pulled bundles, so an operation whose arguments choose its result's size (`'a' * 10**10`, `9**9**9`,
`'a'.ljust(10**10)`), or one C call that runs for hours deaf to the deadline's SIGALRM (`sum` of
millions of lists, a division of two huge ints), is checked before it runs. What many operations add
up to is bounded by jit/bounds.py."""
from __future__ import annotations

import functools
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_REPEAT = 1 << 22     # items a `*` may make of a str/list/tuple: jinja2's MAX_RANGE bounds range() only
MAX_POW_BITS = 1 << 12   # bits an int `**` or `*` may make: 10**10**10 would hold the build for hours


def _each(values):
    """values one at a time from Python code: a C loop over them (`sum`) is deaf to the deadline's SIGALRM,
    this generator is not. A `sum` of 4M lists copies 8 * 10**12 items, for days."""
    for v in values:
        yield v


def bounded_sum(values, start=0):
    return sum(_each(values), start)


def bounded_prod(values, start=1):
    """math.prod with `*`'s bounds: prod([2 ** 4000] * 30000) multiplied for hours, unchecked and deaf to SIGALRM."""
    for v in values:
        _check_times(start, v)
        start = start * v
    return start


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with `*`, `**`, `//` and `%` checked, and the str methods and filters
    whose arguments choose their result's size (`'a'.ljust(10**10)`, `|center`, `replace`): one call
    builds it, before any bound on the whole render could see it. Intercepted operators are not folded
    at compile time either, so the checks see every one."""

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
            check_division(left, right)
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
    if is_int(width):
        _check_size(width, f"padding to a width of {width}")


def _check_replace(s: Any, old: Any = "", new: Any = "", count: Any = -1, *_, **__) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        n = s.count(old) if old else len(s) + 1
        if is_int(count) and count >= 0:
            n = min(n, count)
        _check_size(len(s) + n * (len(new) - len(old)), f"replacing {n} times")


def _check_tabs(s: Any, tabsize: Any = 8, *_, **__) -> None:
    if isinstance(s, str) and is_int(tabsize):
        _check_size(len(s) + s.count("\t") * tabsize, f"tabs of {tabsize}")


def _check_indent(s: Any, width: Any = 4, *_, **__) -> None:
    step = width if is_int(width) else len(width) if isinstance(width, str) else 0
    if isinstance(s, str):
        _check_size(len(s) + (s.count("\n") + 1) * step, f"indenting by {width!r}")


def _check_round(value: Any, precision: Any = 0, *_, **__) -> None:
    # `|round` makes 10 ** precision (to an int's negative one, or by 'ceil' and 'floor'), unbounded and deaf to SIGALRM
    if is_int(precision):
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


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_power(base: Any, exp: Any) -> None:
    if is_int(base) and is_int(exp) and exp > 0 and exp * (abs(base) - 1).bit_length() > MAX_POW_BITS:
        raise OverflowError(f"{base} ** {exp} has more than {MAX_POW_BITS} bits; the sandbox refuses it")


def _check_product(a: Any, b: Any) -> None:
    # `x*x` nested k deep makes 2**k times x's bits: a 4,096-bit x nested 20 deep multiplies for hours
    if is_int(a) and is_int(b) and a.bit_length() + b.bit_length() > MAX_POW_BITS:
        raise OverflowError(f"a product of {a.bit_length()} and {b.bit_length()} bits has more than {MAX_POW_BITS} "
                            "bits; the sandbox refuses it")


def check_division(a: Any, b: Any) -> None:
    # `int('f' * 4000000, 16)` (or `from_bytes`) is not bounded; dividing two such took minutes, deaf to SIGALRM
    if is_int(a) and is_int(b) and min(a.bit_length(), b.bit_length()) > MAX_POW_BITS:
        raise OverflowError(f"dividing ints of {a.bit_length()} and {b.bit_length()} bits: over {MAX_POW_BITS} bits, "
                            "the sandbox refuses it")


def _check_repeat(seq: Any, times: Any) -> None:
    if isinstance(seq, (str, bytes, list, tuple)) and is_int(times) and len(seq) * times > MAX_REPEAT:
        raise OverflowError(f"repeating a {type(seq).__name__} of {len(seq)} items {times} times makes more "
                            f"than {MAX_REPEAT} items; the sandbox refuses it")


def check_result(value: Any, budget: int = MAX_REPEAT) -> int:
    """budget less the items and characters a (nested) result prints as; OverflowError past it, or for an int
    over MAX_POW_BITS. A result is printed in messages and written to manifests whole, outside any bound:
    `['a' * 4000000] * 4000000` takes 32 MB yet prints as 16 TB, and an int of 15,000 bits cannot print."""
    if is_int(value) and value.bit_length() > MAX_POW_BITS:
        raise OverflowError(f"the value is an int of {value.bit_length()} bits, over {MAX_POW_BITS}; the sandbox refuses it")
    budget -= len(value) if isinstance(value, (str, bytes)) else 1
    for v in value.items() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ():
        if budget < 0:
            break
        budget = check_result(v, budget)
    if budget < 0:
        raise OverflowError(f"the value prints as more than {MAX_REPEAT} items and characters; the sandbox refuses it")
    return budget
