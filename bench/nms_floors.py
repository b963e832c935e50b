"""Where decode + nms spends its graph time (not a test): the pair against copies of the nms that stop early.

    python3 bench/nms_floors.py [--batches 1 8 32] [--decode lanes_per_anchor=4,large_batch_lanes=2]
                                [--nms block=512,cluster=8] [--object-classes 80]

Each copy of the nms contract defines DJ_NMS_STOP (templates/deepjit_nms.cuh): on the usual frame its
blocks leave right after the decode's wait (0), after the cluster's barrier too (1), after the candidates'
loads (2) or after the counting pass (3). Decode + each copy, and the whole pair, run interleaved, three
rounds, on fp16 head maps of bench/postprocess.py (four sets a batch, cycled), with the H200 spec's kernels
unless --decode / --nms say otherwise (their params over decode_variants.py's and its nms's defaults).
Printed: graph replay, median µs a round, and each step's share (the median against the step before): what
the nms's work costs on top of a decode whose nms does nothing.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_variants import DECODE_PARAMS, nms_params  # noqa: E402
from nms_profile import defined_copy  # noqa: E402
from nms_variants import variant  # noqa: E402
from postprocess import NC, REPO, bench_deepjit, decode_site, head_maps, object_classes, typed_maps  # noqa: E402

from deepjit_compiler.jit.nvrtc import compile_site_kernel  # noqa: E402
from deepjit_compiler.runtime import gpu as gpu_mod  # noqa: E402

# (DJ_NMS_STOP, what the copy does past the one before it); None: the contract itself
STEPS = ((0, "decode + the nms's wait"), (1, "+ the cluster's barrier"), (2, "+ the candidates' loads"),
         (3, "+ the counting pass"), (None, "+ rows, settle, exchange, output (the whole nms)"))
SPEC_NMS = "block=512,cluster=8"  # the H200 spec's nms, over nms_params' block 1024, chunk 512


def decode_params(extra: str) -> dict:
    """The decode's params: mode candidates, 1 anchor a thread, the H200 spec's lanes, `extra` over them."""
    return variant("decode=yolov8_decode:" + extra, {**DECODE_PARAMS, "lanes_per_anchor": 4, "large_batch_lanes": 2})[2]


def stop_copies(folder: Path) -> dict:
    """Contract paths by step: a copy of kernels/nms.yaml defining DJ_NMS_STOP per early stop, the contract
    itself for the whole nms."""
    out = {}
    for stop, _ in STEPS:
        if stop is None:
            out[stop] = "nms"
        else:
            (folder / f"stop{stop}").mkdir()
            out[stop] = str(defined_copy(REPO / "kernels" / "nms.yaml", folder / f"stop{stop}", f"DJ_NMS_STOP {stop}"))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--decode", default="", metavar="param=int,...", help="over lanes_per_anchor=4,large_batch_lanes=2")
    ap.add_argument("--nms", default=SPEC_NMS, metavar="param=int,...",
                    help="over block 1024, chunk 512 (default: the H200 spec's)")
    ap.add_argument("--object-classes", type=object_classes, default=NC)
    args = ap.parse_args(argv)
    import torch  # bench_deepjit holds the stream with torch's sleep kernel while it queues

    gpu = gpu_mod.Gpu()
    site = decode_site("fp16")
    decode = compile_site_kernel("yolov8_decode", decode_params(args.decode), site.facts, sm=gpu.sm)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {stop: compile_site_kernel(ref, nms_params(args.nms), site.facts, sm=gpu.sm, spec_dir=tmp)
                   for stop, ref in stop_copies(Path(tmp)).items()}
        for batch in args.batches:  # inside: the runtime reads the contracts again
            rng = np.random.default_rng(batch)
            sets = [typed_maps(head_maps(rng, batch, args.object_classes), "float16") for _ in range(4)]
            rounds = {stop: [] for stop in kernels}
            for _ in range(3):
                for stop, nms in kernels.items():
                    rounds[stop].append(bench_deepjit(gpu, decode, nms, site, sets, 200, torch)["deepjit-graph"]["gpu_us"][0])
            before = None
            for stop, what in STEPS:
                med = float(np.median(rounds[stop]))
                share = "" if before is None else f"   {med - before:+5.1f}"
                print(f"b{batch} {what:50s} graph {' '.join(f'{g:5.1f}' for g in rounds[stop])}{share}", flush=True)
                before = med
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
