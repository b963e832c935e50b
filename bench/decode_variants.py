"""Time yolov8_decode variants against each other with the same nms after them (not a test).

    python3 bench/decode_variants.py head=OLD/yolov8_decode.yaml:lanes_per_anchor=4 \\
                                     l2=yolov8_decode:lanes_per_anchor=2 ... [--batches 1 8 32] [--object-classes 80]
                                     [--launches N]

Each variant is NAME=CONTRACT[:param=int,...] (a contract YAML path, with its template and headers
beside it, or a name in kernels/), in mode candidates with anchors_per_thread 1 unless given. All run
interleaved, two rounds, on fp16 head maps of bench/postprocess.py (four sets per batch, cycled), each
followed by the same nms (block 1024, chunk 512 unless --nms gives others); printed: the decode alone
(graph + memset) and decode + nms (graph replay), median µs per round, the detections per image, and
whether the detections are the first variant's, row by row. With --launches N, each variant's decode +
nms chains are only launched N times at the first batch, untimed, for a profiler: `ncu --kernel-name
regex:decode --launch-skip 4 --launch-count 1 python3 bench/decode_variants.py
l4=yolov8_decode:lanes_per_anchor=4 --batches 32 --launches 8`.
--anchor-major NAME...: those variants get each level's box map anchor-major (the memory of [B, H, W, 64],
bound under the same shape), for a variant that reads it so (bench/anchor_major.py writes one: a
candidate's 64 logits in 4 sectors rather than 64); --anchor-major-classes NAME...: their class maps too
(that variant with class_nhwc=1).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nms_variants import NMS_PARAMS, variant  # noqa: E402
from postprocess import (  # noqa: E402
    CONF,
    NC,
    bench_deepjit,
    chains,
    decode_site,
    head_maps,
    object_classes,
    same_detections,
    typed_maps,
)

from deepjit_compiler.jit.nvrtc import compile_site_kernel  # noqa: E402
from deepjit_compiler.runtime import gpu as gpu_mod  # noqa: E402

# every decode variant's params under its own
DECODE_PARAMS = {"mode": "candidates", "conf_threshold": CONF, "anchors_per_thread": 1}


def nms_params(extra: str) -> dict:
    """The nms after every variant: block 1024, chunk 512, cluster 1, with `extra` (param=int,...) over them."""
    return variant("nms=nms:" + extra, {**NMS_PARAMS, "chunk": 512})[2]


def anchor_major_maps(maps: list[dict[str, np.ndarray]], roles: set[str]) -> list[dict[str, np.ndarray]]:
    """Each level's maps of `roles` ("box", "cls") anchor-major: the memory of [B, H, W, C], under the
    shape [B, C, H, W] the site binds."""
    return [{k: np.ascontiguousarray(v.transpose(0, 2, 3, 1)).reshape(v.shape) if k in roles else v
             for k, v in lv.items()} for lv in maps]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", metavar="NAME=CONTRACT[:param=int,...]")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--object-classes", type=object_classes, default=NC)
    ap.add_argument("--launches", type=int, help="only launch each variant N times at the first batch (for ncu)")
    ap.add_argument("--anchor-major", nargs="+", default=[], metavar="NAME",
                    help="variants fed anchor-major box maps (the memory of [B, H, W, 64] under the same shape)")
    ap.add_argument("--anchor-major-classes", nargs="+", default=[], metavar="NAME",
                    help="variants fed anchor-major class maps too")
    ap.add_argument("--nms", default="", metavar="param=int,...",
                    help="the nms's params over block 1024, chunk 512 (the H200 spec's: block=512,cluster=8)")
    args = ap.parse_args(argv)
    import torch  # bench_deepjit holds the stream with torch's sleep kernel while it queues

    gpu = gpu_mod.Gpu()
    site = decode_site("fp16")
    decoders = {name: compile_site_kernel(ref, params, site.facts, sm=gpu.sm, spec_dir=".")
                for name, ref, params in (variant(a, DECODE_PARAMS) for a in args.variants)}
    nms = compile_site_kernel("nms", nms_params(args.nms), site.facts, sm=gpu.sm)
    def fp16_sets(batch):
        rng = np.random.default_rng(batch)
        return [typed_maps(head_maps(rng, batch, args.object_classes), "float16") for _ in range(4)]

    def variant_sets(sets):
        """{variant: its input sets}, each layout the variants ask for made once."""
        layouts, out = {}, {}
        for name in decoders:
            roles = frozenset(({"box"} if name in args.anchor_major else set())
                              | ({"cls"} if name in args.anchor_major_classes else set()))
            if roles not in layouts:
                layouts[roles] = [anchor_major_maps(maps, roles) for maps in sets] if roles else sets
            out[name] = layouts[roles]
        return out

    if args.launches:
        batch, sets = args.batches[0], variant_sets(fp16_sets(args.batches[0]))
        for name, decode in decoders.items():
            posts = chains(gpu, [decode, nms], site, sets[name])
            for k in range(args.launches):
                posts[k % len(posts)].launch()
            print(f"b{batch} {name}: {args.launches} launches, detections {posts[0].results()['num_dets'].tolist()[:4]}")
        return 0
    for batch in args.batches:
        sets = variant_sets(fp16_sets(batch))
        rounds, dets, outs = {name: [] for name in decoders}, {}, {}
        for _ in range(2):
            for name, decode in decoders.items():
                out = bench_deepjit(gpu, decode, nms, site, sets[name], 200, torch)
                dets[name], outs[name] = out.pop("_dets"), out.pop("_out")
                rounds[name].append((out["deepjit decode alone (graph + memset)"]["gpu_us"][0],
                                     out["deepjit-graph"]["gpu_us"][0]))
        first = next(iter(outs.values()))
        for name, r in rounds.items():
            print(f"b{batch} {name:16s} decode alone {' '.join(f'{d:5.1f}' for d, _ in r)}   "
                  f"graph {' '.join(f'{g:5.1f}' for _, g in r)}   detections {dets[name][:4]}"
                  f"{'' if same_detections(outs[name], first) else ' (NOT the first variant' + chr(39) + 's)'}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
