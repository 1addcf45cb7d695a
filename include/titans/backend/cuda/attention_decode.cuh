#pragma once
// titans/backend/cuda/attention_decode.cuh: the attention of one query per (sequence, head) (a
// decoded token) with its keys split across blocks (the flash-decoding scheme), opt-in
// (set_split_decode).
//
// The scalar tiles give a decoded token one block per (sequence, head): at B = 1 and 8 heads,
// 8 blocks on a GPU of 132 SMs, each walking its 512 window keys in tiles of 64 with a
// single thread's softmax between them (28 us a layer on an H200). Here the n = p + (window
// rows seen) keys of a (sequence, head) are cut into S spans of consecutive keys, a block
// each (grid S x H x B; S chosen so that the grid has about decode_split_blocks blocks, at
// most one span per decode_split_min keys). In a block, warp w takes a quarter of the span in
// groups of 4 keys: every lane loads its d_h / 32 entries of the 4 keys and values at once,
// the scores reduce over the warp (shuffles), and the warp keeps the online softmax's maximum
// m, sum l and output o (registers) as the tiles do:
//     m' = max(m, s_i), l = l e^(m - m') + sum_i e^(s_i - m'),
//     o = o e^(m - m') + sum_i e^(s_i - m') v_i.
// The block merges its 4 warps' (m, l, o) in warp order; with one span it writes o / l,
// otherwise its (m, l, o) into the scratch, and the block of the (sequence, head) that
// finishes last (a counter, zero before and after a launch) merges the S spans in order and
// writes o / l. Every sum's order is fixed by n and S: the same bits call after call.
//
// As the scalar tiles' one-query launch does (TiledAttentionArgs::k_win), the kernel appends
// the token's key (RoPE-rotated at its absolute position) and value to the window itself:
// every block rotates the query and the new key into shared memory and reads the new key from
// there, never from the window, and the first span's block writes both into the window row
// pos0. No block reads that row, so no block waits for another.
//
//     titans::backend::cuda::set_split_decode(true);  // the default (TITANS_SPLIT_DECODE=0: off)
//     y = attention.forward(state, x);  // one token a sequence: keys split across blocks

#include <atomic>
#include <cmath>
#include <cstddef>

#include "attention_tiled.cuh"
#include "launch.cuh"
#include "partial_scratch.cuh"
#include "runtime.cuh"

namespace titans::backend::cuda {

/// Process-wide switch for the split-keys decode attention: on by default (on an H200,
/// 2026-12-04, 11x the scalar tiles' speed at B = 1, 3x at B = 256; docs/cuda.md), off from the
/// start when the environment sets TITANS_SPLIT_DECODE=0.
inline std::atomic<bool>& split_decode_flag() {
    static std::atomic<bool> flag{env_switch("TITANS_SPLIT_DECODE", true)};
    return flag;
}
inline void set_split_decode(bool on) { split_decode_flag().store(on); }
[[nodiscard]] inline bool split_decode() { return split_decode_flag().load(); }
/// decode_split's launches so far (process-wide: tests and benchmarks see which path ran).
inline std::atomic<long long>& decode_split_launches() {
    static std::atomic<long long> n{0};
    return n;
}

/// The kernel's warps; keys a warp loads at once; the widest head it takes (d_h / 32 entries a
/// lane); the grid it aims at; the fewest keys a span takes.
inline constexpr int decode_split_warps = 4;
inline constexpr int decode_split_group = 4;
inline constexpr int decode_split_dh_max = 256;
inline constexpr long long decode_split_blocks = 512;
inline constexpr long long decode_split_min = 32;

/// The keys query 0 of a sequence sees: the prefix's p, then window rows lo .. pos0.
TITANS_HOST_DEVICE long long decode_split_lo(long long pos0, int window) {
    return pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
}

/// Spans a (sequence, head) of n keys is cut into when B x H pairs run: about
/// decode_split_blocks blocks in all, none under decode_split_min keys, at least one.
inline long long decode_split_spans(long long n, long long pairs) {
    long long s = (decode_split_blocks + pairs - 1) / pairs;
    const long long most = (n + decode_split_min - 1) / decode_split_min;
    s = s < most ? s : most;
    s = s < 1 ? 1 : s;
    const long long span = (n + s - 1) / s;
    return (n + span - 1) / span;  // (no span left empty)
}

#if TITANS_CUDA_DEVICE_CODE

/// A warp's (or a block's) online softmax: maximum, sum, and its lane's entries of o (entry
/// lane + 32 i, i < E).
template <class T, int E>
struct DecodeSoftmax {
    T m, l, o[E];
};

/// Where key kappa (0 .. n-1) of pair (b, h) lies: the prefix's rows, the window's, or the
/// new key in shared memory (row pos0 when the kernel appends). vrow: its value row.
template <class T>
__device__ __forceinline__ const T* decode_key(const TiledAttentionArgs<T>& a, long long b,
                                               long long col, long long lo, long long kappa,
                                               const T* newk, const T*& vrow) {
    if (kappa < a.p) {
        const long long r = (a.shared ? 0 : b * a.p) + kappa;
        vrow = a.v_prefix + r * a.vp_stride + col;
        return a.k_prefix + r * a.kp_stride + col;
    }
    const long long pos = lo + kappa - a.p;
    if (a.k_win != nullptr && pos == a.pos0) {
        vrow = a.q + b * a.N * a.q_stride + 2 * a.kv_offset + col;  // the piece's value
        return newk;
    }
    const long long r = (b * a.seq_rows + pos) * a.seq_stride + col;
    vrow = a.v_seq + r;
    return a.k_seq + r;
}

/// Keys [k0, k1) of pair (b, h) into warp softmax w, decode_split_group at a time: the group's
/// loads first, then its scores (a warp sum each), then the softmax's step.
template <class T, int E>
__device__ void decode_warp_keys(const TiledAttentionArgs<T>& a, long long b, long long col,
                                 long long lo, long long k0, long long k1, const T* q,
                                 const T* newk, DecodeSoftmax<T, E>& w) {
    constexpr int G = decode_split_group;
    const int lane = static_cast<int>(threadIdx.x) % 32, dh = a.d_head;
    const T none = -static_cast<T>(INFINITY);
    for (long long g = k0; g < k1; g += G) {
        T kv[G][E], vv[G][E], s[G];
        TITANS_UNROLL
        for (int u = 0; u < G; ++u) {
            const T* vr = nullptr;
            const T* kr = g + u < k1 ? decode_key(a, b, col, lo, g + u, newk, vr) : nullptr;
            TITANS_UNROLL
            for (int i = 0; i < E; ++i) {
                const int e = lane + 32 * i;
                const bool in = kr != nullptr && e < dh;
                kv[u][i] = in ? kr[e] : T(0);
                vv[u][i] = in ? vr[e] : T(0);
            }
        }
        TITANS_UNROLL
        for (int u = 0; u < G; ++u) {
            T d = T(0);
            TITANS_UNROLL
            for (int i = 0; i < E; ++i) d += q[lane + 32 * i] * kv[u][i];  // (q zero past dh)
            for (int off = 16; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
            s[u] = g + u < k1 ? d * a.scale : none;
        }
        T m = w.m;
        TITANS_UNROLL
        for (int u = 0; u < G; ++u) m = s[u] > m ? s[u] : m;
        const T f = m == w.m ? T(1) : std::exp(w.m - m);  // -inf to finite: 0
        w.l *= f;
        TITANS_UNROLL
        for (int i = 0; i < E; ++i) w.o[i] *= f;
        TITANS_UNROLL
        for (int u = 0; u < G; ++u) {
            const T p = s[u] == none ? T(0) : std::exp(s[u] - m);
            w.l += p;
            TITANS_UNROLL
            for (int i = 0; i < E; ++i) w.o[i] += p * vv[u][i];
        }
        w.m = m;
    }
}

/// x merged into y (the online softmax's merge of two parts of the keys).
template <class T, int E>
__device__ __forceinline__ void decode_merge(DecodeSoftmax<T, E>& y, T m, T l, const T (&o)[E]) {
    const T mm = m > y.m ? m : y.m;
    const T fy = y.m == mm ? T(1) : std::exp(y.m - mm), fx = m == mm ? T(1) : std::exp(m - mm);
    y.l = y.l * fy + l * fx;
    TITANS_UNROLL
    for (int i = 0; i < E; ++i) y.o[i] = y.o[i] * fy + o[i] * fx;
    y.m = mm;
}

/// The query (and, appending, the new key and value) of pair (b, h) into shared memory, RoPE
/// at the token's absolute position where a.rope; the first span's block writes the key and
/// value into window row pos0. q and newk: 32 E entries each, zero past d_h.
template <class T>
__device__ void decode_split_begin(const TiledAttentionArgs<T>& a, long long b, long long col,
                                   int width, T* q, T* newk) {
    const int dh = a.d_head;
    const T* qr = a.q + b * a.N * a.q_stride + col;
    for (int e = static_cast<int>(threadIdx.x); e < width; e += static_cast<int>(blockDim.x)) {
        q[e] = e < dh ? qr[e] : T(0);
        newk[e] = e < dh && a.k_win != nullptr ? qr[a.kv_offset + e] : T(0);
    }
    __syncthreads();
    if (a.k_win == nullptr) {
        return;
    }
    const long long to = (b * a.seq_rows + a.pos0) * a.seq_stride + col;
    if (a.rope && threadIdx.x < static_cast<unsigned>(dh / 2)) {
        const int c = 2 * static_cast<int>(threadIdx.x);
        const detail::RopePair<T> turn(a.rope_pos0, c / 2, dh, a.rope_base);
        turn.rotate(q + c, q + c);
        turn.rotate(newk + c, newk + c);
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int e = static_cast<int>(threadIdx.x); e < dh; e += static_cast<int>(blockDim.x)) {
            a.k_win[to + e] = newk[e];
            a.v_win[to + e] = qr[2 * a.kv_offset + e];
        }
    }
}

/// The last block of pair (b, h): the S spans' (m, l, o) from `parts` (each 2 + 32 E
/// entries) merged in order, o / l written.
template <class T, int E>
__device__ void decode_split_finish(const TiledAttentionArgs<T>& a, const T* parts, int S,
                                    T* out) {
    const volatile T* at = parts;  // (written by other blocks: not through this SM's L1)
    constexpr int W = 2 + 32 * E;
    for (int e = static_cast<int>(threadIdx.x); e < a.d_head; e += static_cast<int>(blockDim.x)) {
        T m = -static_cast<T>(INFINITY), l = T(0), o = T(0);
        for (int s = 0; s < S; ++s) {
            const T ms = at[s * W], ls = at[s * W + 1], os = at[s * W + 2 + e];
            const T mm = ms > m ? ms : m;
            const T f = m == mm ? T(1) : std::exp(m - mm), fs = ms == mm ? T(1) : std::exp(ms - mm);
            l = l * f + ls * fs;
            o = o * f + os * fs;
            m = mm;
        }
        out[e] = o / l;
    }
}

/// One span of one (sequence, head)'s keys (blockIdx x, y, z: span, head, sequence); E =
/// d_h / 32 rounded up. part and done: the scratch (gridDim.x > 1).
template <class T, int E>
__global__ void __launch_bounds__(decode_split_warps * 32)
    decode_split_kernel(TiledAttentionArgs<T> a, T* part, unsigned* done) {
    constexpr int W = decode_split_warps, P = 2 + 32 * E;
    __shared__ T q[32 * E], newk[32 * E], merge[W * P];
    __shared__ bool last;
    const long long b = blockIdx.z, col = static_cast<long long>(blockIdx.y) * a.d_head;
    const int lane = static_cast<int>(threadIdx.x) % 32, w = static_cast<int>(threadIdx.x) / 32;
    decode_split_begin(a, b, col, 32 * E, q, newk);
    const long long lo = decode_split_lo(a.pos0, a.window), n = a.p + a.pos0 - lo + 1;
    const long long S = gridDim.x, span = (n + S - 1) / S;
    const long long k0 = blockIdx.x * span, k1 = k0 + span < n ? k0 + span : n;
    const long long quarter = (k1 - k0 + W - 1) / W, w0 = k0 + w * quarter;
    DecodeSoftmax<T, E> ws{-static_cast<T>(INFINITY), T(0), {}};
    TITANS_UNROLL
    for (int i = 0; i < E; ++i) ws.o[i] = T(0);
    decode_warp_keys(a, b, col, lo, w0, w0 + quarter < k1 ? w0 + quarter : k1, q, newk, ws);
    T* mine = merge + w * P;
    if (lane == 0) {
        mine[0] = ws.m;
        mine[1] = ws.l;
    }
    TITANS_UNROLL
    for (int i = 0; i < E; ++i) mine[2 + lane + 32 * i] = ws.o[i];
    __syncthreads();
    if (w == 0) {  // the warps' parts merged in warp order by the first warp
        for (int v = 1; v < W; ++v) {
            const T* other = merge + v * P;
            T o[E];
            TITANS_UNROLL
            for (int i = 0; i < E; ++i) o[i] = other[2 + lane + 32 * i];
            decode_merge(ws, other[0], other[1], o);
        }
    }
    const long long pair = b * gridDim.y + blockIdx.y;
    T* out = a.o + b * a.N * a.o_stride + col;
    if (S == 1) {
        TITANS_UNROLL
        for (int i = 0; i < E; ++i) {
            if (w == 0 && lane + 32 * i < a.d_head) out[lane + 32 * i] = ws.o[i] / ws.l;
        }
        return;
    }
    T* parts = part + pair * S * P;
    if (w == 0) {
        T* to = parts + blockIdx.x * P;
        if (lane == 0) {
            to[0] = ws.m;
            to[1] = ws.l;
        }
        TITANS_UNROLL
        for (int i = 0; i < E; ++i) to[2 + lane + 32 * i] = ws.o[i];
    }
    __threadfence();  // this block's part visible before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done + pair, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    decode_split_finish<T, E>(a, parts, static_cast<int>(S), out);
    if (threadIdx.x == 0) {
        done[pair] = 0;  // for the next launch
    }
}

/// Launches decode_split_kernel<T, E> for a (grid spans x H x B).
template <class T, int E>
void decode_split_launch(cudaStream_t stream, const TiledAttentionArgs<T>& a, long long B,
                         long long spans) {
    T* part = nullptr;
    unsigned* done = nullptr;
    if (spans > 1) {
        auto& s = PartialScratch<T>::mine();
        const auto pairs = static_cast<std::size_t>(B) * static_cast<std::size_t>(a.H);
        s.reserve(pairs * static_cast<std::size_t>(spans) * (2 + 32 * E), pairs);
        part = s.part.data();
        done = s.done.data();
    }
    launch(decode_split_kernel<T, E>,
           dim3(static_cast<unsigned>(spans), static_cast<unsigned>(a.H), static_cast<unsigned>(B)),
           dim3(decode_split_warps * 32), stream, a, part, done);
    check_launch("the split decode attention");
}

#endif

/// Whether decode_split applies: the switch on, one query per sequence (N 1, stride 1), d_h
/// within decode_split_dh_max (and even where RoPE rotates), B and H within a grid's 65535.
[[nodiscard]] inline bool decode_split_applies(long long B, long long N, long long qstride,
                                               int H, int dh, bool rope) {
    return split_decode() && N == 1 && qstride == 1 && dh >= 1 && dh <= decode_split_dh_max &&
           (!rope || dh % 2 == 0) && B >= 1 && B <= 65535 && H >= 1 && H <= 65535;
}

#if TITANS_CUDA_DEVICE_CODE
/// The attention of a's one query per sequence for B sequences (decode_split_applies), its
/// keys split across blocks (see the file comment); with a.k_win set, the token's key and
/// value appended to the window as well.
template <class T>
void decode_split(cudaStream_t stream, const TiledAttentionArgs<T>& a, long long B) {
    const long long lo = decode_split_lo(a.pos0, a.window), n = a.p + a.pos0 - lo + 1;
    const long long spans = decode_split_spans(n, B * a.H);
    const int E = (a.d_head + 31) / 32;
    ++decode_split_launches();
    if (E <= 1) {
        decode_split_launch<T, 1>(stream, a, B, spans);
    } else if (E == 2) {
        decode_split_launch<T, 2>(stream, a, B, spans);
    } else if (E <= 4) {
        decode_split_launch<T, 4>(stream, a, B, spans);
    } else {
        decode_split_launch<T, 8>(stream, a, B, spans);
    }
}
#endif

}  // namespace titans::backend::cuda
