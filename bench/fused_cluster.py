"""Write a yolov8_decode variant whose mode nms runs each image's NMS on its last cluster of decode blocks
(a bench experiment, not a test).

    python3 bench/fused_cluster.py OUT_DIR
    python3 bench/postprocess.py --decode-contract OUT_DIR/yolov8_decode.yaml --fused --fused-block 512 \\
        --fused-chunk 512 --fused-cluster 8 4 ...

The shipped contract, its template and headers copied to OUT_DIR, with a param `cluster` (1, 2, 4, 8) that,
above 1 in mode nms, launches the decode's blocks as thread block clusters of that many (sm_90+; each
image's blocks padded to a multiple of it). After its candidates, a cluster meets at a cluster barrier, its
first block counts the cluster done in blocks_done[b] with one acq_rel atomic, and the cluster that brings
the count to the image's clusters runs the NMS as the nms kernel's cluster path does (dj_nms::nms_image with
CL blocks, each a share of the class groups). Shipped mode nms runs the NMS on one last block, so every
decode block carries a whole NMS block's registers and shared memory (bench/RESULTS.md, 2026-12-02); here
the blocks are the nms cluster's 512 threads, and the handover is a cluster barrier and an atomic, not the
second launch and its wait (issue 17 item 3: batch 1 is a chain of launches and dependent steps). Measured
exact and slower than the two kernels at every batch (bench/RESULTS.md, 2026-12-08 session 36), so not shipped.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_edits import write_decode_variant  # noqa: E402

SHIPPED_END = """    dj_nms::nms_image<MAX_DET, AGNOSTIC>(b, gridDim.y, cand_count, cand_boxes, cand_scores, cand_classes, cand_index,
                                         capacity, workspace, ws_stride, num_dets, boxes, scores, classes);
}
"""
CLUSTER_KERNEL = """
// bench/fused_cluster.py: the decode's blocks in clusters of CL; the last cluster of each image to finish
// runs that image's NMS on its CL blocks (the nms kernel's cluster path).
template <typename T, int P, int MAX_DET, bool AGNOSTIC, int CL>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(dj_decode::BLOCK, dj_decode::BLOCK <= 512 ? 2 : 1)
deepjit_yolov8_decode_nms_cluster(
{{ kernel_args() }}
    int* __restrict__ cand_count, float* __restrict__ cand_boxes, float* __restrict__ cand_scores,
    int* __restrict__ cand_classes, int* __restrict__ cand_index, int capacity, int* __restrict__ blocks_done,
    unsigned char* __restrict__ workspace, int ws_stride,
    int* __restrict__ num_dets, float* __restrict__ boxes, float* __restrict__ scores, int* __restrict__ classes)
{
    using namespace dj_decode;
{{ make_args() }}
    append_candidates<P>(args, cand_count, cand_boxes, cand_scores, cand_classes, cand_index, capacity);
    __shared__ int s_last;
    const int b = blockIdx.y;
    const unsigned rank = blockIdx.x % CL;
    __syncwarp();  // the aligned cluster barrier below wants whole warps (the candidates' loops diverge)
    deepjit::cluster_arrive();  // release: this thread's candidate stores
    deepjit::cluster_wait();    // acquire: the whole cluster's
    if (rank == 0 && threadIdx.x == 0) {
        // acq_rel: releases the cluster's candidates (acquired above) to the cluster that counts last, and
        // acquires every earlier cluster's for this one
        int done;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(done) : "l"(blocks_done + b) : "memory");
        const int last = done == (int)(gridDim.x / CL) - 1;
        if (last) blocks_done[b] = 0;  // every cluster of image b has counted: ready for the next launch
        for (unsigned r = 0; r < CL; ++r)  // each block's s_last, before the barrier that releases it
            asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(deepjit::shared_rank(&s_last, r)), "r"(last)
                         : "memory");
    }
    __syncwarp();  // thread 0's branch rejoins its warp before the aligned barrier
    deepjit::cluster_arrive();
    deepjit::cluster_wait();
    if (!s_last) return;  // the same in every block of the cluster
    dj_nms::nms_image<MAX_DET, AGNOSTIC, CL>(b, gridDim.y, cand_count, cand_boxes, cand_scores, cand_classes,
                                             cand_index, capacity, workspace, ws_stride, num_dets, boxes, scores,
                                             classes, rank);
}
"""
TEMPLATE_EDITS = [(SHIPPED_END, SHIPPED_END + CLUSTER_KERNEL)]
CONTRACT_EDITS = [
    ("  block: {type: int, default: 128",
     '  cluster: {type: int, default: 1, allowed: [1, 2, 4, 8], doc: "mode nms: blocks a cluster; the last runs the NMS"}\n'
     "  block: {type: int, default: 128"),
    ('symbol: "deepjit_yolov8_decode_{{ mode }}<',
     "symbol: \"deepjit_yolov8_decode_{{ mode }}{{ '_cluster' if mode == 'nms' and cluster > 1 }}<"),
    ("{{ 'true' if agnostic else 'false' }}{% endif %}>\"",
     "{{ 'true' if agnostic else 'false' }}{{ ', %d' % cluster if cluster > 1 }}{% endif %}>\""),
    ('grid: ["ceil_div(A * lanes_per_anchor, anchors_per_thread * block)", B]',
     'grid: ["ceil_div(ceil_div(A * lanes_per_anchor, anchors_per_thread * block), cluster) * cluster", B]'),
]


def write_variant(out: Path) -> Path:
    """The variant's contract folder at `out`; returns its contract's path."""
    return write_decode_variant(out, TEMPLATE_EDITS, CONTRACT_EDITS)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(write_variant(Path(sys.argv[1])))
