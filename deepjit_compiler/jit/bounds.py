"""Bounds on running user-written Jinja (kernel templates, contract expressions) in time and memory.

The sandbox (jit/sandbox.py) bounds single operations whose arguments choose their result's
size (`*`, `**`, `range`, padding). These bound what it cannot see in one call: a printf width
(`'%9999999999d' % 1`), a string doubled in a loop, a `map` over a long list collected with `list`."""
from __future__ import annotations

import contextlib
import os
import resource
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """TimeoutError in the block after `seconds`, by SIGALRM: only the main thread can take it, so
    elsewhere (a server's worker thread) the block runs unbounded in time. It fires again each second
    after: Jinja's constant folding (at parse time) takes any Exception for "not a constant" and runs the
    expression again when called."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:  # inside another deadline: ending, this one would disarm it
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"{what} for more than {seconds:g} s; the sandbox refuses it")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _address_space() -> int | None:
    """Bytes of address space the process maps now (the total RLIMIT_AS is checked against)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def memory_bound(extra: int, what: str) -> Iterator[None]:
    """MemoryError for what the block maps beyond `extra` more bytes: without it such a block runs the
    machine out of memory rather than failing (the kernel allows a large overcommit). It lowers the
    process's soft RLIMIT_AS for the block and puts it back after, so it bounds every thread for that
    time: only the main thread sets it (a build or validate renders there alone; a server's worker thread
    must not make its neighbours' allocations fail), and only where /proc tells what the process maps.
    Memory the process freed but still maps (malloc keeps it for reuse) is reused unseen: the block may take
    `extra` beyond what the process had mapped before it, its own earlier peak included."""
    main = threading.current_thread() is threading.main_thread()
    used = _address_space() if main else None
    if used is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = used + extra
    for cap in (soft, hard):  # never above a limit already set (an outer bound, or the user's own)
        if cap != resource.RLIM_INFINITY:
            limit = min(limit, cap)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    except MemoryError:
        raise MemoryError(f"{what} needs more than {extra >> 20} MiB of memory; the sandbox refuses it") from None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
