"""Where decode + nms spends its graph time (not a test): the pair against copies of both that stop early.

    python3 bench/nms_floors.py [--batches 1 8 32] [--decode lanes_per_anchor=4,large_batch_lanes=2]
                                [--nms block=512,cluster=8] [--object-classes 80]

Copies of the decode define DJ_DECODE_STOP (templates/yolov8_decode.cu.j2): its blocks leave right after
letting the nms launch (0) or after the class pass, before any candidate (1). Copies of the nms define
DJ_NMS_STOP (templates/deepjit_nms.cuh): on the usual frame its blocks leave right after the decode's wait
(0), after the cluster's barrier too (1), after the candidates' loads (2) or after the counting pass (3).
Each step's pair, the first three with the nms that leaves after its wait, runs interleaved with the
others, three rounds, on fp16 head maps of bench/postprocess.py (four sets a batch, cycled), with the H200
spec's kernels unless --decode / --nms say otherwise (their params over decode_variants.py's and its nms's
defaults). Printed: graph replay, median µs a round, and each step's share (the median against the step
before): from two launches that do nothing to the whole pair.
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

# ((DJ_DECODE_STOP, DJ_NMS_STOP), what the pair does past the one before it); None: the contract itself
STEPS = (((0, 0), "two launches: the decode leaves, the nms waits"), ((1, 0), "+ the decode's class pass"),
         ((None, 0), "+ the decode's candidates"), ((None, 1), "+ the nms's cluster barrier"),
         ((None, 2), "+ the candidates' loads"), ((None, 3), "+ the counting pass"),
         ((None, None), "+ rows, settle, exchange, output (the whole nms)"))
DECODE_STOPS, NMS_STOPS = (tuple(dict.fromkeys(pair[k] for pair, _ in STEPS)) for k in (0, 1))  # in step order
SPEC_NMS = "block=512,cluster=8"  # the H200 spec's nms, over nms_params' block 1024, chunk 512


def decode_params(extra: str) -> dict:
    """The decode's params: mode candidates, 1 anchor a thread, the H200 spec's lanes, `extra` over them."""
    return variant("decode=yolov8_decode:" + extra, {**DECODE_PARAMS, "lanes_per_anchor": 4, "large_batch_lanes": 2})[2]


def stop_copies(folder: Path, contract: str, define: str, stops) -> dict:
    """Contract paths by stop: for each of `stops` but None, a copy of kernels/{contract}.yaml defining
    `define` as that stop; for None, the contract itself (the whole kernel)."""
    out = {}
    for stop in stops:
        if stop is None:
            out[stop] = contract
        else:
            (folder / f"{contract}{stop}").mkdir()
            out[stop] = str(defined_copy(REPO / "kernels" / f"{contract}.yaml", folder / f"{contract}{stop}",
                                         f"{define} {stop}"))
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
    with tempfile.TemporaryDirectory() as tmp:
        def kernels(contract, define, stops, params):
            return {stop: compile_site_kernel(ref, params, site.facts, sm=gpu.sm, spec_dir=tmp)
                    for stop, ref in stop_copies(Path(tmp), contract, define, stops).items()}

        decodes = kernels("yolov8_decode", "DJ_DECODE_STOP", DECODE_STOPS, decode_params(args.decode))
        nmses = kernels("nms", "DJ_NMS_STOP", NMS_STOPS, nms_params(args.nms))
        for batch in args.batches:  # inside: the runtime reads the contracts again
            rng = np.random.default_rng(batch)
            sets = [typed_maps(head_maps(rng, batch, args.object_classes), "float16") for _ in range(4)]
            rounds = {pair: [] for pair, _ in STEPS}
            for _ in range(3):
                for d, n in rounds:
                    graph = bench_deepjit(gpu, decodes[d], nmses[n], site, sets, 200, torch)["deepjit-graph"]
                    rounds[d, n].append(graph["gpu_us"][0])
            before = None
            for pair, what in STEPS:
                med = float(np.median(rounds[pair]))
                share = "" if before is None else f"   {med - before:+5.1f}"
                print(f"b{batch} {what:50s} graph {' '.join(f'{g:5.1f}' for g in rounds[pair])}{share}", flush=True)
                before = med
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
