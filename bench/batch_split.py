"""Time decode + nms with the batch split into chunks, each chunk's pair a branch of one CUDA graph (not a test).

    python3 bench/batch_split.py [--batches 8 32] [--chunks 1 2 4 8] [--ways pdl plain prio prio-pdl-last]
                                 [--nms block=512,cluster=8,large_batch_cluster=2]

In the pair as the runtime runs it, every image's nms waits for the whole batch's decode and then runs on an
otherwise idle GPU: at batch 32 the decode is bound by the head maps' bytes and the nms adds ~10 µs after it
(bench/RESULTS.md, session 33). Split into K chunks of B / K images, each chunk's decode -> nms on a stream of
its own (forked from and joined to the capturing stream, so one graph), an earlier chunk's nms can run while
later chunks' decodes still stream their maps: only the last chunk's nms is left after the decode. Ways:
  pdl            each chunk's nms launched early in its decode's stream (programmatic dependent launch, as the pair)
  plain          each chunk's nms in its decode's stream, launched once that decode is done
  prio           each chunk's nms on a stream of the greatest priority, its decode on one of the least, an event
                 between: pending nms blocks are dispatched before pending decode blocks (the graph instantiated
                 to keep its nodes' priorities, which capture copies from their streams)
  prio-pdl-last  as prio, but the last chunk's nms in its decode's stream with programmatic dependent launch
The H200 spec's kernels (the decode 4 lanes, 2 from batch 4; --nms over bench/decode_variants.py's block 1024,
chunk 512), each chunk's kernels choosing by the chunk's batch as a bucket of that size would; fp16 head maps of
bench/postprocess.py, four sets cycled. K = 1 with pdl is the runtime's pair: the baseline. Printed: graph
replay, GPU median µs per round (two rounds, interleaved; `runtime`: the pair captured from one stream, as
the runtime does), and whether each split's detections are the baseline's, image by image, row by row.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_variants import nms_params  # noqa: E402
from postprocess import CONF, NC, chains, decode_site, head_maps, object_classes, queued_gpu_us, typed_maps  # noqa: E402

from deepjit_compiler.jit.nvrtc import compile_site_kernel  # noqa: E402
from deepjit_compiler.runtime import gpu as gpu_mod  # noqa: E402
from deepjit_compiler.surgery.references import NMS_OUTPUTS  # noqa: E402

WAYS = ("pdl", "plain", "prio", "prio-pdl-last")
DECODE = {"mode": "candidates", "conf_threshold": CONF, "anchors_per_thread": 1, "lanes_per_anchor": 4,
          "large_batch_lanes": 2}


def chunk_maps(maps: list[dict[str, np.ndarray]], chunks: int) -> list[list[dict[str, np.ndarray]]]:
    """Each level's maps cut along the batch into `chunks` equal parts: one list of levels a chunk."""
    batch = len(maps[0]["cls"])
    if chunks < 1 or batch % chunks:
        raise ValueError(f"a batch of {batch} does not split into {chunks} equal chunks")
    size = batch // chunks
    return [[{k: np.ascontiguousarray(v[c * size:(c + 1) * size]) for k, v in lv.items()} for lv in maps]
            for c in range(chunks)]


def joined(outs: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The chunks' nms outputs as one batch's, in chunk order."""
    return {k: np.concatenate([o[k] for o in outs]) for k in NMS_OUTPUTS}


class Split:
    """One graph over K chains (a chunk each): fork, each chunk's decode -> nms the way asked, join."""

    def __init__(self, gpu, posts, way: str):
        from cuda.core import StreamOptions

        self.gpu, self.posts, self.way = gpu, posts, way
        least, greatest = gpu_mod._ck(gpu_mod.driver.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        make = lambda prio: gpu.device.create_stream(options=StreamOptions(nonblocking=True, priority=prio))  # noqa: E731
        self.decode_streams = [make(least) for _ in posts]
        self.nms_streams = [make(greatest) for _ in posts] if way.startswith("prio") else self.decode_streams
        self.events = [gpu.event() for _ in range(2 * len(posts) + 1)]
        flags = gpu_mod.driver.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
        self.graph = gpu.capture(self.body, int(flags) if way.startswith("prio") else 0)

    def body(self) -> None:
        drv, cc = gpu_mod.driver, gpu_mod._cc()
        handle = lambda s: drv.CUstream(int(s.handle))  # noqa: E731
        fork, *marks = self.events
        self.gpu.record(fork)
        last = len(self.posts) - 1
        for k, (post, ds, ns) in enumerate(zip(self.posts, self.decode_streams, self.nms_streams)):
            decode, nms = post.plan
            gpu_mod._ck(drv.cuStreamWaitEvent(handle(ds), fork, 0), "cuStreamWaitEvent")
            cc.launch(ds, decode.config, decode.function, *decode.args)
            early = self.way == "pdl" or (self.way == "prio-pdl-last" and k == last)
            stream = ds if early or self.way == "plain" else ns
            if stream is not ds:
                gpu_mod._ck(drv.cuEventRecord(marks[2 * k], handle(ds)), "cuEventRecord")
                gpu_mod._ck(drv.cuStreamWaitEvent(handle(stream), marks[2 * k], 0), "cuStreamWaitEvent")
            config = nms.config if early else self.gpu.launch_config(nms.config.grid, nms.config.block,
                                                                      nms.config.shmem_size)
            cc.launch(stream, config, nms.function, *nms.args)
            gpu_mod._ck(drv.cuEventRecord(marks[2 * k + 1], handle(stream)), "cuEventRecord")
            gpu_mod._ck(drv.cuStreamWaitEvent(self.gpu.cu_stream, marks[2 * k + 1], 0), "cuStreamWaitEvent")

    def results(self) -> dict[str, np.ndarray]:
        """One replay's detections, its outputs filled with 0xff first: the ways of one K share their chains, so
        what is read must be this graph's own."""
        for p in self.posts:
            for n in NMS_OUTPUTS:
                self.gpu.fill(p.tensors[n], 0xFF)
        self.graph.replay()
        return joined([p.results(NMS_OUTPUTS) for p in self.posts])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="K: the batch split into K chunks (K = 1, the baseline, runs whether named or not)")
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--nms", default="block=512,cluster=8,large_batch_cluster=2", metavar="param=int,...",
                    help="the nms's params over block 1024, chunk 512 (default: the H200 spec's, clusters of 2 from 16)")
    ap.add_argument("--object-classes", type=object_classes, default=NC)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)
    import torch  # queued_gpu_us holds the stream with torch's sleep kernel while it queues

    gpu = gpu_mod.Gpu()
    site = decode_site("fp16")
    decode = compile_site_kernel("yolov8_decode", DECODE, site.facts, sm=gpu.sm)
    nms = compile_site_kernel("nms", nms_params(args.nms), site.facts, sm=gpu.sm)
    for batch in args.batches:
        rng = np.random.default_rng(batch)
        sets = [typed_maps(head_maps(rng, batch, args.object_classes), "float16") for _ in range(4)]
        splits = {}
        for k in (c for c in dict.fromkeys([1, *args.chunks]) if batch % c == 0):  # the baseline first, always
            parts = [chunk_maps(m, k) for m in sets]  # parts[s][c]: chunk c of set s
            # chunk c of every set: one chain each, so a replay of set s runs its K chains
            per_chunk = [chains(gpu, [decode, nms], site, [p[c] for p in parts]) for c in range(k)]
            for way in (args.ways if k > 1 else ["pdl"]):
                splits[(k, way)] = [Split(gpu, [pc[s] for pc in per_chunk], way) for s in range(len(sets))]
        pair = [gpu.capture(p.launch) for p in chains(gpu, [decode, nms], site, sets)]  # as the runtime captures it
        graphs = {(1, "runtime"): pair, **{key: [s.graph for s in ss] for key, ss in splits.items()}}
        rounds = {key: [] for key in graphs}
        for _ in range(2):
            for key, gs in graphs.items():
                step = lambda i, gs=gs: gs[i % len(gs)].replay()  # noqa: E731
                rounds[key].append(float(np.median(queued_gpu_us(gpu, torch, step, args.iters))))
        base = splits[(1, "pdl")][0].results()
        for (k, way), r in rounds.items():
            if way == "runtime":
                print(f"b{batch} K=1 {way:14s} graph {' '.join(f'{u:5.1f}' for u in r)}   (the pair in one stream)")
                continue
            out = splits[(k, way)][0].results()  # set 0, as the baseline's
            same = all(np.array_equal(out[n], base[n]) for n in NMS_OUTPUTS)
            print(f"b{batch} K={k} {way:14s} graph {' '.join(f'{u:5.1f}' for u in r)}   "
                  f"detections {out['num_dets'].ravel().tolist()[:4]}{'' if same else ' (NOT the baseline' + chr(39) + 's)'}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
