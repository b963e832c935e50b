"""The time and memory bounds on running user-written Jinja (jit/bounds.py)."""
from __future__ import annotations

import concurrent.futures
import resource
import signal
import time

import pytest

from deepjit_compiler.jit.bounds import deadline, memory_bound

MiB = 1 << 20


def test_the_memory_bound_refuses_what_maps_past_it_and_is_lifted_after():
    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(MemoryError, match=r"^the test needs more than 64 MiB of memory; the sandbox refuses it$"):
        with memory_bound(64 * MiB, "the test"):
            bytearray(256 * MiB)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert len(bytearray(256 * MiB)) == 256 * MiB  # the same size outside the block


def test_a_bound_inside_another_never_lifts_the_outer_one():
    with memory_bound(64 * MiB, "the outer"):
        outer = resource.getrlimit(resource.RLIMIT_AS)
        with memory_bound(1 << 40, "the inner"):
            assert resource.getrlimit(resource.RLIMIT_AS) == outer
            with pytest.raises(MemoryError):
                bytearray(256 * MiB)
        assert resource.getrlimit(resource.RLIMIT_AS) == outer


def test_a_worker_thread_sets_no_bound():
    """RLIMIT_AS is the process's: a server thread bounding its own render would fail its neighbours' allocations."""
    def inside():
        with memory_bound(64 * MiB, "the thread"):
            return resource.getrlimit(resource.RLIMIT_AS), len(bytearray(256 * MiB))

    before = resource.getrlimit(resource.RLIMIT_AS)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(inside).result() == (before, 256 * MiB)


def test_a_deadline_inside_another_leaves_the_outer_one_armed():
    """An inner deadline that disarmed the timer as it ended let the rest of the outer block run unbounded."""
    with pytest.raises(TimeoutError, match=r"^the outer block runs for more than 0\.3 s; the sandbox refuses it$"):
        with deadline(0.3, "the outer block runs"):
            with deadline(30, "the inner block runs"):
                pass
            assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
            time.sleep(5)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
