// Benchmark (not a test): how fast the YOLOv8 decode's class maps can be read, by access pattern.
//
//     nvcc -O3 -arch=sm_90 -std=c++17 -I templates -o /tmp/decode_reads bench/decode_reads.cu && /tmp/decode_reads
//
// The maps are those of a 640x640 input with 80 classes in fp16: per level, cls [B, 80, H, W] for H = W =
// 80, 40, 20, four sets cycled through (as bench/postprocess.py does). Each kernel finds every anchor's
// best class and its index, and stores only past an impossible threshold, so what is timed is the reads:
//   stream         every byte once with 16-byte loads, the ceiling
//   lanes4 (main)  yolov8_decode's lanes_per_anchor 4: 8 anchors a warp, each lane a quarter of the classes
//   rows8          8 anchors a thread (one 16-byte load per class), all classes: anchors_per_thread 8
//   warpsplit      SPLIT warps a block over 32 * APL anchors, warp w a 1/SPLIT share of the classes, each
//                  lane APL anchors (a warp reads 64 * APL contiguous bytes of a class row); the parts
//                  meet in shared memory
//   lanes pP aplV  P parts of 32 / P lanes a warp, each lane V consecutive anchors, part q a 1/P share of the
//                  classes (a warp load reads P rows, 64 / P * V contiguous bytes each); the parts merge in
//                  shuffles, no barrier (lanes p4 apl1 is main's pattern again)
// Printed per batch: µs a kernel in a graph of 20 (so launch gaps, not the graph launch, are included)
// and the class bytes over that time. bench/RESULTS.md has runs (2026-12-02 session 7, 2026-12-03 session 10).
#include <cuda_fp16.h>
#include "deepjit_common.cuh"
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

enum { NC = 80, NL = 3 };
struct Maps { const __half* cls[NL]; int hw[NL]; int off[NL]; int A; };
__device__ int g_sink;

__device__ __forceinline__ void level_of(const Maps& m, int b, int a, const __half*& base, int& p, int& cs) {
    const bool l0 = a < m.off[1], l1 = !l0 && a < m.off[2];
    const int off = l0 ? 0 : (l1 ? m.off[1] : m.off[2]);
    cs = l0 ? m.hw[0] : (l1 ? m.hw[1] : m.hw[2]);
    p = a - off;
    base = (l0 ? m.cls[0] : (l1 ? m.cls[1] : m.cls[2])) + (size_t)b * NC * cs;
}

// The current 4-lane pattern: 8 anchors a warp, lane part = lane >> 3 reads classes [20 part, +20).
__global__ void __launch_bounds__(128) k_lanes4(Maps m, float thr) {
    const int b = blockIdx.y, lane = threadIdx.x & 31, part = lane >> 3;
    const int a = (blockIdx.x * 128 + threadIdx.x) / 32 * 8 + (lane & 7);
    const __half* base; int p, cs;
    level_of(m, b, min(a, m.A - 1), base, p, cs);
    float best = -1e30f; int arg = 0;
#pragma unroll
    for (int k = 0; k < 20; ++k) {
        float v;
        deepjit::load_vec<1>(base + (size_t)(part * 20 + k) * cs + p, &v);
        if (v > best) { best = v; arg = part * 20 + k; }
    }
#pragma unroll
    for (int d = 8; d <= 16; d *= 2) {
        const float ob = __shfl_xor_sync(~0u, best, d);
        const int oa = __shfl_xor_sync(~0u, arg, d);
        if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
    }
    if (a < m.A && best > thr) atomicAdd(&g_sink, arg);
}

// 8 anchors a thread (one 16-byte load per class), every class: the V=8 lanes=1 pattern.
template <int UNROLL>
__global__ void __launch_bounds__(128) k_rows8(Maps m, float thr) {
    const int b = blockIdx.y;
    const int a0 = (blockIdx.x * 128 + threadIdx.x) * 8;
    if (a0 >= m.A) return;
    const __half* base; int p, cs;
    level_of(m, b, a0, base, p, cs);
    float best[8]; int arg[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) { best[j] = -1e30f; arg[j] = 0; }
#pragma unroll UNROLL
    for (int c = 0; c < NC; ++c) {
        float v[8];
        deepjit::load_vec<8>(base + (size_t)c * cs + p, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) if (v[j] > best[j]) { best[j] = v[j]; arg[j] = c; }
    }
    int s = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += best[j] > thr ? arg[j] : 0;
    if (s) atomicAdd(&g_sink, s);
}

// Class parts across warps: a block of SPLIT warps covers a tile of 32 * APL anchors of one level;
// warp w reads classes [w * NC / SPLIT, +NC / SPLIT) with one APL * 2-byte load per class and lane
// (the warp reads 64 * APL contiguous bytes a class); partial maxima meet in shared memory.
template <int APL, int SPLIT>
__global__ void __launch_bounds__(32 * SPLIT) k_warpsplit(Maps m, float thr, int t1, int t2) {
    enum { TILE = 32 * APL, PER = NC / SPLIT };
    __shared__ float s_best[SPLIT][TILE];
    __shared__ int s_arg[SPLIT][TILE];
    const int b = blockIdx.y, t = blockIdx.x;
    const int l = t < t1 ? 0 : (t < t2 ? 1 : 2);
    const int tile = t - (l == 0 ? 0 : (l == 1 ? t1 : t2));
    const int cs = l == 0 ? m.hw[0] : (l == 1 ? m.hw[1] : m.hw[2]);
    const __half* base = (l == 0 ? m.cls[0] : (l == 1 ? m.cls[1] : m.cls[2])) + (size_t)b * NC * cs;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int p = tile * TILE + lane * APL;
    float best[APL]; int arg[APL];
#pragma unroll
    for (int j = 0; j < APL; ++j) { best[j] = -1e30f; arg[j] = 0; }
    if (p < cs) {
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const int c = w * PER + k;
            float v[APL];
            deepjit::load_vec<APL>(base + (size_t)c * cs + p, v);
#pragma unroll
            for (int j = 0; j < APL; ++j) if (v[j] > best[j]) { best[j] = v[j]; arg[j] = c; }
        }
    }
#pragma unroll
    for (int j = 0; j < APL; ++j) { s_best[w][lane * APL + j] = best[j]; s_arg[w][lane * APL + j] = arg[j]; }
    __syncthreads();
    for (int i = threadIdx.x; i < TILE; i += 32 * SPLIT) {
        float bb = s_best[0][i]; int aa = s_arg[0][i];
#pragma unroll
        for (int k = 1; k < SPLIT; ++k) if (s_best[k][i] > bb) { bb = s_best[k][i]; aa = s_arg[k][i]; }
        if (tile * TILE + i < cs && bb > thr) atomicAdd(&g_sink, aa);
    }
}

// PARTS parts of 32 / PARTS lanes a warp, each lane APL consecutive anchors: the warp covers
// 32 / PARTS * APL anchors, part q reads classes [q * NC / PARTS, +NC / PARTS) (a warp load reads PARTS
// rows, 64 / PARTS * APL contiguous bytes each), and the parts merge in shuffles: no barrier.
template <int PARTS, int APL>
__global__ void __launch_bounds__(128) k_lanes(Maps m, float thr) {
    enum { LP = 32 / PARTS, PER = NC / PARTS, SPAN = LP * APL };
    const int b = blockIdx.y, lane = threadIdx.x & 31, part = lane / LP;
    const int a0 = (blockIdx.x * 4 + threadIdx.x / 32) * SPAN + (lane % LP) * APL;
    const __half* base; int p, cs;
    level_of(m, b, min(a0, m.A - APL), base, p, cs);
    float best[APL]; int arg[APL];
#pragma unroll
    for (int j = 0; j < APL; ++j) { best[j] = -1e30f; arg[j] = 0; }
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int c = part * PER + k;
        float v[APL];
        deepjit::load_vec<APL>(base + (size_t)c * cs + p, v);
#pragma unroll
        for (int j = 0; j < APL; ++j) if (v[j] > best[j]) { best[j] = v[j]; arg[j] = c; }
    }
#pragma unroll
    for (int d = LP; d < 32; d *= 2) {
#pragma unroll
        for (int j = 0; j < APL; ++j) {
            const float ob = __shfl_xor_sync(~0u, best[j], d);
            const int oa = __shfl_xor_sync(~0u, arg[j], d);
            if (ob > best[j] || (ob == best[j] && oa < arg[j])) { best[j] = ob; arg[j] = oa; }
        }
    }
    int s = 0;
#pragma unroll
    for (int j = 0; j < APL; ++j) s += a0 + j < m.A && best[j] > thr ? arg[j] : 0;
    if (part == 0 && s) atomicAdd(&g_sink, s);
}

// Every byte of the class maps read once with 16-byte loads (the ceiling).
__global__ void k_stream(Maps m, int B, float thr) {
    float acc = -1e30f;
#pragma unroll
    for (int l = 0; l < NL; ++l) {
        const uint4* q = reinterpret_cast<const uint4*>(m.cls[l]);
        const size_t n = (size_t)B * NC * m.hw[l] / 8;
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
            const uint4 r = __ldg(q + i);
            const __half2* h = reinterpret_cast<const __half2*>(&r);
#pragma unroll
            for (int k = 0; k < 4; ++k) acc = fmaxf(acc, fmaxf(__low2float(h[k]), __high2float(h[k])));
        }
    }
    if (acc > thr) atomicAdd(&g_sink, 1);
}

__global__ void fill(__half* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
        p[i] = __float2half(-6.0f + (x & 0xffff) / 65536.0f * 4.0f);
    }
}

template <typename F>
float time_graph(F launch, int sets, int reps) {
    cudaStream_t s; CK(cudaStreamCreate(&s));
    cudaGraph_t g; cudaGraphExec_t ge;
    for (int k = 0; k < 3; ++k) for (int i = 0; i < sets; ++i) launch(s, i);
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int r = 0; r < 20; ++r) launch(s, r % sets);
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaStreamSynchronize(s));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0, s));
    for (int r = 0; r < reps; ++r) CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g)); CK(cudaStreamDestroy(s));
    return ms * 1e3f / (20 * reps);
}

int main() {
    const int H[NL] = {80, 40, 20};
    const int SETS = 4;
    for (int B : {1, 8, 32}) {
        std::vector<Maps> maps(SETS);
        std::vector<__half*> bufs;
        size_t bytes = 0;
        for (int s = 0; s < SETS; ++s) {
            int off = 0;
            for (int l = 0; l < NL; ++l) {
                const size_t n = (size_t)B * NC * H[l] * H[l];
                __half* p; CK(cudaMalloc(&p, n * 2));
                fill<<<1024, 256>>>(p, n, 77u * s + l + 1000u * B);
                bufs.push_back(p);
                maps[s].cls[l] = p; maps[s].hw[l] = H[l] * H[l]; maps[s].off[l] = off; off += H[l] * H[l];
                if (s == 0) bytes += n * 2;
            }
            maps[s].A = off;
        }
        CK(cudaDeviceSynchronize());
        const int A = maps[0].A;
        const float thr = 1e30f;
        auto report = [&](const char* name, float us) {
            printf("b%-2d %-22s %7.2f us  %6.0f GB/s\n", B, name, us, bytes / (us * 1e3));
        };
        report("empty", time_graph([&](cudaStream_t s, int i) { k_stream<<<1, 32, 0, s>>>(maps[i], 0, thr); }, SETS, 20));
        report("stream", time_graph([&](cudaStream_t s, int i) { k_stream<<<132 * 8, 256, 0, s>>>(maps[i], B, thr); }, SETS, 20));
        report("lanes4 (main)", time_graph([&](cudaStream_t s, int i) {
            k_lanes4<<<dim3((A * 4 + 127) / 128, B), 128, 0, s>>>(maps[i], thr); }, SETS, 20));
        report("rows8 unroll8", time_graph([&](cudaStream_t s, int i) {
            k_rows8<8><<<dim3((A / 8 + 127) / 128, B), 128, 0, s>>>(maps[i], thr); }, SETS, 20));
        report("rows8 unroll16", time_graph([&](cudaStream_t s, int i) {
            k_rows8<16><<<dim3((A / 8 + 127) / 128, B), 128, 0, s>>>(maps[i], thr); }, SETS, 20));
#define LN(PARTS, APL) do { \
            const int span = 32 / PARTS * APL, warps = (A + span - 1) / span; \
            report("lanes p" #PARTS " apl" #APL, time_graph([&](cudaStream_t s, int i) { \
                k_lanes<PARTS, APL><<<dim3((warps + 3) / 4, B), 128, 0, s>>>(maps[i], thr); }, SETS, 20)); \
        } while (0)
        LN(4, 1); LN(4, 2); LN(4, 4); LN(8, 2); LN(8, 4); LN(2, 1); LN(2, 2); LN(2, 4); LN(1, 1); LN(1, 2); LN(1, 4);
#define WS(APL, SPLIT) do { \
            const int T = 32 * APL; const int t0 = (6400 + T - 1) / T, t1 = (1600 + T - 1) / T, t2 = (400 + T - 1) / T; \
            report("warpsplit apl" #APL " w" #SPLIT, time_graph([&](cudaStream_t s, int i) { \
                k_warpsplit<APL, SPLIT><<<dim3(t0 + t1 + t2, B), 32 * SPLIT, 0, s>>>(maps[i], thr, t0, t0 + t1); }, SETS, 20)); \
        } while (0)
        WS(2, 8); WS(2, 4);
        for (auto p : bufs) CK(cudaFree(p));
    }
    return 0;
}
