// Per-image greedy NMS by one thread block: the body of nms.cu.j2's kernel (contract kernels/nms.yaml)
// and of yolov8_decode.cu.j2's mode nms, where the decode's last block of an image runs it (one launch
// for the whole tail). Semantics: docs/semantics.md ("NMS").
//
// The including file defines, before including it:
//   DJ_NMS_BLOCK, DJ_NMS_SORT_CAP, DJ_NMS_CHUNK  the block size, sort_capacity and chunk (ints)
//   DJ_NMS_IOU, DJ_NMS_CONF                      iou_threshold and conf_threshold (float literals)
// The candidates are read through L2 (ld.global.cg), never the non-coherent read-only path: in the
// fused decode, other blocks of the same grid wrote them.
#pragma once
#include "deepjit_common.cuh"

// A named namespace, enumerators and functions: anonymous namespaces and constexpr variables get
// per-compile unique symbol names, and the cubin must be the same bytes on every build.
namespace dj_nms {

using u64 = unsigned long long;

// CHUNK: sorted candidates settled at once, WORDS: 32-bit words of a bitset over a chunk (and the most
// mask words a box has), WARPS: the block's warps; NB: buckets of the counting sorts (by score, by class);
// PAIRS_FLAT: the most same-class pairs a one-chunk image tests a thread per pair (mask_pairs; more take
// mask_groups' rows: past 4 pairs a thread, the pair search costs more than the rows' waits).
enum : int { BLOCK = DJ_NMS_BLOCK, SORT_CAP = DJ_NMS_SORT_CAP, CHUNK = DJ_NMS_CHUNK, WORDS = CHUNK / 32,
             WARPS = BLOCK / 32, NB = 256, PAIRS_FLAT = 4 * BLOCK,
             DYNAMIC_BYTES = CHUNK * (CHUNK / 8 + 28) };  // the chunk's shared memory: the contract's shared_mem
// The slot path (nms_image): up to SLOT_N candidates, when no class group has more than GCAP members, no
// score bucket more than BCAP, and every class is below NB (so a group is one class). Its per-candidate
// arrays (box 16, key 8, suppressors 8, class 4, ranks 4 bytes) live in the sort's shared memory, which
// caps SLOT_N at ~0.3 sort_capacity; its member lists (u16, [slot][group]: a warp's lanes, in different
// groups, read different banks) take 40 KiB of the chunk's, so below chunk 512 SLOT_N is 0 and every
// image takes the general path. The last warp has no candidate.
enum : int { GCAP = 64, BCAP = 16, SLOT_MEM = SORT_CAP * 12 / 40 / 32 * 32,
             SLOT_CAP = CHUNK < BLOCK - 32 ? (CHUNK < SLOT_MEM ? CHUNK : SLOT_MEM)
                                           : (BLOCK - 32 < SLOT_MEM ? BLOCK - 32 : SLOT_MEM),
             SLOT_N = DYNAMIC_BYTES >= NB * (GCAP + BCAP) * 2 ? SLOT_CAP : 0,
             SLOT_WORDS = SLOT_N > 0 ? SLOT_N / 32 : 1 };
static_assert(SLOT_WORDS <= WORDS, "nms: the slot path keeps its kept bits in the chunk's (s_kept32)");
// An image may take CL blocks, a thread block cluster (nms_image's CL; sm_90+): on the slot path block r of
// the cluster takes the rows and settle of the class groups g with g % CL == r (its own candidates listed
// after the member lists, in the chunk's shared memory), and the blocks hand each other their kept bits
// over distributed shared memory before each writes its own kept boxes; any other path is the first
// block's alone.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
enum : int { CLUSTERS = 1 };
#else
enum : int { CLUSTERS = 0 };
#endif
static_assert(SLOT_WORDS < 32, "nms: a cluster's block sends its kept words and count from one warp");
__device__ __forceinline__ float iou_threshold() { return DJ_NMS_IOU; }
__device__ __forceinline__ float conf_threshold() { return DJ_NMS_CONF; }
static_assert(BLOCK % 64 == 0 && BLOCK >= 128, "nms: block must be a multiple of 64, at least 128");
static_assert(WORDS >= 1 && WORDS <= 32, "nms: chunk must be 32 .. 1024 boxes (a group's words, one per lane)");

// bench/nms_profile.py compiles a copy with DJ_NMS_PROFILE defined: each DJ_NMS_MARK (after a barrier)
// then keeps the latest clock64() of the block's warps, and block 0 prints the steps' cycles on one
// launch in 64. The latest, not thread 0's: the compiler may read the clock before the barrier, and
// thread 0's reading would then be its own warp's arrival, not the step's end. Without it the marks
// are nothing.
#ifdef DJ_NMS_PROFILE
__device__ unsigned dj_nms_profile_launches;
#define DJ_NMS_MARK(k) \
    do { if ((threadIdx.x & 31) == 0) atomicMax(&s_prof[k], (unsigned long long)clock64()); } while (0)
#else
#define DJ_NMS_MARK(k) do {} while (0)
#endif

// bench/nms_floors.py compiles copies with DJ_NMS_STOP defined to 0..3: on the usual frame the block then
// leaves at that point, rank 0 resetting cand_count and writing num_dets, so that the graph time of the
// decode + each copy splits the pair's. 0: right after the decode's wait; 1: the same after the cluster's
// barrier (first_goes_on); 2: after the candidates' loads (`odd` keeps them: it is never true on real
// candidates); 3: after the counting pass. Without it, nothing.
#ifdef DJ_NMS_STOP
#pragma nv_diag_suppress 128  // the code past the stop is unreachable: that is the point
#define DJ_NMS_STOP_AT(k, dets, sync, odd)                                   \
    if constexpr (DJ_NMS_STOP == (k)) {                                      \
        if (odd) num_dets[b] = -2;                                           \
        if ((sync) && !first_goes_on<CL>(rank)) return;                      \
        if (tid == 0 && rank == 0) cand_count[b] = 0, num_dets[b] = (dets);  \
        return;                                                              \
    }
#else
#define DJ_NMS_STOP_AT(k, dets, sync, odd)
#endif

// Positive floats order like their bits; the inverted anchor index breaks ties toward the lower
// anchor. Keys are unique (anchors are), so the order is deterministic.
__device__ __forceinline__ u64 sort_key(float score, int anchor) {
    return ((u64)__float_as_uint(score) << 32) | (u64)(0xffffffffu - (unsigned)anchor);
}

// A bucket in [0, NB) that never decreases with the key: the score's float bits above
// conf_threshold's, shifted so that (conf_threshold, 1] spans the buckets (all NB of them: the shift
// comes from the largest offset, 1.0's bits - lo - 1; from the range itself it used half).
__device__ __forceinline__ int score_bucket(u64 key) {
    const unsigned lo = __float_as_uint(fmaxf(conf_threshold(), 0.0f));
    const int shift = max(0, 32 - __clz(0x3f800000u - lo - 1u) - 8);  // NB = 2^8
    return min(NB - 1, (int)(((unsigned)(key >> 32) - lo) >> shift));
}

// Does box a (class ca) suppress box b (class cb)? Computed in full for every pair, without early exits:
// a warp's lanes test different pairs, and a branch on each test (disjoint or not) split the warp on
// every test (ncu, a crowded frame: 1 lane of 29 in the IoU). Disjoint boxes have inter 0, which
// iou_above decides without the division.
template <bool AGNOSTIC>
__device__ __forceinline__ bool suppresses(float4 a, int ca, float4 b, int cb) {
    return (AGNOSTIC || ca == cb) & deepjit::iou_above(a, b, iou_threshold());
}

// The OR of v over the warp.
__device__ __forceinline__ unsigned warp_or(unsigned v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_or_sync(deepjit::kFullMask, v);
#else
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v |= __shfl_xor_sync(deepjit::kFullMask, v, d);
    return v;
#endif
}

// Bucket starts from bucket sizes, highest bucket first (one warp; NB = 32 lanes x 8). With `list`,
// also the non-empty buckets in that order, and their count in *count. With `pairs`, also each listed
// bucket's first pair: pairs[e] = the pairs s (s - 1) / 2 of the buckets listed before entry e (and
// pairs[count] = all of them), for mask_pairs.
__device__ __forceinline__ void bucket_starts(const int* size, int* start, int* list = nullptr, int* count = nullptr,
                                              int* pairs = nullptr) {
    const int lane = threadIdx.x & 31;
    int v[8], own = 0, used = 0, twos = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        own += v[k] = size[8 * lane + k];
        used += v[k] > 0;
        twos += v[k] * (v[k] - 1) / 2;
    }
    int above = own, later = used, pairs_above = twos;  // sums over lanes >= this one, then over lanes > it
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
        const int t = __shfl_down_sync(deepjit::kFullMask, above, d);
        const int u = __shfl_down_sync(deepjit::kFullMask, later, d);
        const int w = pairs != nullptr ? __shfl_down_sync(deepjit::kFullMask, pairs_above, d) : 0;
        if (lane + d < 32) {
            above += t;
            later += u;
            pairs_above += w;
        }
    }
    if (lane == 0 && count != nullptr) *count = later;
    if (lane == 0 && pairs != nullptr) pairs[later] = pairs_above;
    above -= own;
    later -= used;
    pairs_above -= twos;
#pragma unroll
    for (int k = 7; k >= 0; --k) {
        start[8 * lane + k] = above;
        above += v[k];
        if (list != nullptr && v[k] > 0) {
            if (pairs != nullptr) pairs[later] = pairs_above;
            pairs_above += v[k] * (v[k] - 1) / 2;
            list[later++] = 8 * lane + k;
        }
    }
}

// The suppressor masks of a chunk grouped by class (gb, gc: the boxes and classes, each group a run of
// positions in score order from its start): bit c of word w of the box at position p, cols[w * CHUNK + p],
// is set when member 32 w + c of p's group, which comes before p, suppresses it. SPLIT adjacent lanes
// share a box, each testing every SPLIT-th earlier member, in as many rounds of BLOCK / SPLIT boxes as
// the chunk needs: a row is as long as its box's place in the group (a crowd of one class: 284 tests
// for the last of 285), and the block waits on its longest, so 4 lanes a box in two rounds beat 2 in
// one (bench/RESULTS.md, 2026-12-02 session 9). A warp's boxes read each member together (one broadcast
// load). Each word has one writer: nothing is zeroed.
template <int SPLIT, bool AGNOSTIC>
__device__ __forceinline__ void mask_groups(int m, const float4* gb, const int* gc, const int* gstart, unsigned* cols) {
    const int part = threadIdx.x % SPLIT;
    const int rows = (m * SPLIT + BLOCK - 1) / BLOCK;  // the same trip count in every thread: shuffles below
    for (int r = 0; r < rows; ++r) {
        const int p = threadIdx.x / SPLIT + r * (BLOCK / SPLIT);
        const int q = min(p, m - 1);
        const float4 bp = gb[q];
        const int cp = gc[q];
        const int first = gstart[AGNOSTIC ? 0 : cp & (NB - 1)];
        const int k = p < m ? p - first : 0;  // p's place in its group: the members before it
        int words = (k + 31) >> 5;
        int most = words;
#pragma unroll
        for (int d = 1; d < 32; d *= 2) most = max(most, __shfl_xor_sync(deepjit::kFullMask, most, d));
        for (int w = 0; w < most; ++w) {
            unsigned bits = 0u;
            const int n = min(32, k - 32 * w);
#pragma unroll 4
            for (int c = part; c < n; c += SPLIT) {
                const int j = first + 32 * w + c;
                bits |= suppresses<AGNOSTIC>(gb[j], gc[j], bp, cp) ? 1u << c : 0u;
            }
#pragma unroll
            for (int d = 1; d < SPLIT; d *= 2) bits |= __shfl_xor_sync(deepjit::kFullMask, bits, d);
            if (part == 0 && w < words) cols[w * CHUNK + p] = bits;
        }
    }
}

// The same masks from a thread per same-group pair, for chunks with few pairs (mask_groups' rows are
// as long as a box's group, so its warps wait on their longest row): pair r of listed group e (its
// first pair pairs[e], bucket_starts) is members (u, v), v < u, r = u (u - 1) / 2 + v, and a
// suppressing pair sets bit v % 32 of word v / 32 of member u, by atomicOr: the words read later
// (w < (u + 31) / 32) must be zero before. The tests are few per thread and independent.
template <bool AGNOSTIC>
__device__ __forceinline__ void mask_pairs(int groups, const int* glist, const int* pairs, const int* gstart,
                                           const float4* gb, const int* gc, unsigned* cols) {
    int top = 1;  // the binary search's first step: a power of two >= groups
    while (top < groups) top <<= 1;
    const int total = pairs[groups];
    // Pairs q and q + BLOCK at once: their searches and tests are independent, and most images have a
    // little over BLOCK pairs, so a second pair no longer waits for the first.
    for (int q0 = threadIdx.x; q0 < total; q0 += 2 * BLOCK) {
        const int q[2] = {q0, min(q0 + BLOCK, total - 1)};
        int e[2] = {0, 0};  // the last listed group whose first pair is <= q
        for (int step = top >> 1; step > 0; step >>= 1) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
                if (e[i] + step < groups && pairs[e[i] + step] <= q[i]) e[i] += step;
        }
        bool hit[2];
        int word[2], bit[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = q[i] - pairs[e[i]];
            // then exact: u (u - 1) / 2 <= r < u (u + 1) / 2
            int u = (int)((1.0f + sqrtf(8.0f * (float)r + 1.0f)) * 0.5f);
            u -= u * (u - 1) / 2 > r;
            u += u * (u + 1) / 2 <= r;
            const int v = r - u * (u - 1) / 2, first = gstart[glist[e[i]]];
            hit[i] = suppresses<AGNOSTIC>(gb[first + v], gc[first + v], gb[first + u], gc[first + u]);
            word[i] = (v >> 5) * CHUNK + first + u;
            bit[i] = v & 31;
        }
        if (hit[0]) atomicOr(&cols[word[0]], 1u << bit[0]);
        if (hit[1] && q0 + BLOCK < total) atomicOr(&cols[word[1]], 1u << bit[1]);
    }
}

// The greedy outcome of a chunk grouped by class, a warp per group (groups are independent), from its
// masks (mask_groups): a lane per member, 32 members at a time in score order. A member is dropped when
// a member kept in an earlier 32 (or a box kept in an earlier chunk: gone32, by position) suppresses it;
// then the members of its 32 that suppress others of them are walked in order, each one still alive
// kept and dropping those it suppresses. Those are the only serial steps, usually a handful. A kept
// member sets bit gidx[p] (its place in the chunk's score order) of kept32.
__device__ __forceinline__ void settle_groups(const unsigned* cols, const int* glist, int groups, const int* gstart,
                                              const int* gsize, const int* gidx, const unsigned* gone32,
                                              unsigned* kept32) {
    const int lane = threadIdx.x & 31;
    for (int e = threadIdx.x >> 5; e < groups; e += WARPS) {
        const int g = glist[e], first = gstart[g], size = gsize[g];
        unsigned mine = 0u;  // lane t: the kept members 32 t .. 32 t + 31
        for (int t = 0; 32 * t < size; ++t) {
            const int k = 32 * t + lane, p = first + k;
            unsigned hits = 0u;  // kept members of earlier 32s that suppress it (independent loads)
            for (int w = 0; w < t; ++w) {
                const unsigned kw = __shfl_sync(deepjit::kFullMask, mine, w);
                if (k < size) hits |= cols[w * CHUNK + p] & kw;
            }
            const bool gone = k >= size || ((gone32[p >> 5] >> (p & 31)) & 1u) || hits != 0u;
            const unsigned own = k < size && lane > 0 ? cols[t * CHUNK + p] : 0u;  // members of this 32 before it
            unsigned alive = __ballot_sync(deepjit::kFullMask, !gone);
            for (unsigned todo = alive & warp_or(own); todo != 0u; todo &= alive) {
                const int c = __ffs(todo) - 1;  // alive: no kept member suppresses it, so it is kept
                todo &= todo - 1u;
                alive &= ~__ballot_sync(deepjit::kFullMask, (own >> c) & 1u);
            }
            if (lane == t) mine = alive;
            if ((alive >> lane) & 1u) atomicOr(&kept32[gidx[p] >> 5], 1u << (gidx[p] & 31));
        }
    }
}

// The slot path's rows (nms_image): each candidate c < n with a key (fkey[c] != 0) against every member
// of its class group (gslot, by arrival), or each of the n candidates own[] lists (a cluster's block: its
// groups' candidates), 2^shift lanes a candidate, each taking every 2^shift-th member:
// sup[c] gets bit k when member k scores above c and suppresses it, info[c] c's place in its group's score
// order (bits 0-7), in its score bucket's (bslot; bits 8-15), and the bucket (16-23). The last warp, which
// has no candidate, finds the buckets' starts meanwhile, and the warp before it, where it has none either,
// lists the non-empty class groups for the settle (glist, *groups; gstart is its scratch).
__device__ __forceinline__ void slot_rows(int n, int shift, const int* own, const u64* fkey, const float4* fbox,
                                          const int* fcls, const unsigned short* gslot, const unsigned short* bslot,
                                          const int* gsize, const int* bsize, u64* sup_out, int* info_out,
                                          int* start, int* gstart, int* glist, int* groups) {
    const int tid = threadIdx.x, i = tid >> shift, step = 1 << shift, part = tid & (step - 1);
    const int c = i < n && own != nullptr ? own[i] : i;
    const u64 key = i < n ? fkey[c] : 0ull;
    u64 sup = 0ull;
    int above = 0, ahead = 0, bucket = 0;
    if (key != 0ull) {
        const float4 box = fbox[c];
        const int g = fcls[c], size = gsize[g];  // the slot path's classes are below NB: g is the class
        bucket = score_bucket(key);
        // Members share c's class, so a test is the IoU alone. Its rare undecided cases (iou_decided) wait
        // in `pend` until after the loop, so that the loop has no branch and its loads and tests overlap.
        u64 pend = 0ull;
#pragma unroll 4
        for (int k = part; k < size; k += step) {
            const int j = gslot[k * NB + g];
            const u64 bit = fkey[j] > key ? 1ull << k : 0ull;
            above += bit != 0ull;
            bool sure;
            const bool hit = deepjit::iou_decided(deepjit::iou_parts(fbox[j], box), iou_threshold(), sure);
            sup |= hit ? bit : 0ull;
            pend |= sure ? 0ull : bit;
        }
        for (; pend != 0ull; pend &= pend - 1ull) {
            const int k = __ffsll((long long)pend) - 1;
            if (deepjit::iou(fbox[gslot[k * NB + g]], box) > iou_threshold()) sup |= 1ull << k;  // the division decides
        }
        const int in_bucket = bsize[bucket];
        for (int k = part; k < in_bucket; k += step) ahead += fkey[bslot[k * NB + bucket]] > key;
    }
    for (int d = 1; d < step; d <<= 1) {
        sup |= __shfl_xor_sync(deepjit::kFullMask, sup, d);
        above += __shfl_xor_sync(deepjit::kFullMask, above, d);
        ahead += __shfl_xor_sync(deepjit::kFullMask, ahead, d);
    }
    if (key != 0ull && part == 0) {
        sup_out[c] = sup;
        info_out[c] = above | ahead << 8 | bucket << 16;
    }
    if (tid >= BLOCK - 32) bucket_starts(bsize, start);
    else if (tid >= BLOCK - 64 && (n << shift) <= BLOCK - 64) bucket_starts(gsize, gstart, glist, groups);
}

// The slot path's greedy outcome in class group g (size members), by one warp: members k and 32 + k in lane
// k. Members nothing above suppresses are kept, members a kept one suppresses are dropped, and only the
// rest (usually none) are walked in score order. A kept member sets the bit of its place in the image's
// score order (its bucket's start + its place in the bucket) in kept32, and *total counts them.
__device__ __forceinline__ void settle_group(int g, int size, const unsigned short* gslot, const u64* sup_in,
                                             const int* info_in, const int* start, unsigned* kept32, int* total) {
    const int lane = threadIdx.x & 31;
    u64 sup[2] = {0ull, 0ull};
    int info[2] = {0, 0};
    bool member[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        member[h] = 32 * h + lane < size;
        const int t = member[h] ? gslot[(32 * h + lane) * NB + g] : 0;
        if (member[h]) {
            sup[h] = sup_in[t];
            info[h] = info_in[t];
        }
    }
    u64 kept = __ballot_sync(deepjit::kFullMask, member[0] && sup[0] == 0ull) |
               (u64)__ballot_sync(deepjit::kFullMask, member[1] && sup[1] == 0ull) << 32;
    const bool open[2] = {member[0] && sup[0] != 0ull && (sup[0] & kept) == 0ull,
                          member[1] && sup[1] != 0ull && (sup[1] & kept) == 0ull};
    const u64 mark = (open[0] ? 1ull << (info[0] & 63) : 0ull) | (open[1] ? 1ull << (info[1] & 63) : 0ull);
    for (u64 walk = warp_or((unsigned)mark) | (u64)warp_or((unsigned)(mark >> 32)) << 32; walk != 0ull;
         walk &= walk - 1ull) {
        const int r = __ffsll((long long)walk) - 1;
        const u64 me = __ballot_sync(deepjit::kFullMask, open[0] && (info[0] & 63) == r) |
                       (u64)__ballot_sync(deepjit::kFullMask, open[1] && (info[1] & 63) == r) << 32;
        const int at = __ffsll((long long)me) - 1;
        if ((__shfl_sync(deepjit::kFullMask, at < 32 ? sup[0] : sup[1], at & 31) & kept) == 0ull) kept |= me;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (member[h] && ((kept >> (32 * h + lane)) & 1ull)) {
            const int r = start[(info[h] >> 16) & (NB - 1)] + ((info[h] >> 8) & 0xff);
            atomicOr(&kept32[r >> 5], 1u << (r & 31));
        }
    }
    if (lane == 0) atomicAdd(total, __popcll(kept));
}

// Every class group's settle_group: a warp per listed group (glist, when the rows step listed them: groups
// >= 0), else the groups g with g % WARPS == warp, so one warp may take three groups of an image's ~30 in
// turn (listing them took 0.3-0.7 µs off the nms at batch 1-32, bench/RESULTS.md 2026-12-03 session 13).
template <int CL>
__device__ __forceinline__ void slot_settle(const unsigned short* gslot, const int* gsize, const u64* sup_in,
                                            const int* info_in, const int* start, unsigned* kept32, int* total,
                                            const int* glist, int groups, int rank) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (groups >= 0) {
        for (int e = warp; e < groups; e += WARPS)
            if (CL == 1 || glist[e] % CL == rank)
                settle_group(glist[e], gsize[glist[e]], gslot, sup_in, info_in, start, kept32, total);
        return;
    }
    for (int g0 = warp; g0 < NB; g0 += 32 * WARPS) {
        const int mine = g0 + WARPS * lane < NB ? gsize[g0 + WARPS * lane] : 0;
        const bool ours = mine > 0 && (CL == 1 || (g0 + WARPS * lane) % CL == rank);
        for (unsigned groups = __ballot_sync(deepjit::kFullMask, ours); groups != 0u; groups &= groups - 1u) {
            const int i = __ffs(groups) - 1, g = g0 + WARPS * i, size = __shfl_sync(deepjit::kFullMask, mine, i);
            settle_group(g, size, gslot, sup_in, info_in, start, kept32, total);
        }
    }
}

// Whether the calling block goes on with a path that a cluster's first block takes alone (all but the slot
// path): every block first waits for the others (the arrive nms_image makes at its start), then arrives and
// waits once more, so the first block resets cand_count only after every block has read it.
template <int CL>
__device__ __forceinline__ bool first_goes_on(int rank) {
    if (CL == 1) return true;
    deepjit::cluster_wait();
    deepjit::cluster_arrive();
    deepjit::cluster_wait();
    return rank == 0;
}

// Bitonic sort of n (a power of two) (key, slot) pairs into descending key order, by the block.
// keys/slots are in shared memory, or in the global workspace when there are too many.
__device__ void bitonic_desc(u64* keys, int* slots, int n) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += BLOCK) {
                const int ixj = i ^ j;
                if (ixj > i) {
                    const u64 a = keys[i], c = keys[ixj];
                    if (((i & k) == 0) ? (a < c) : (a > c)) {
                        keys[i] = c;
                        keys[ixj] = a;
                        const int s = slots[i];
                        slots[i] = slots[ixj];
                        slots[ixj] = s;
                    }
                }
            }
            __syncthreads();
        }
    }
}


// Image b's count of kept boxes (written by thread 0) and its rows past it, zero.
template <int MAX_DET>
__device__ __forceinline__ void finish_rows(int tid, int b, int kept, int* num_dets, float4* out_box4, float* scores,
                                            int* classes) {
    if (tid == 0) num_dets[b] = kept;
    for (int i = kept + tid; i < MAX_DET; i += BLOCK) {
        const size_t o = (size_t)b * MAX_DET + i;
        out_box4[o] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        scores[o] = 0.0f;
        classes[o] = 0;
    }
}

// Image b of `images`, by the calling block (BLOCK threads). Reads cand_count[b] and resets it to 0
// for the next decode launch.
// 1. Sort by (score desc, anchor asc). Up to one candidate per thread (the usual case: a few
//    hundred): a counting pass puts the keys in score buckets, and each thread ranks its key against
//    its own bucket only. When they all fit in one chunk, the same passes group them by class (each
//    key ranked within its class too), and each candidate moves straight to its place in the grouped
//    chunk. More candidates take a bitonic sort of (key, slot) pairs, in shared memory up to
//    sort_capacity and in the global workspace beyond, and are grouped a chunk at a time.
// 2. Greedy NMS over the sorted candidates, CHUNK at a time, a chunk grouped by class (one group when
//    agnostic), each group in score order. Boxes suppressed by boxes kept from earlier chunks are
//    marked first. Each box is tested against the earlier members of its group only (torchvision's
//    bitmasks, in 32-bit words: a thread per same-class pair, mask_pairs, where one chunk holds them
//    all and the pairs are few; else a row per box, mask_groups), and each group settles in one warp
//    (settle_groups): greedy NMS never looks across classes. The kept boxes then go out in score order, up to max_det.
//    (All pairs in 32 x 32 tiles, settle rounds with a barrier each, and a class-blind walk of the
//    chunk were slower: bench/RESULTS.md, 2026-12-02 session 4.)
// The slot path replaces both where it can (class-aware, up to SLOT_N candidates, no class above GCAP
// boxes nor score bucket above BCAP: the usual frame): after the same counting pass, three block steps
// (rows, settle, output) instead of eight, ~1 µs less at batch 1 on the H200 (bench/RESULTS.md,
// 2026-12-03 session 11).
// With CL > 1 the calling block is block `rank` of image b's cluster of CL (see CLUSTERS above): the slot
// path's rows and settle take its share of the class groups, 1.2 µs less at batch 1 with 4 on the H200
// (bench/RESULTS.md, 2026-12-03 session 17).
template <int MAX_DET, bool AGNOSTIC, int CL = 1>
__device__ __forceinline__ void nms_image(
    int b, int images, int* cand_count, const float* cand_boxes, const float* cand_scores, const int* cand_classes,
    const int* cand_index, int K, unsigned char* workspace, int ws_stride,
    int* num_dets, float* boxes, float* scores, int* classes, int rank = 0)
{
    enum : int { STATIC_BYTES = SORT_CAP * 12 + MAX_DET * 20 + NB * 24 + WORDS * 8 + 24 +
                                (CL > 1 ? CL * (SLOT_WORDS + 1) * 4 + 16 : 0) };
    static_assert(STATIC_BYTES <= 48 * 1024,
                  "nms: sort_capacity * 12 + max_det * 20 bytes must fit in 42 KiB of static shared memory");
    static_assert(CL == 1 || CLUSTERS, "nms: cluster above 1 needs sm_90 or newer (thread block clusters)");
    static_assert(CL == 1 || CL == 2 || CL == 4 || CL == 8, "nms: cluster must be 1, 2, 4 or 8");
    static_assert(CL == 1 || (SLOT_N > 0 && DYNAMIC_BYTES >= NB * (GCAP + BCAP) * 2 + SLOT_CAP * 4),
                  "nms: cluster above 1 needs the slot path (chunk >= 512)");
    static_assert(STATIC_BYTES + DYNAMIC_BYTES <= deepjit::kMaxSharedOptin,
                  "nms: chunk * (chunk / 8 + 28) + sort_capacity * 12 + max_det * 20 bytes exceed the shared "
                  "memory a block may have on this target SM (deepjit::kMaxSharedOptin): lower chunk");
    __shared__ alignas(16) unsigned char s_sort[SORT_CAP * 12];  // keys + slots, or the ranked candidates
    __shared__ float4 s_kept_box[MAX_DET];  // kept so far, for the chunks after the first
    __shared__ int s_kept_cls[MAX_DET];
    __shared__ int s_size[NB], s_start[NB];  // score buckets of the sort: sizes and starts
    __shared__ int s_gsize[NB], s_gstart[NB], s_glist[NB];  // class groups of the chunk: sizes, starts, the non-empty
    __shared__ int s_gpairs[NB + 1];  // the listed groups' first pairs (one chunk: mask_pairs)
    __shared__ unsigned s_gone32[WORDS];  // chunk boxes suppressed by earlier chunks, by position
    __shared__ unsigned s_kept32[WORDS];  // chunk boxes kept, by place in score order (the slot path's too)
    __shared__ int s_valid, s_kept, s_groups;
    __shared__ int s_slot_over;  // a group or bucket of the slot path past its capacity, or a class past NB
    __shared__ int s_own;  // a cluster's block: its own candidates
    __shared__ unsigned s_from[CL][SLOT_WORDS + 1];  // a cluster's block: each other's kept words and count
    __shared__ unsigned long long s_pushed;  // a cluster's block: the others' words have landed (an mbarrier)
#ifdef DJ_NMS_PROFILE
    __shared__ unsigned long long s_prof[12];
    for (int k = threadIdx.x; k < 12; k += BLOCK) s_prof[k] = 0;
    __syncthreads();
#endif
    DJ_NMS_MARK(0);
    extern __shared__ float4 s_dynamic[];  // DYNAMIC_BYTES, carved below
    unsigned* s_cols = reinterpret_cast<unsigned*>(s_dynamic);  // mask_groups' words (first: group members)
    float4* s_chunk_box = reinterpret_cast<float4*>(s_cols + WORDS * CHUNK);  // a chunk grouped after the sort
    float* s_chunk_score = reinterpret_cast<float*>(s_chunk_box + CHUNK);
    int* s_chunk_cls = reinterpret_cast<int*>(s_chunk_score + CHUNK);
    int* s_gidx = s_chunk_cls + CHUNK;  // a grouped box's place in the chunk's score order

    const int tid = threadIdx.x;
    const size_t base = (size_t)b * K;
    const float4* cand_box4 = reinterpret_cast<const float4*>(cand_boxes);
    float4* out_box4 = reinterpret_cast<float4*>(boxes);
#ifdef DJ_NMS_STOP
    if constexpr (DJ_NMS_STOP == 0) deepjit::wait_previous();  // before the cluster's first arrive
#endif
    DJ_NMS_STOP_AT(0, 0, false, false)
    for (int k = tid; k < NB; k += BLOCK) s_size[k] = s_gsize[k] = 0;
    for (int k = tid; k < WORDS; k += BLOCK) s_gone32[k] = s_kept32[k] = 0u;
    if (tid == 0) s_kept = s_slot_over = 0, s_groups = -1;  // -1: the slot path's rows did not list the groups
    if (CL > 1) {  // the others may store into s_from once every block has arrived here (cluster_wait below)
        if (tid == 0) s_own = 0, deepjit::mbar_expect(&s_pushed, (CL - 1) * (SLOT_WORDS + 1) * 4);
        deepjit::cluster_arrive_relaxed();
    }
    deepjit::wait_previous();  // launched early on sm_90+: the decode's candidates are complete from here
                               // (a no-op when not launched early)
    DJ_NMS_STOP_AT(1, 0, true, false)
    const int found = __ldcg(cand_count + b);  // one broadcast load; reset by thread 0 after a barrier
    // A thread's candidate (the rank path's), loaded with the count rather than after it: slots past the
    // count are read (in bounds) and ignored.
    const bool in_buf = tid < K;
    const float score = in_buf ? __ldcg(cand_scores + base + tid) : 0.0f;
    const int anchor = in_buf ? __ldcg(cand_index + base + tid) : 0;
    const float4 box = in_buf ? __ldcg(cand_box4 + base + tid) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const int cls = in_buf ? __ldcg(cand_classes + base + tid) : 0;
    __syncthreads();  // zeroed before the counting atomics below, while the loads are in flight
    const int n = found < K ? found : K;
    DJ_NMS_STOP_AT(2, n, true, score == -1.0f || anchor == -1 || box.x == -12345.0f || cls == -1)
    DJ_NMS_MARK(1);
    const bool by_rank = n <= BLOCK && 2 * n <= SORT_CAP;
    const bool grouped = by_rank && n <= CHUNK;  // one chunk, grouped by class during the sort
    u64* keys = reinterpret_cast<u64*>(s_sort);
    u64* gkeys = keys + n;  // the keys again, bucketed by class (grouped)
    int* slots = reinterpret_cast<int*>(s_sort + SORT_CAP * sizeof(u64));
    // ranked candidates (rank path), written over the bucketed keys once every thread has its rank:
    // in score order, or grouped by class
    float4* r_box = reinterpret_cast<float4*>(s_sort);
    float* r_score = reinterpret_cast<float*>(s_sort + (size_t)16 * n);
    int* r_cls = reinterpret_cast<int*>(s_sort + (size_t)20 * n);
    int valid;
    if (by_rank) {
        // scores <= conf_threshold keep key 0 and are dropped
        const u64 key = tid < n && score > conf_threshold() ? sort_key(score, anchor) : 0ull;
        const int bucket = key != 0ull ? score_bucket(key) : 0;
        const int group = AGNOSTIC ? 0 : cls & (NB - 1);
        const int at = key != 0ull ? atomicAdd(&s_size[bucket], 1) : 0;
        const int at_group = grouped && key != 0ull ? atomicAdd(&s_gsize[group], 1) : 0;
        // The slot path: up to SLOT_N candidates in three steps (these counts; rows; settle) and the output,
        // against the sort, grouping, masks and settle below. Each class group and score bucket lists its
        // members in fixed slots, in arrival order, so nothing waits for their starts; a row tests every
        // member of the group, above or below, and the group's score order comes from the same loop. Where
        // a group has more than GCAP members or a bucket more than BCAP (a crowd), or a class is NB or more
        // (groups would mix classes), the lists are left and the path below goes on from the same counts.
        const bool slot_path = SLOT_N > 0 && !AGNOSTIC && n <= SLOT_N;  // then grouped too
        float4* f_box = reinterpret_cast<float4*>(s_sort);
        u64* f_key = reinterpret_cast<u64*>(f_box + SLOT_CAP);
        u64* f_sup = f_key + SLOT_CAP;
        int* f_cls = reinterpret_cast<int*>(f_sup + SLOT_CAP);
        int* f_info = f_cls + SLOT_CAP;
        unsigned short* f_gslot = reinterpret_cast<unsigned short*>(s_dynamic);
        unsigned short* f_bslot = f_gslot + NB * GCAP;
        int* f_own = reinterpret_cast<int*>(f_bslot + NB * BCAP);  // CL > 1: this block's candidates
        if (slot_path && tid < n) {
            f_key[tid] = key;
            if (key != 0ull) {
                f_box[tid] = box;
                f_cls[tid] = cls;
                if (at_group < GCAP) f_gslot[at_group * NB + group] = (unsigned short)tid;
                if (at < BCAP) f_bslot[at * NB + bucket] = (unsigned short)tid;
                if (at_group >= GCAP || at >= BCAP || (unsigned)cls >= (unsigned)NB) s_slot_over = 1;
                if (CL > 1 && group % CL == rank) f_own[atomicAdd(&s_own, 1)] = tid;
            }
        }
        valid = __syncthreads_count(key != 0ull);  // and the bucket sizes are complete
        DJ_NMS_MARK(2);
        DJ_NMS_STOP_AT(3, valid, true, false)
        const bool slots = slot_path && !s_slot_over;  // the same in every block of a cluster (same counts)
        if (!slots && !first_goes_on<CL>(rank)) return;
        if (tid == 0 && (CL == 1 || !slots)) cand_count[b] = 0;  // every thread has read it: the next decode
                                                                 // appends from zero
        if (slots) {
            // 4 lanes a candidate where they fit beside the last warp, else 2, else 1
            const int rows = CL > 1 ? s_own : n;
            const int shift = 4 * rows <= BLOCK - 32 ? 2 : 2 * rows <= BLOCK - 32 ? 1 : 0;
            slot_rows(rows, shift, CL > 1 ? f_own : nullptr, f_key, f_box, f_cls, f_gslot, f_bslot, s_gsize, s_size,
                      f_sup, f_info, s_start, s_gstart, s_glist, &s_groups);
            __syncthreads();
            DJ_NMS_MARK(3);
            slot_settle<CL>(f_gslot, s_gsize, f_sup, f_info, s_start, s_kept32, &s_kept, s_glist, s_groups, rank);
            __syncthreads();
            DJ_NMS_MARK(4);
            // The cluster's kept bits and count: each block stores its kept words and count in the others'
            // s_from[its rank], a lane a word, and once the others' have landed in its own, ORs them into
            // s_kept32 and adds them to s_kept.
            if (CL > 1) {
                deepjit::cluster_wait();  // every block's s_pushed is set up
                if (tid <= SLOT_WORDS) {
                    const bool word = tid < SLOT_WORDS;
                    unsigned all = word ? s_kept32[tid] : (unsigned)s_kept;
#pragma unroll
                    for (int r = 1; r < CL; ++r)
                        deepjit::store_rank(&s_from[rank][tid], (rank + r) % CL, all, &s_pushed);
                    deepjit::mbar_wait(&s_pushed);  // and every block has read cand_count, before its stores
#pragma unroll
                    for (int r = 0; r < CL; ++r) {
                        if (r != rank) all = word ? all | s_from[r][tid] : all + s_from[r][tid];
                    }
                    if (word) s_kept32[tid] = all;
                    else s_kept = (int)all;
                }
                __syncthreads();
                DJ_NMS_MARK(6);
                if (tid == 0 && rank == 0) cand_count[b] = 0;
            }
            // The kept boxes in score order, up to max_det: a box's row is the kept boxes before its place.
            if (key != 0ull && (CL == 1 || group % CL == rank)) {
                const int r = s_start[bucket] + ((f_info[tid] >> 8) & 0xff);
                int before = __popc(s_kept32[r >> 5] & ((1u << (r & 31)) - 1u));
#pragma unroll
                for (int v = 0; v < SLOT_WORDS; ++v) before += v < (r >> 5) ? __popc(s_kept32[v]) : 0;
                if (((s_kept32[r >> 5] >> (r & 31)) & 1u) && before < MAX_DET) {
                    const size_t o = (size_t)b * MAX_DET + before;
                    out_box4[o] = box;
                    scores[o] = score;
                    classes[o] = cls;
                }
            }
            const int kept = min(s_kept, MAX_DET);
            if (CL == 1 || rank == 0) finish_rows<MAX_DET>(tid, b, kept, num_dets, out_box4, scores, classes);
#ifdef DJ_NMS_PROFILE
            __syncthreads();
            DJ_NMS_MARK(5);
            if (tid == 0 && b == 0 && rank == 0 && atomicAdd(&dj_nms_profile_launches, 1u) % 64u == 63u) {
                printf("nms slot profile: candidates %d (%d own) kept %d | wait+count %lld  slots %lld  rows %lld  "
                       "settle %lld  cluster %lld  out %lld | total %lld cycles\n", n, CL > 1 ? s_own : n, kept,
                       s_prof[1] - s_prof[0], s_prof[2] - s_prof[1], s_prof[3] - s_prof[2], s_prof[4] - s_prof[3],
                       CL > 1 ? s_prof[6] - s_prof[4] : 0ll, s_prof[5] - (CL > 1 ? s_prof[6] : s_prof[4]),
                       s_prof[5] - s_prof[0]);
            }
#endif
            return;
        }
        if (tid < 32) bucket_starts(s_size, s_start);
        else if (grouped && tid < 64) bucket_starts(s_gsize, s_gstart, s_glist, &s_groups, s_gpairs);
        __syncthreads();
        DJ_NMS_MARK(3);
        const int first = s_start[bucket], gfirst = grouped ? s_gstart[group] : 0;
        if (key != 0ull) {
            keys[first + at] = key;
            if (grouped) gkeys[gfirst + at_group] = key;
        }
        __syncthreads();
        DJ_NMS_MARK(4);
        int rank = first, grank = gfirst;
        if (key != 0ull) {
            for (int j = first; j < first + s_size[bucket]; ++j) rank += keys[j] > key;
            if (grouped && !AGNOSTIC) {  // agnostic: one group, in score order
#pragma unroll 4
                for (int j = gfirst; j < gfirst + s_gsize[group]; ++j) grank += gkeys[j] > key;
            }
        }
        if (AGNOSTIC) grank = rank;
        __syncthreads();
        if (key != 0ull) {
            const int at_place = grouped ? grank : rank;
            r_box[at_place] = box;
            r_score[at_place] = score;
            r_cls[at_place] = cls;
            if (grouped) {
                s_gidx[grank] = rank;
                // mask_pairs ORs into them
                for (int w = 0; 32 * w < grank - gfirst; ++w) s_cols[w * CHUNK + grank] = 0u;
            }
        }
    } else {
        if (tid == 0) s_valid = 0;
        int n2 = 1;
        while (n2 < n) n2 <<= 1;
        if (n2 > SORT_CAP) {  // then the contract gave a workspace: [B, ws_stride] keys, then slots
            keys = reinterpret_cast<u64*>(workspace) + (size_t)b * ws_stride;
            slots = reinterpret_cast<int*>(workspace + (size_t)images * ws_stride * sizeof(u64)) + (size_t)b * ws_stride;
        }
        __syncthreads();
        if (!first_goes_on<CL>(rank)) return;
        if (tid == 0) cand_count[b] = 0;
        for (int i = tid; i < n2; i += BLOCK) {
            u64 key = 0;  // padding and scores <= conf_threshold sort last and are never visited
            if (i < n) {
                const float s = __ldcg(cand_scores + base + i);
                if (s > conf_threshold()) {
                    key = sort_key(s, __ldcg(cand_index + base + i));
                    atomicAdd(&s_valid, 1);
                }
            }
            keys[i] = key;
            slots[i] = i;
        }
        __syncthreads();
        bitonic_desc(keys, slots, n2);
        valid = s_valid;
    }

    for (int c0 = 0; c0 < valid; c0 += CHUNK) {
        __syncthreads();  // the previous chunk (or the sort) is done with the shared buffers
        DJ_NMS_MARK(5);
        const int kept0 = s_kept;
        if (kept0 >= MAX_DET) break;
        const int m = min((int)CHUNK, valid - c0);
        const float4* gb = grouped ? r_box : s_chunk_box;
        const float* gs = grouped ? r_score : s_chunk_score;
        const int* gc = grouped ? r_cls : s_chunk_cls;
        if (!grouped) {
            // Group the chunk by class: count, starts, members, then each box's place among its group's
            // members (their order in the chunk), and gather it there. The members list lives where the
            // masks will.
            enum : int { PER = (CHUNK + BLOCK - 1) / BLOCK };  // chunk boxes per thread
            int cls[PER], at[PER];
#pragma unroll
            for (int r = 0; r < PER; ++r) {
                const int i = tid + r * BLOCK;
                if (i < m) {
                    cls[r] = by_rank ? r_cls[c0 + i] : __ldcg(cand_classes + base + slots[c0 + i]);
                    at[r] = atomicAdd(&s_gsize[AGNOSTIC ? 0 : cls[r] & (NB - 1)], 1);
                }
                if (i < WORDS) s_gone32[i] = s_kept32[i] = 0u;
            }
            __syncthreads();
            if (tid < 32) bucket_starts(s_gsize, s_gstart, s_glist, &s_groups);
            __syncthreads();
            int* members = reinterpret_cast<int*>(s_cols);
#pragma unroll
            for (int r = 0; r < PER; ++r) {
                const int i = tid + r * BLOCK;
                if (i < m) members[s_gstart[AGNOSTIC ? 0 : cls[r] & (NB - 1)] + at[r]] = i;
            }
            __syncthreads();
            int place[PER];
#pragma unroll
            for (int r = 0; r < PER; ++r) {
                const int i = tid + r * BLOCK;
                if (i < m) {
                    const int g = AGNOSTIC ? 0 : cls[r] & (NB - 1), first = s_gstart[g];
                    place[r] = first;
                    for (int j = first; j < first + s_gsize[g]; ++j) place[r] += members[j] < i;
                }
            }
#pragma unroll
            for (int r = 0; r < PER; ++r) {
                const int i = tid + r * BLOCK;
                if (i < m) {
                    const int p = place[r];
                    if (by_rank) {
                        s_chunk_box[p] = r_box[c0 + i];
                        s_chunk_score[p] = r_score[c0 + i];
                    } else {
                        const size_t slot = base + slots[c0 + i];
                        s_chunk_box[p] = __ldcg(cand_box4 + slot);
                        s_chunk_score[p] = __ldcg(cand_scores + slot);
                    }
                    s_chunk_cls[p] = cls[r];
                    s_gidx[p] = i;
                }
            }
            __syncthreads();
        }
        // a. Chunk boxes suppressed by boxes kept from earlier chunks: a warp per box, its lanes
        //    checking every 32nd kept box.
        if (kept0 > 0) {
            const int lane = tid & 31;
            for (int j = tid >> 5; j < m; j += WARPS) {
                const float4 bj = gb[j];
                const int cj = gc[j];
                bool hit = false;
                for (int k = lane; k < kept0 && !hit; k += 32)
                    hit = suppresses<AGNOSTIC>(s_kept_box[k], s_kept_cls[k], bj, cj);
                if (__any_sync(deepjit::kFullMask, hit) && lane == 0) atomicOr(&s_gone32[j >> 5], 1u << (j & 31));
            }
        }
        // b. Each box against the earlier members of its group (8 lanes a box where the chunk is small,
        //    else 4; SPLIT is a template argument, so the strides are constants), then each group's
        //    greedy outcome.
        if (grouped && s_gpairs[s_groups] <= PAIRS_FLAT)
            mask_pairs<AGNOSTIC>(s_groups, s_glist, s_gpairs, s_gstart, gb, gc, s_cols);
        else if (8 * m <= BLOCK) mask_groups<8, AGNOSTIC>(m, gb, gc, s_gstart, s_cols);
        else mask_groups<4, AGNOSTIC>(m, gb, gc, s_gstart, s_cols);  // 4 lanes a box, in rounds
        __syncthreads();
        DJ_NMS_MARK(6);
        settle_groups(s_cols, s_glist, s_groups, s_gstart, s_gsize, s_gidx, s_gone32, s_kept32);
        __syncthreads();
        DJ_NMS_MARK(7);

        // c. The kept boxes in score order, up to max_det: to the outputs, and to the list later chunks
        //    check against. A box's place: the kept boxes before it in the chunk's score order.
        for (int p = tid; p < m; p += BLOCK) {
            const int i = s_gidx[p];
            const unsigned w = s_kept32[i >> 5], me = 1u << (i & 31);
            if (w & me) {
                int pos = kept0 + __popc(w & (me - 1u));
#pragma unroll
                for (int v = 0; v < WORDS; ++v) pos += v < (i >> 5) ? __popc(s_kept32[v]) : 0;  // independent loads
                if (pos < MAX_DET) {
                    const size_t o = (size_t)b * MAX_DET + pos;
                    out_box4[o] = s_kept_box[pos] = gb[p];
                    scores[o] = gs[p];
                    classes[o] = s_kept_cls[pos] = gc[p];
                }
            }
        }
        for (int k = tid; k < NB; k += BLOCK) s_gsize[k] = 0;  // for the next chunk's grouping
        if (tid == 0) {
            int kept = kept0;
#pragma unroll
            for (int v = 0; v < WORDS; ++v) kept += __popc(s_kept32[v]);
            s_kept = min(kept, MAX_DET);
        }
    }
    __syncthreads();
    DJ_NMS_MARK(8);

    const int kept = s_kept;
    finish_rows<MAX_DET>(tid, b, kept, num_dets, out_box4, scores, classes);
#ifdef DJ_NMS_PROFILE
    if (tid == 0 && b == 0 && atomicAdd(&dj_nms_profile_launches, 1u) % 64u == 63u) {
        printf("nms profile: candidates %d kept %d | wait+count %lld  loads+buckets %lld  starts %lld  keys %lld  "
               "rank+scatter %lld  masks %lld  settle %lld  append %lld | total %lld cycles\n", n, kept,
               s_prof[1] - s_prof[0], s_prof[2] - s_prof[1], s_prof[3] - s_prof[2], s_prof[4] - s_prof[3],
               s_prof[5] - s_prof[4], s_prof[6] - s_prof[5], s_prof[7] - s_prof[6], s_prof[8] - s_prof[7],
               s_prof[8] - s_prof[0]);
    }
#endif
}

}  // namespace dj_nms
