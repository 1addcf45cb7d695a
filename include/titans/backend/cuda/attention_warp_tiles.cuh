#pragma once
// titans/backend/cuda/attention_warp_tiles.cuh: tiled_attention with its two products in warp
// tiles (tile_product.cuh): on the tensor cores in TF32 where the caller allows it (float),
// else FMAs in T held in registers (math §6-7; the flash-attention 2 scheme).
//
// A block of 4 warps per (64 queries, head, sequence); warp w owns queries 16 w .. 16 w + 15,
// their output rows O (16 x d) and their softmax statistics in registers. The keys and values
// come through shared memory in tiles of TK rows (the prefix's, then the window's span); per
// tile each warp computes
//     S = scale Q K^T (16 x TK, masked as tiled_attention's),
//     m' = max(m, max_j S), P = exp(S - m'), l = l e^(m - m') + sum_j P,
//     O = O e^(m - m') + P V,
// P staying in the registers S's product left it in (tile_step_held: on the tensor cores a
// product's result is, entry for entry, the next one's A fragment when the keys are taken in
// pairs). At the end O / l. A tile whose every key all of a warp's rows see (the window's
// inner tiles, full prefix tiles) skips the mask. Head widths up to 128 are padded with zeros
// to 32, 64 or 128 (WarpTileLayout); a row's four lanes share its maximum and sum through
// shuffles. Rows are loaded 16 bytes at a time where the layout allows; shared rows are padded
// so that the fragments' loads hit distinct banks: V's by 4 entries (read across k with k in
// pairs), Q's and K's by 4 (read along k in the instruction's order). On the tensor cores S's
// k runs in pairs (KOrder::Pair): K's rows are padded by 8 and read two entries a load, and Q
// is stored in its fragments' order (FragmentRows), a lane's four entries a load.
//
// The result equals tiled_attention's up to rounding (sums in another order); with TF32 the
// operands of both products are rounded to 10-bit mantissas (docs/cuda.md has the bound).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../config.hpp"
#include "attention_tiled.cuh"
#include "attention_tiled_backward.cuh"
#include "fast_math.cuh"
#include "launch.cuh"
#include "tile_product.cuh"

namespace titans::backend::cuda {

/// Queries of a warp-tiled block (16 per warp, tiled_threads / 32 warps).
inline constexpr int warp_tile_rows = 64;

/// The shared arrays of a warp-tiled block for head width (padded) DHP in T: Q (64 x ldq), K
/// (TK x ldk) and V (TK x ld). TK: 64 keys a tile, fewer for wide rows (a block within 116
/// KB, two to an H100's SM; the score tile's registers, TK / 2 a thread). ld = DHP + 4, and
/// ldq = ldk = ld, unless S's k runs in pairs (Pairs: TF32): then Q's rows are each warp's
/// FragmentRows (DHP entries a row, no padding) and K's rows DHP + 8 entries, which keeps
/// 8-byte reads free of bank conflicts (a half-warp's 16 lanes read from 4 rows: 8 g + 2 q
/// covers the 32 banks once).
template <class T, int DHP, bool Pairs = false>
struct WarpTileLayout {
    static constexpr int tk = DHP * static_cast<int>(sizeof(T)) <= 256   ? 64
                              : DHP * static_cast<int>(sizeof(T)) <= 512 ? 32
                                                                         : 16;
    static constexpr int ld = DHP + 4;
    static constexpr int ldq = Pairs ? DHP : ld;
    static constexpr int ldk = Pairs ? DHP + 8 : ld;
    static constexpr long long entries = static_cast<long long>(warp_tile_rows) * ldq +
                                         static_cast<long long>(tk) * (ldk + ld);
    static constexpr std::size_t bytes = static_cast<std::size_t>(entries) * sizeof(T);
};

/// The padded head width a warp-tiled block takes for d_h (0: wider than 128, none).
TITANS_HOST_DEVICE constexpr int warp_tile_width(int dh) {
    return dh <= 0 ? 0 : dh <= 32 ? 32 : dh <= 64 ? 64 : dh <= 128 ? 128 : 0;
}

#if TITANS_CUDA_DEVICE_CODE

/// The lane's row r (0: g, 1: g + 8) of its fragment's entry e (0-3: (g, 2q), (g, 2q + 1),
/// (g + 8, 2q), (g + 8, 2q + 1)).
TITANS_HOST_DEVICE constexpr int frag_row(int e) {
    return e >> 1;
}

/// x reduced over the four lanes of a quad (the lanes holding one row of a fragment) by op.
template <class T, class Op>
__device__ inline T quad_reduce(T x, Op op) {
    x = op(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return op(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

/// The warp tiles' softmax exponentials. In float they run in base 2: the scores and maxima are
/// kept in units of log2(e) (`unit`, folded into the scores' scale) and each exponential is one
/// ex2.approx.ftz on the GPU (2 ulp; results below 2^-126, under 1e-38 of the row's largest
/// weight, flushed to 0), where expf's accurate expansion takes nine instructions. In double
/// they stay in base e (std::exp; unit 1). `natural` takes a maximum back to base e (the
/// statistics' units, shared with the scalar kernels).
template <class T>
struct SoftmaxExp {
    static constexpr T unit = sizeof(T) == 4 ? T(1.4426950408889634) : T(1);
    static constexpr T natural = sizeof(T) == 4 ? T(0.6931471805599453) : T(1);
    __device__ static T of(T x) {
        if constexpr (sizeof(T) == 4) {
            return ex2_ftz(x);
        } else {
            return std::exp(x);
        }
    }
};

/// One warp's running state: its output rows (16 x DHP) and each of the lane's two rows'
/// maximum m and partial sum l (the lane's own entries; the quad's sum at the end).
template <class T, int DHP>
struct WarpRows {
    T o[1][DHP / 8][4];
    T m[2], l[2];
    long long qpos[2];  // the key positions the two rows sit at
};

/// The scores s of one key tile (nk keys, the first at key0; -1: prefix keys), masked unless
/// every key is seen by every row (Masked false), become P (rounded to TF32 for TF32 products)
/// in s's registers, with the online softmax's rescaling of o, m and l. scale (> 0: it keeps
/// the scores' order, so a row's maximum is taken before it and scaled once) includes
/// SoftmaxExp's unit: m is in its units, and a weight is of(s scale - m), one FMA before it.
template <class T, bool TF32, int DHP, int NS, bool Masked = true>
__device__ void warp_tile_softmax(WarpRows<T, DHP>& w, T (&s)[1][NS][4], int nk, long long key0,
                                  int window, T scale, int q) {
    const T none = -static_cast<T>(INFINITY);
    T mx[2] = {none, none};
    TITANS_UNROLL
    for (int ni = 0; ni < NS; ++ni) {
        TITANS_UNROLL
        for (int e = 0; e < 4; ++e) {
            const int c = 8 * ni + 2 * q + (e & 1), r = frag_row(e);
            bool seen = true;
            if constexpr (Masked) {
                const long long kp = key0 + c, qp = w.qpos[r];
                seen = c < nk && (key0 < 0 || (kp <= qp && kp > qp - window));
            }
            const T v = seen ? s[0][ni][e] : none;
            s[0][ni][e] = v;
            mx[r] = std::fmax(v, mx[r]);  // a NaN score leaves the maximum as it was
        }
    }
    T alpha[2];
    TITANS_UNROLL
    for (int r = 0; r < 2; ++r) {
        mx[r] = quad_reduce(mx[r], [](T a, T b) { return a > b ? a : b; }) * scale;
        const T m = mx[r] > w.m[r] ? mx[r] : w.m[r];
        alpha[r] = m == w.m[r] ? T(1) : SoftmaxExp<T>::of(w.m[r] - m);  // -inf to finite: 0
        w.m[r] = m;
        w.l[r] *= alpha[r];
        mx[r] = m == none ? T(0) : m;  // a row that has seen no key: every weight exp(-inf) = 0
    }
    TITANS_UNROLL
    for (int ni = 0; ni < NS; ++ni) {
        TITANS_UNROLL
        for (int e = 0; e < 4; ++e) {
            const int r = frag_row(e);
            const T p = SoftmaxExp<T>::of(s[0][ni][e] * scale - mx[r]);
            w.l[r] += p;
            // p is in [0, 1] or NaN (a NaN score): rounded without cvt.rna's NaN guard, which
            // may turn a NaN into -0, but the row's sum above took it unrounded.
            s[0][ni][e] = tf32_stored<T, TF32, true>(p);
        }
    }
    TITANS_UNROLL
    for (int ni = 0; ni < DHP / 8; ++ni) {
        TITANS_UNROLL
        for (int e = 0; e < 4; ++e) {
            w.o[0][ni][e] *= alpha[frag_row(e)];
        }
    }
}

/// Whether every one of `keys` keys from key_first (-1: prefix keys, seen by all) is seen by the
/// queries at positions query_a, query_b and every position between (a query at t sees the
/// window's keys (t - window, t]).
TITANS_HOST_DEVICE bool keys_seen_by_all(long long key_first, int keys, long long query_a,
                                         long long query_b, int window) {
    if (key_first < 0) {
        return true;
    }
    const long long lo = query_a < query_b ? query_a : query_b;
    const long long hi = query_a < query_b ? query_b : query_a;
    return key_first + keys - 1 <= lo && key_first > hi - window;
}

/// Whether every key of a full tile of TK keys at key0 (-1: prefix keys) is seen by each of the
/// warp's 16 rows, at positions first, first + step, ..., first + 15 step: then the tile needs
/// no mask.
TITANS_HOST_DEVICE bool warp_tile_unmasked(int nk, int tk, long long key0, long long first,
                                           long long step, int window) {
    return nk == tk && keys_seen_by_all(key0, tk, first, first + 15 * step, window);
}

/// n rows of dh entries (row stride ss) into DHP-wide shared rows (leading dimension ld; rounded
/// to TF32 for TF32 products), zeros past them up to `rows` rows; the caller syncs. 16 bytes a
/// load and a store where dh, both strides and both addresses allow it (a block-wide choice).
template <class T, bool TF32, int DHP>
__device__ void warp_rows_load(T* dst, int ld, const T* src, long long ss, int n, int rows,
                               int dh) {
    constexpr int V = static_cast<int>(16 / sizeof(T));
    const bool whole = dh % V == 0 && ss % V == 0 && ld % V == 0 &&
                       reinterpret_cast<std::uintptr_t>(src) % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(dst) % 16 == 0;
    if (whole) {
        for (int i = threadIdx.x; i < rows * (DHP / V); i += blockDim.x) {
            const int r = i / (DHP / V), c = i % (DHP / V) * V;
            T x[V];
            if (r < n && c < dh) {
                load_16_bytes(src + r * ss + c, x);
            } else {
                for (int e = 0; e < V; ++e) {
                    x[e] = T(0);
                }
            }
            for (int e = 0; e < V; ++e) {
                x[e] = tf32_stored<T, TF32>(x[e]);
            }
            store_16_bytes(dst + r * ld + c, x);
        }
        return;
    }
    for (int i = threadIdx.x; i < rows * DHP; i += blockDim.x) {
        const int r = i / DHP, c = i % DHP;
        dst[r * ld + c] = r < n && c < dh ? tf32_stored<T, TF32>(src[r * ss + c]) : T(0);
    }
}

/// 64 rows of dh entries (row stride ss; n real, zeros past them and past dh up to DHP) rounded
/// to TF32 into dst as each warp's 16 rows' FragmentRows in order O (16 DHP entries a warp);
/// the caller syncs. Once a block: each entry a load and a store.
template <int DHP, KOrder O>
__device__ void warp_fragment_rows_load(float* dst, const float* src, long long ss, int n,
                                        int dh) {
    for (int i = threadIdx.x; i < warp_tile_rows * DHP; i += blockDim.x) {
        const int r = i / DHP, c = i % DHP;
        const float x = r < n && c < dh ? round_tf32(src[r * ss + c]) : 0.0f;
        dst[(r / 16) * 16 * DHP + FragmentRows<float, O>::at(r % 16, c)] = x;
    }
}

/// How a block's 64 rows that only ever are A operands (each warp's 16 rows, read along k in
/// order O) sit in shared memory: row-major with leading dimension ld, or on the tensor cores
/// (TF32) in their fragments' order (FragmentRows: one 16-byte load a lane and k-step).
template <class T, bool TF32, KOrder O>
using WarpAOperand = std::conditional_t<TF32, FragmentRows<T, O>, RowOperand<T, TF32>>;

/// Warp `warp`'s WarpAOperand of the rows at base.
template <class T, bool TF32, KOrder O, int DHP>
__device__ inline WarpAOperand<T, TF32, O> warp_a_operand(const T* base, int warp, int ld) {
    if constexpr (TF32) {
        return {base + warp * 16 * DHP};
    } else {
        return operand_at<RowOperand<T, TF32>>(base + warp * 16 * ld, ld);
    }
}

/// 64 rows (row stride ss, n real) into dst as warp_a_operand reads them; the caller syncs.
template <class T, bool TF32, KOrder O, int DHP>
__device__ void warp_a_rows_load(T* dst, int ld, const T* src, long long ss, int n, int dh) {
    if constexpr (TF32) {
        warp_fragment_rows_load<DHP, O>(dst, src, ss, n, dh);
    } else {
        warp_rows_load<T, TF32, DHP>(dst, ld, src, ss, n, warp_tile_rows, dh);
    }
}

/// The end of a warp's rows (wq of its 16 real, the first at flattened row rw, head h at
/// columns col): the output rows O / l and, where a.stat_m is set, each row's maximum and
/// 1 / l.
template <class T, int DHP>
__device__ void warp_tile_finish(const TiledAttentionArgs<T>& a, const WarpRows<T, DHP>& w,
                                 long long rw, int wq, long long col, int h, int g, int q) {
    T inv[2];
    for (int r = 0; r < 2; ++r) {
        inv[r] = T(1) / quad_reduce(w.l[r], [](T x, T y) { return x + y; });
    }
    tile_store(w.o, g, 2 * q, [&](int r, int c, T v) {
        if (r < wq && c < a.d_head) {
            a.o[(rw + r) * a.o_stride + col + c] = v * inv[r >= 8 ? 1 : 0];
        }
    });
    for (int r = 0; r < 2; ++r) {
        if (a.stat_m != nullptr && q == 0 && g + 8 * r < wq) {
            const long long at = (rw + g + 8 * r) * a.H + h;
            a.stat_m[at] = w.m[r] * SoftmaxExp<T>::natural;
            a.stat_inv[at] = inv[r];
        }
    }
}

/// The attention of 64 queries of one head of one sequence (blockIdx x, y, z) in warp tiles.
template <class T, bool TF32, int DHP>
__global__ void __launch_bounds__(tiled_threads)
    warp_tiled_attention_kernel(TiledAttentionArgs<T> a) {
    using L = WarpTileLayout<T, DHP, TF32>;
    constexpr int TK = L::tk, NS = TK / 8;
    constexpr KOrder O = TF32 ? KOrder::Pair : KOrder::Split;  // S's k order
    const long long b = blockIdx.z, t0 = static_cast<long long>(blockIdx.x) * warp_tile_rows;
    const int h = static_cast<int>(blockIdx.y), dh = a.d_head;
    const int nq = static_cast<int>(a.N - t0 < warp_tile_rows ? a.N - t0 : warp_tile_rows);
    const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
    const int g = lane / 4, q = lane % 4;
    T* sq = dynamic_shared<T>();
    T* sk = sq + warp_tile_rows * L::ldq;
    T* sv = sk + TK * L::ldk;
    const long long col = static_cast<long long>(h) * dh;
    warp_a_rows_load<T, TF32, O, DHP>(sq, L::ld, a.q + (b * a.N + t0) * a.q_stride + col,
                                      a.q_stride, nq, dh);
    WarpRows<T, DHP> w;
    tile_zero(w.o);
    for (int r = 0; r < 2; ++r) {
        w.m[r] = -static_cast<T>(INFINITY);
        w.l[r] = T(0);
        w.qpos[r] = a.pos0 + a.qstride * (t0 + 16 * warp + g + 8 * r);
    }
    const long long first = a.pos0 + a.qstride * (t0 + 16 * warp);  // the warp's row 0 position
    const bool active = 16 * warp < nq;  // a warp past the piece's last query only loads
    const T scale = a.scale * SoftmaxExp<T>::unit;
    using Row = RowOperand<T, TF32>;
    constexpr Operands P = tf32_or_exact<TF32>;
    const auto qa = warp_a_operand<T, TF32, O, DHP>(sq, warp, L::ld);
    auto tile = [&](const T* k, long long ks, const T* v, long long vs, int nk, long long key0) {
        __syncthreads();  // the previous tile's reads are done
        warp_rows_load<T, TF32, DHP>(sk, L::ldk, k + col, ks, nk, TK, dh);
        warp_rows_load<T, TF32, DHP>(sv, L::ld, v + col, vs, nk, TK, dh);
        __syncthreads();
        if (!active) {
            return;
        }
        T s[1][NS][4];
        tile_zero(s);
        TITANS_UNROLL
        for (int k0 = 0; k0 < DHP; k0 += 8) {
            tile_step<T, P, 1, NS, O>(s, qa, operand_at<TransposedOperand<T, TF32>>(sk, L::ldk),
                                      g, g, k0, g, q);
        }
        if (warp_tile_unmasked(nk, TK, key0, first, a.qstride, a.window)) {  // warp-uniform
            warp_tile_softmax<T, TF32, DHP, NS, false>(w, s, nk, key0, a.window, scale, q);
        } else {
            warp_tile_softmax<T, TF32, DHP, NS>(w, s, nk, key0, a.window, scale, q);
        }
        TITANS_UNROLL
        for (int ni = 0; ni < NS; ++ni) {
            tile_step_held<T, P, DHP / 8>(w.o, s[0][ni], operand_at<Row>(sv, L::ld), g, 8 * ni, g,
                                          q);
        }
    };
    tiled_key_tiles(a, TiledShape{warp_tile_rows, TK}, b, t0, nq,
                    [&](long long kr, bool pre, int nk, long long key0) {
                        const long long ks = pre ? a.kp_stride : a.seq_stride;
                        const long long vs = pre ? a.vp_stride : a.seq_stride;
                        tile((pre ? a.k_prefix : a.k_seq) + kr * ks, ks,
                             (pre ? a.v_prefix : a.v_seq) + kr * vs, vs, nk, key0);
                    });
    if (active) {
        warp_tile_finish(a, w, b * a.N + t0 + 16 * warp, nq - 16 * warp, col, h, g, q);
    }
}

/// Launches warp_tiled_attention_kernel over B sequences (the caller checks warp_tiles_fit).
template <class T, bool TF32, int DHP>
void warp_tiled_attention_launch(cudaStream_t stream, const TiledAttentionArgs<T>& a, long long B) {
    using L = WarpTileLayout<T, DHP, TF32>;
    void (*kernel)(TiledAttentionArgs<T>) = warp_tiled_attention_kernel<T, TF32, DHP>;
    raise_shared_limit(kernel, L::bytes);
    const dim3 grid(static_cast<unsigned>((a.N + warp_tile_rows - 1) / warp_tile_rows),
                    static_cast<unsigned>(a.H), static_cast<unsigned>(B));
    launch_shared(kernel, grid, dim3(tiled_threads), L::bytes, stream, a);
    check_launch("the warp-tiled attention kernel");
}

/// tiled_attention's result for B sequences in warp tiles, on the tensor cores when tf32 (float
/// only; ignored in double). The caller checks warp_tiles_fit.
template <class T>
void warp_tiled_attention(cudaStream_t stream, const TiledAttentionArgs<T>& a, long long B,
                          bool tf32) {
    if (a.N <= 0 || B <= 0) {
        return;
    }
    const int dhp = warp_tile_width(a.d_head);
    if constexpr (std::is_same_v<T, float>) {
        if (tf32) {
            dhp == 32   ? warp_tiled_attention_launch<T, true, 32>(stream, a, B)
            : dhp == 64 ? warp_tiled_attention_launch<T, true, 64>(stream, a, B)
                        : warp_tiled_attention_launch<T, true, 128>(stream, a, B);
            return;
        }
    }
    dhp == 32   ? warp_tiled_attention_launch<T, false, 32>(stream, a, B)
    : dhp == 64 ? warp_tiled_attention_launch<T, false, 64>(stream, a, B)
                : warp_tiled_attention_launch<T, false, 128>(stream, a, B);
}

#endif

/// The shared memory a warp-tiled block takes for head width dh in entries of entry_bytes (0:
/// none, d_h above 128; in float the tensor cores' layout, the larger).
inline std::size_t warp_tile_bytes(int dh, std::size_t entry_bytes) {
    const int dhp = warp_tile_width(dh);
    const bool f = entry_bytes == 4;
    using F32 = WarpTileLayout<float, 32, true>;
    using F64 = WarpTileLayout<float, 64, true>;
    using F128 = WarpTileLayout<float, 128, true>;
    return dhp == 32    ? (f ? F32::bytes : WarpTileLayout<double, 32>::bytes)
           : dhp == 64  ? (f ? F64::bytes : WarpTileLayout<double, 64>::bytes)
           : dhp == 128 ? (f ? F128::bytes : WarpTileLayout<double, 128>::bytes)
                        : 0;
}

#if TITANS_CUDA_DEVICE_CODE
/// Whether B sequences of N queries over H heads of width dh run in warp tiles: 16 queries a
/// sequence at least (one warp's rows; fewer, decode's, take tiled_attention's one-query
/// tiles), d_h at most 128, the grid within its bounds, the block's shared memory within the
/// device's opt-in limit (asked last, only when the rest holds).
inline bool warp_tiles_fit(long long B, long long N, int H, int dh, std::size_t entry_bytes) {
    const std::size_t bytes = warp_tile_bytes(dh, entry_bytes);
    return N >= 16 && bytes > 0 &&
           tiled_grid_fits(B, N, H, TiledShape{warp_tile_rows, warp_tile_rows}) &&
           bytes <= shared_memory_limit();
}

#endif

}  // namespace titans::backend::cuda
