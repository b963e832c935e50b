"""Time nms variants against each other on the same decode output (not a test).

    python3 bench/nms_variants.py previous=OLD/nms.yaml chunk512=kernels/nms.yaml:chunk=512 ...
                                  [--batches 1 8] [--object-classes 80]

Each variant is NAME=CONTRACT[:param=int,...] (a contract YAML path, with its template and headers
beside it, or a name in kernels/). All variants run interleaved, three rounds, on one data set of
bench/postprocess.py per batch (the first set, repeated, so every variant sees the same candidates;
--object-classes 1: a crowded frame of one class); printed: graph replay of decode + nms and of nms
alone, median µs per round.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from postprocess import CONF, IOU, MAX_DET, NC, bench_deepjit, decode_site, head_maps, object_classes  # noqa: E402

from deepjit_compiler.jit.nvrtc import compile_site_kernel  # noqa: E402
from deepjit_compiler.runtime import gpu as gpu_mod  # noqa: E402

NMS_PARAMS = {"conf_threshold": CONF, "iou_threshold": IOU, "max_det": MAX_DET, "block": 1024}


def variant(arg: str, defaults: dict = NMS_PARAMS) -> tuple[str, str, dict]:
    """NAME=CONTRACT[:param=int,...] -> (name, contract, the defaults updated with those params)."""
    name, _, ref = arg.partition("=")
    ref, _, extra = ref.partition(":")
    return name, ref, {**defaults, **{k: int(v) for k, v in (kv.split("=") for kv in extra.split(",") if kv)}}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", metavar="NAME=CONTRACT[:param=int,...]")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--object-classes", type=object_classes, default=NC)
    args = ap.parse_args(argv)
    import torch  # bench_deepjit holds the stream with torch's sleep kernel while it queues

    gpu = gpu_mod.Gpu()
    site = decode_site()
    decode = compile_site_kernel("yolov8_decode", {"mode": "candidates", "conf_threshold": CONF,
                                                   "anchors_per_thread": 1, "lanes_per_anchor": 4}, site.facts, sm=gpu.sm)
    kernels = {name: compile_site_kernel(ref, params, site.facts, sm=gpu.sm, spec_dir=".")
               for name, ref, params in map(variant, args.variants)}
    for batch in args.batches:
        sets = [head_maps(np.random.default_rng(batch), batch, args.object_classes)] * 4
        rounds = {name: [] for name in kernels}
        for _ in range(3):
            for name, nms in kernels.items():
                out = bench_deepjit(gpu, decode, nms, site, sets, 300, torch)
                rounds[name].append((out["deepjit-graph"]["gpu_us"][0], out["deepjit nms alone (graph + copy)"]["gpu_us"][0]))
        for name, r in rounds.items():
            print(f"b{batch} {name:16s} graph {' '.join(f'{g:5.1f}' for g, _ in r)}   "
                  f"nms alone {' '.join(f'{a:5.1f}' for _, a in r)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
