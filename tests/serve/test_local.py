"""LocalTritonServer's cleanup of what a killed run left: its shared memory regions, and nobody else's."""
from __future__ import annotations

import os
import subprocess
import sys

from deepjit_compiler.serve.local import REGION_PREFIX, remove_stale_regions


def gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_regions_of_a_killed_run_go_and_the_others_stay(tmp_path):
    dead = tmp_path / f"{REGION_PREFIX}{gone_pid()}_1a2b3c4d_e5d968b0-c4a3"
    live = tmp_path / f"{REGION_PREFIX}{os.getpid()}_5e6f7a8b_0f1e2d3c-4b5a"
    triton = tmp_path / "triton_python_backend_shm_region_1"      # Triton's default prefix: not ours
    odd = tmp_path / f"{REGION_PREFIX}notapid_1a2b3c4d"
    for region in (dead, live, triton, odd):
        region.write_bytes(b"region")
    assert remove_stale_regions(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, triton, odd))
