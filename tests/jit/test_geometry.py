"""A launch's geometry against CUDA's limits (jit/geometry.py): the limits at their edges, the shared
memory table against the CUDA Programming Guide and against the templates' own copy of it."""
from __future__ import annotations

import textwrap

import pytest

from deepjit_compiler.errors import KernelError
from deepjit_compiler.jit.contracts import Launch
from deepjit_compiler.jit.geometry import check_launch, max_shared_per_block
from deepjit_compiler.jit.nvrtc import compile_source, supported_sms
from deepjit_compiler.jit.render import render_kernel

KIB = 1024


def launch(grid=(1, 1, 1), block=(32, 1, 1), shared_mem=0) -> Launch:
    return Launch("k", "k", tuple(grid), tuple(block), shared_mem, ())


@pytest.mark.parametrize("sm, limit", [(75, 64 * KIB), (80, 163 * KIB), (86, 99 * KIB), (87, 163 * KIB),
                                       (89, 99 * KIB), (90, 227 * KIB), (100, 227 * KIB), (103, 227 * KIB),
                                       (110, 227 * KIB), (120, 99 * KIB), (121, 99 * KIB), (130, None)])
def test_shared_memory_a_block_may_have_by_sm(sm, limit):
    """CUDA Programming Guide 5.1.3, Table 31 (64 KiB = 65536 on 7.5, 163 KiB = 166912 on 8.0 and 8.7,
    99 KiB = 101376 on 8.6, 8.9 and 12.x, 227 KiB = 232448 on 9.0, 10.x and 11.0); an SM it does not
    list has no limit here (the GPU tells at load)."""
    assert max_shared_per_block(sm) == limit


@pytest.mark.parametrize("edge, past, message", [
    ({"block": (1024, 1, 1)}, {"block": (1025, 1, 1)}, r"block is \[1025, 1, 1\] \(x is 1025\)"),
    ({"block": (1, 1024, 1)}, {"block": (1, 1025, 1)}, r"block is \[1, 1025, 1\] \(y is 1025\)"),
    ({"block": (16, 1, 64)}, {"block": (8, 1, 128)}, r"block is \[8, 1, 128\] \(z is 128\)"),
    ({"block": (512, 2, 1)}, {"block": (512, 4, 1)}, r"block is \[512, 4, 1\] \(2048 threads\)"),
    ({"block": (16, 1, 64)}, {"block": (32, 1, 64)}, r"block is \[32, 1, 64\] \(2048 threads\)"),
    ({"block": (1, 1, 1)}, {"block": (32, 0, 1)}, r"block is \[32, 0, 1\] \(y is 0\)"),
    ({"grid": (2**31 - 1, 1, 1)}, {"grid": (2**31, 1, 1)}, r"grid is \[2147483648, 1, 1\] \(x is 2147483648\)"),
    ({"grid": (1, 65535, 65535)}, {"grid": (1, 65536, 1)}, r"grid is \[1, 65536, 1\] \(y is 65536\)"),
    ({"grid": (1, 1, 65535)}, {"grid": (1, 1, 65536)}, r"grid is \[1, 1, 65536\] \(z is 65536\)"),
    ({"grid": (1, 1, 1)}, {"grid": (0, 4, 1)}, r"grid is \[0, 4, 1\] \(x is 0\)"),
    ({"shared_mem": 65536}, {"shared_mem": 65537}, r"shared_mem is 65537 bytes; sm_75 allows 0 to 65536 bytes"),
    ({"shared_mem": 0}, {"shared_mem": -4}, r"shared_mem is -4 bytes; sm_75 allows 0 to 65536 bytes"),
])
def test_each_limit_holds_at_its_edge_and_refuses_one_past_it(edge, past, message):
    check_launch(launch(**edge), 75, "k.yaml", batch=1)
    with pytest.raises(KernelError, match=rf"^k.yaml: entry point 'k' at batch 3: {message}"):
        check_launch(launch(**past), 75, "k.yaml", batch=3)


def test_the_message_says_what_the_target_allows():
    with pytest.raises(KernelError) as e:
        check_launch(launch(grid=(4, 70000, 1)), 86, "spec.yaml: cut 'x' kernels[0] (k.yaml)", batch=8,
                     target="the target sm_86 (A10)")
    assert str(e.value) == ("spec.yaml: cut 'x' kernels[0] (k.yaml): entry point 'k' at batch 8: grid is [4, 70000, 1] "
                            "(y is 70000); the target sm_86 (A10) allows x from 1 to 2147483647, y and z from 1 to 65535")
    with pytest.raises(KernelError) as e:
        check_launch(launch(shared_mem=200_000), 89, "k.yaml", batch=None)
    assert str(e.value) == ("k.yaml: entry point 'k': shared_mem is 200000 bytes; sm_89 allows 0 to 101376 bytes of "
                            "dynamic shared memory a block (its static shared memory counts against that too)")
    check_launch(launch(shared_mem=200_000), 90, "k.yaml", batch=None)  # an H100/H200 gives a block 227 KiB
    # an SM the table does not know: its GPU checks the size at load, a negative one is refused here
    check_launch(launch(shared_mem=300_000), 130, "k.yaml", batch=None)
    with pytest.raises(KernelError, match=r"^k.yaml: entry point 'k': shared_mem is -1 bytes; sm_130 allows 0 bytes or "
                                          r"more of dynamic shared memory"):
        check_launch(launch(shared_mem=-1), 130, "k.yaml", batch=None)


TEMPLATE = """\
#include "deepjit_common.cuh"
static_assert(deepjit::kMaxSharedOptin == {{ limit }}, "kMaxSharedOptin is not geometry.MAX_SHARED_PER_BLOCK's");
__global__ void k() {}
"""


def test_the_templates_copy_of_the_table_agrees(tmp_path):
    """deepjit_common.cuh's kMaxSharedOptin (what templates static_assert against) is the same table, for
    every SM this NVRTC compiles for that the table has."""
    (tmp_path / "k.cu.j2").write_text(TEMPLATE)
    (tmp_path / "k.yaml").write_text(textwrap.dedent("""\
        name: k
        template: k.cu.j2
        headers: [deepjit_common.cuh]
        params: {limit: {type: int, default: 0}}
        entry_points: [{name: k, symbol: k, block: [1], grid: [1], args: []}]
        """))
    sms = [sm for sm in supported_sms() if max_shared_per_block(sm) is not None]
    assert {75, 80, 86, 89, 90, 120} <= set(sms)
    for sm in sms:
        _, source = render_kernel(str(tmp_path / "k.yaml"), {"limit": max_shared_per_block(sm)})
        compile_source(source, sm)
