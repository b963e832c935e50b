// Shared device helpers for DeepJIT's kernels (plain CUDA C++, not a Jinja template).
//
// Arithmetic that must round exactly like an ONNX graph evaluated op by op uses the _rn
// intrinsics: they are never contracted into FMAs, whatever the compile options.
#pragma once
#include <cuda_fp16.h>

namespace deepjit {

// Constants are enumerators or functions, never namespace-scope variables: NVRTC names those
// (internal linkage) with a per-compile unique id, which would make the cubin differ on each build.
enum : unsigned { kFullMask = 0xffffffffu };

// Shared memory one block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin) on the arch being
// compiled for; 48 KiB, the limit without opting in, for any other. The runtime opts in to the
// contract's shared_mem and checks the GPU it runs on (PTX may run on a GPU with less).
enum : int {
#if __CUDA_ARCH__ >= 1200
    kMaxSharedOptin = 99 * 1024,
#elif __CUDA_ARCH__ >= 900
    kMaxSharedOptin = 227 * 1024,
#elif __CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870
    kMaxSharedOptin = 163 * 1024,
#elif __CUDA_ARCH__ >= 860
    kMaxSharedOptin = 99 * 1024,
#elif __CUDA_ARCH__ == 750
    kMaxSharedOptin = 64 * 1024,
#else
    kMaxSharedOptin = 48 * 1024,
#endif
};

// Programmatic dependent launch (sm_90 and newer; no-ops before). A kernel whose contract entry says
// `overlaps_previous` is launched while the previous kernel in the stream still runs, and calls
// wait_previous() before touching memory that kernel writes: it returns once that grid has finished
// and its writes are visible. start_next() lets the next such launch begin early.
__device__ __forceinline__ void wait_previous() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void start_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Thread block clusters (sm_90 and newer; a kernel compiled for an older SM never calls these: dj_nms
// asserts its cluster is 1 there). Every thread of every block calls a cluster_arrive and cluster_wait()
// in turn; cluster_wait() returns once every block has arrived (acquiring what a release arrive released).
// Blocks hand each other words through mbarriers, without fences: the owner sets one up and says how many
// bytes will arrive (mbar_expect), a relaxed cluster arrive and wait pass that on, the senders store_rank()
// into its shared memory (each store counts its bytes on the owner's mbarrier when it lands), and the
// owner's mbar_wait() returns once they all have.
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// The address of p's shared-memory word in block `rank` of the cluster.
__device__ __forceinline__ unsigned shared_rank(const void* p, unsigned rank) {
    unsigned remote = 0u;
#if __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
#endif
    return remote;
}
// One mbarrier phase that completes once `bytes` have landed (the owner's own arrival is made here).
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    const unsigned at = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n\t"
                 "fence.mbarrier_init.release.cluster;\n\t"
                 "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(at), "r"(bytes) : "memory");
#endif
}
// v to p's word in block `rank`, counted on that block's `bar` when it lands.
__device__ __forceinline__ void store_rank(const unsigned* p, unsigned rank, unsigned v, const unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 :: "r"(shared_rank(p, rank)), "r"(v), "r"(shared_rank(bar, rank)) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar) {  // its first phase
#if __CUDA_ARCH__ >= 900
    const unsigned at = (unsigned)__cvta_generic_to_shared(bar);
    unsigned done = 0u;
    do {
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\t"
                     "selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(at) : "memory");
    } while (!done);
#endif
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

__device__ __forceinline__ void store_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f(__half* p, float v) { *p = __float2half_rn(v); }

// 1 / (1 + exp(-x)) with IEEE division, as ONNX Sigmoid.
__device__ __forceinline__ float sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

// Load V consecutive elements as floats, in one vector access where V * sizeof(T) allows.
// The caller guarantees alignment to V * sizeof(T) bytes.
template <int V> __device__ __forceinline__ void load_vec(const float* __restrict__ p, float* o);
template <> __device__ __forceinline__ void load_vec<1>(const float* __restrict__ p, float* o) { o[0] = __ldg(p); }
template <> __device__ __forceinline__ void load_vec<2>(const float* __restrict__ p, float* o) {
    const float2 t = __ldg(reinterpret_cast<const float2*>(p));
    o[0] = t.x; o[1] = t.y;
}
template <> __device__ __forceinline__ void load_vec<4>(const float* __restrict__ p, float* o) {
    const float4 t = __ldg(reinterpret_cast<const float4*>(p));
    o[0] = t.x; o[1] = t.y; o[2] = t.z; o[3] = t.w;
}
template <> __device__ __forceinline__ void load_vec<8>(const float* __restrict__ p, float* o) {
    load_vec<4>(p, o);
    load_vec<4>(p + 4, o + 4);
}

template <int V> __device__ __forceinline__ void load_vec(const __half* __restrict__ p, float* o);
template <> __device__ __forceinline__ void load_vec<1>(const __half* __restrict__ p, float* o) {
    o[0] = __half2float(__ldg(p));
}
template <> __device__ __forceinline__ void load_vec<2>(const __half* __restrict__ p, float* o) {
    const __half2 t = __ldg(reinterpret_cast<const __half2*>(p));
    o[0] = __low2float(t); o[1] = __high2float(t);
}
template <> __device__ __forceinline__ void load_vec<4>(const __half* __restrict__ p, float* o) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
    o[0] = __low2float(h[0]); o[1] = __high2float(h[0]);
    o[2] = __low2float(h[1]); o[3] = __high2float(h[1]);
}
template <> __device__ __forceinline__ void load_vec<8>(const __half* __restrict__ p, float* o) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) { o[2 * k] = __low2float(h[k]); o[2 * k + 1] = __high2float(h[k]); }
}

// Store V consecutive floats, vectorized (caller guarantees V * 4-byte alignment).
template <int V> __device__ __forceinline__ void store_vec(float* __restrict__ p, const float* v);
template <> __device__ __forceinline__ void store_vec<1>(float* __restrict__ p, const float* v) { p[0] = v[0]; }
template <> __device__ __forceinline__ void store_vec<2>(float* __restrict__ p, const float* v) {
    *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
}
template <> __device__ __forceinline__ void store_vec<4>(float* __restrict__ p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
template <> __device__ __forceinline__ void store_vec<8>(float* __restrict__ p, const float* v) {
    store_vec<4>(p, v);
    store_vec<4>(p + 4, v + 4);
}

// IoU of two (x1, y1, x2, y2) boxes, op by op as docs/semantics.md:
// inter / (area1 + area2 - inter), every step rounded in fp32. iou_parts gives inter and the union.
__device__ __forceinline__ float2 iou_parts(float4 a, float4 b) {
    const float iw = fmaxf(0.0f, __fsub_rn(fminf(a.z, b.z), fmaxf(a.x, b.x)));
    const float ih = fmaxf(0.0f, __fsub_rn(fminf(a.w, b.w), fmaxf(a.y, b.y)));
    const float inter = __fmul_rn(iw, ih);
    const float area_a = __fmul_rn(__fsub_rn(a.z, a.x), __fsub_rn(a.w, a.y));
    const float area_b = __fmul_rn(__fsub_rn(b.z, b.x), __fsub_rn(b.w, b.y));
    return make_float2(inter, __fsub_rn(__fadd_rn(area_a, area_b), inter));
}

__device__ __forceinline__ float iou(float4 a, float4 b) {
    const float2 p = iou_parts(a, b);
    return __fdiv_rn(p.x, p.y);
}

// iou(a, b) > t without the division, from iou_parts (inter, uni), where the answer is plain: *sure says
// whether it is. The rounded quotient is > t exactly when inter / uni passes the midpoint between t and
// the next float. f = fma(-t, uni, inter) is inter - t * uni rounded once, so it has that difference's
// sign: f < 0 means the quotient is below t (disjoint boxes: inter 0). f > k * uni, k at least 16 times
// half an ulp of t, means it is past the midpoint. In between (a quotient within ~1e-6 of t), and where
// uni is tiny, huge, infinite or NaN, it is not sure: the division decides (iou_above).
__device__ __forceinline__ bool iou_decided(float2 parts, float t, bool& sure) {
    const float inter = parts.x, uni = parts.y;
    const bool in_range = uni > 0x1p-40f && uni < 0x1p100f;  // k * uni stays a normal float, -ftz or not
    const float f = fmaf(-t, uni, inter);
    const bool below = in_range & (f < 0.0f);
    const bool above = in_range & (f > __fmul_rn(__fmul_rn(fmaxf(t, 0x1p-60f), 0x1p-20f), uni));
    sure = below | above;
    return above;
}

// iou(a, b) > t, exactly, without the division where the answer is plain (iou_decided): a branch that
// almost no thread takes, so a warp testing 32 different pairs does not split on each pair's outcome.
__device__ __forceinline__ bool iou_above(float4 a, float4 b, float t) {
    const float2 p = iou_parts(a, b);
    bool sure;
    const bool above = iou_decided(p, t, sure);
    if (sure) return above;
    return __fdiv_rn(p.x, p.y) > t;
}

}  // namespace deepjit
