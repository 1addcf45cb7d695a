#pragma once
// titans/backend/cuda/attention_warp_tiles_backward.cuh: the backward of the tiled attention
// with its products in warp tiles (math §9; the flash-attention 2 backward): on the tensor
// cores in TF32 where the caller allows it (float), else FMAs in T held in registers.
//
// The passes and their statistics are attention_tiled_backward.cuh's (same formulas, same
// statistics arrays); the blocks are 4 warps, each owning 16 rows and their sums in registers:
//   query pass  per (64 queries, head, sequence): m and l over the keys the rows see (S on the
//               tensor cores, an online pass), then per key tile P, dP = dout V^T,
//               dS = scale P (dP - delta) and dq += dS K; writes dq, m, 1 / l and delta;
//   key pass    per (64 keys, head, sequence or shared prefix): per tile of the queries that
//               see them S^T = K Q^T, P^T, dP^T = V dout^T, dS^T, dv += P^T dout and
//               dk += dS^T Q; writes dk and dv (0 for keys no query sees).
// P and dS stay in the registers their products left them in, as the next products' A operands
// (tile_step_held, as in attention_warp_tiles.cuh); a query tile whose every key all of a
// warp's rows see skips the mask. No atomics: deterministic.

#include <cmath>
#include <cstddef>
#include <type_traits>

#include "../../config.hpp"
#include "attention_tiled.cuh"
#include "attention_tiled_backward.cuh"
#include "attention_warp_tiles.cuh"
#include "launch.cuh"
#include "tile_product.cuh"

namespace titans::backend::cuda {

/// The shared arrays of a backward block for head width (padded) DHP in T. A query-pass block:
/// Q, dout (64 x (DHP + 4)), K, V (TB x (DHP + 4)), except on the tensor cores, where Q and
/// dout are each warp's FragmentRows (Q's in the region of 64 x (DHP + 4), dout's 64 x DHP)
/// and dP = dout V^T takes its k in pairs, V's rows DHP + 8 entries (ldv). A key-pass block:
/// K, V (64 x (DHP + 4); on the tensor cores FragmentRows in those regions), Q, dout (TB x (DHP
/// + 4)) and the query rows' statistics (3 TB). TB: 64 rows of the other side a tile (in double
/// 1024 / DHP at most: a tile's P and dS stay in registers), fewer where the key pass would pass
/// 116 KB; 0 where even 16 would (double at d_h 128). The key pass's block is the larger.
template <class T, int DHP>
struct WarpBackwardLayout {
    static constexpr int ld = DHP + 4;
    static constexpr long long entries_for(int tb) {
        return 2LL * warp_tile_rows * ld + 2LL * tb * ld + 3LL * tb;
    }
    static constexpr long long query_entries_for(int tb) {
        return static_cast<long long>(warp_tile_rows) * (ld + DHP) + tb * (ld + DHP + 8LL);
    }
    static constexpr bool fits(int tb) {
        return static_cast<std::size_t>(entries_for(tb)) * sizeof(T) <= 116 * 1024;
    }
    static constexpr int most = sizeof(T) == 4 ? 64 : 1024 / DHP;  // double: P, dS in registers
    static constexpr int tb = fits(64) && most >= 64   ? 64
                              : fits(32) && most >= 32 ? 32
                              : fits(16)               ? 16
                                                       : 0;
    static constexpr std::size_t bytes = static_cast<std::size_t>(entries_for(tb)) * sizeof(T);
    static_assert(query_entries_for(tb) <= entries_for(tb), "the query pass fits the key pass's");
};

/// The shared memory a backward block takes for head width dh in entries of entry_bytes (0:
/// none).
inline std::size_t warp_backward_bytes(int dh, std::size_t entry_bytes) {
    const int dhp = warp_tile_width(dh);
    const bool f = entry_bytes == 4;
    const auto of = [](auto layout) {
        return decltype(layout)::tb > 0 ? decltype(layout)::bytes : std::size_t{0};
    };
    return dhp == 32
               ? (f ? of(WarpBackwardLayout<float, 32>{}) : of(WarpBackwardLayout<double, 32>{}))
           : dhp == 64
               ? (f ? of(WarpBackwardLayout<float, 64>{}) : of(WarpBackwardLayout<double, 64>{}))
           : dhp == 128
               ? (f ? of(WarpBackwardLayout<float, 128>{}) : of(WarpBackwardLayout<double, 128>{}))
               : 0;
}

#if TITANS_CUDA_DEVICE_CODE

/// Which of the lane's fragment entries' rows and columns a score is: the query and key
/// positions of entry e of piece ni of a warp's 16-row tile.
struct FragPlace {
    int row, col;
};
TITANS_HOST_DEVICE FragPlace frag_place(int ni, int e, int g, int q) {
    return {g + 8 * (e >> 1), 8 * ni + 2 * q + (e & 1)};
}

/// The lane's two rows' dot products of dout and out (delta), for rows < nq of a 16-row tile
/// starting at row r0 of head columns col (the quad's lanes take every fourth column).
template <class T>
__device__ void warp_rows_delta(const TiledBackwardArgs<T>& a, long long r0, int nq, long long col,
                                int dh, int g, int q, T (&delta)[2]) {
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        T s = T(0);
        if (row < nq) {
            const T* d = a.dout + (r0 + row) * a.dout_stride + col;
            const T* o = a.out + (r0 + row) * a.out_stride + col;
            for (int c = q; c < dh; c += 4) {
                s += d[c] * o[c];
            }
        }
        delta[r] = quad_reduce(s, [](T x, T y) { return x + y; });
    }
}

/// The query pass's steps for one warp of a block: its 16 rows (wq of them real) against the
/// key tiles, in shared memory at sq (Q), sg (dout), sk, sv (the key tile).
template <class T, bool TF32, int DHP>
struct WarpQueryPass {
    using L = WarpBackwardLayout<T, DHP>;
    static constexpr int TB = L::tb, NS = TB / 8, ld = L::ld;
    static constexpr int ldv = TF32 ? DHP + 8 : ld;  // V's rows (dP's k in pairs on TF32)
    static constexpr KOrder O = TF32 ? KOrder::Pair : KOrder::Split;  // dP's k order
    using Row = RowOperand<T, TF32>;
    static constexpr Operands P = tf32_or_exact<TF32>;
    using Tr = TransposedOperand<T, TF32>;
    const TiledBackwardArgs<T>& a;
    T *sk, *sv;
    WarpAOperand<T, TF32, KOrder::Split> qa;  // the warp's rows of Q (S's k in the MMA's order)
    WarpAOperand<T, TF32, O> ga;              // and of dout
    long long col;
    long long first;  // the warp's first row's position (its rows at first + qstride i)
    int dh, wq, g, q;

    /// Whether the key tile (nk keys at key0) needs no mask for the warp's rows (all 16 real).
    __device__ bool unmasked(int nk, long long key0) const {
        return wq >= 16 && warp_tile_unmasked(nk, TB, key0, first, a.f.qstride, a.f.window);
    }

    /// The key tile's nk rows (at kr of the prefix's rows or the sequences') into K, and V when
    /// `values`; then the warp's scores S into s. Every thread of the block calls it.
    __device__ void scores(long long kr, bool pre, int nk, bool values, T (&s)[1][NS][4]) const {
        const TiledAttentionArgs<T>& f = a.f;
        __syncthreads();  // the previous tile's reads are done
        const long long ks = pre ? f.kp_stride : f.seq_stride;
        const long long vs = pre ? f.vp_stride : f.seq_stride;
        warp_rows_load<T, TF32, DHP>(sk, ld, (pre ? f.k_prefix : f.k_seq) + kr * ks + col, ks, nk,
                                     TB, dh);
        if (values) {
            warp_rows_load<T, TF32, DHP>(sv, ldv, (pre ? f.v_prefix : f.v_seq) + kr * vs + col,
                                         vs, nk, TB, dh);
        }
        __syncthreads();
        tile_zero(s);
        if (wq > 0) {
            TITANS_UNROLL
            for (int k0 = 0; k0 < DHP; k0 += 8) {
                tile_step<T, P, 1, NS>(s, qa, operand_at<Tr>(sk, ld), g, g, k0, g, q);
            }
        }
    }

    /// Each row's maximum (w.m, in SoftmaxExp's units) and 1 / sum (inv): the forward's where
    /// a.stats_ready (rows at r0 of the flattened rows, head h), else over the key tiles (pass
    /// 1, online).
    __device__ void statistics(WarpRows<T, DHP>& w, T (&inv)[2], long long b, long long t0,
                               int nq, long long r0, int h) const {
        if (a.stats_ready) {  // block-uniform
            for (int r = 0; r < 2; ++r) {
                const long long at = (r0 + g + 8 * r) * a.f.H + h;
                w.m[r] = g + 8 * r < wq ? a.mx[at] * SoftmaxExp<T>::unit : T(0);
                inv[r] = g + 8 * r < wq ? a.inv[at] : T(0);
            }
            return;
        }
        const TiledShape shape{warp_tile_rows, TB};
        tiled_key_tiles(a.f, shape, b, t0, nq, [&](long long kr, bool pre, int nk, long long key0) {
            T s[1][NS][4];
            scores(kr, pre, nk, false, s);
            const T scale = a.f.scale * SoftmaxExp<T>::unit;
            if (wq > 0 && unmasked(nk, key0)) {
                warp_tile_softmax<T, TF32, DHP, NS, false>(w, s, nk, key0, a.f.window, scale, q);
            } else if (wq > 0) {
                warp_tile_softmax<T, TF32, DHP, NS>(w, s, nk, key0, a.f.window, scale, q);
            }
        });
        for (int r = 0; r < 2; ++r) {
            inv[r] = T(1) / quad_reduce(w.l[r], [](T x, T y) { return x + y; });
        }
        tile_zero(w.o);  // pass 1 rescaled it; dq starts here
    }

    /// One key tile's dS = scale P (dout V^T - delta), then dq (w.o) += dS K; the mask skipped
    /// where the tile needs none (Masked false).
    template <bool Masked>
    __device__ void adjoint(WarpRows<T, DHP>& w, const T (&s)[1][NS][4], const T (&inv)[2],
                            const T (&delta)[2], int nk, long long key0) const {
        T ds[1][NS][4];
        tile_zero(ds);
        const T scale = a.f.scale * SoftmaxExp<T>::unit;
        const T ps[2] = {inv[0] * a.f.scale, inv[1] * a.f.scale};  // a row's 1 / l and dS's scale
        TITANS_UNROLL
        for (int k0 = 0; k0 < DHP; k0 += 8) {
            tile_step<T, P, 1, NS, O>(ds, ga, operand_at<Tr>(sv, ldv), g, g, k0, g, q);
        }
        TITANS_UNROLL
        for (int ni = 0; ni < NS; ++ni) {
            TITANS_UNROLL
            for (int e = 0; e < 4; ++e) {
                const FragPlace at = frag_place(ni, e, g, q);
                const int r = e >> 1;
                bool seen = true;
                if constexpr (Masked) {
                    seen = at.row < wq && at.col < nk &&
                           tiled_sees(key0 < 0 ? -1 : key0 + at.col, w.qpos[r], a.f.window);
                }
                const T sp = seen ? SoftmaxExp<T>::of(s[0][ni][e] * scale - w.m[r]) * ps[r] : T(0);
                ds[0][ni][e] = tf32_stored<T, TF32>(sp * (ds[0][ni][e] - delta[r]));
            }
        }
        TITANS_UNROLL
        for (int ni = 0; ni < NS; ++ni) {
            tile_step_held<T, P, DHP / 8>(w.o, ds[0][ni], operand_at<Row>(sk, ld), g, 8 * ni, g, q);
        }
    }
};

/// The query pass: 64 queries of one head of one sequence (blockIdx x, y, z).
template <class T, bool TF32, int DHP>
__global__ void __launch_bounds__(tiled_threads)
    warp_query_backward_kernel(TiledBackwardArgs<T> a, T* dq, long long dq_stride) {
    using Pass = WarpQueryPass<T, TF32, DHP>;
    constexpr int TB = Pass::TB, NS = Pass::NS, ld = Pass::ld;
    const TiledAttentionArgs<T>& f = a.f;
    const long long b = blockIdx.z, t0 = static_cast<long long>(blockIdx.x) * warp_tile_rows;
    const int h = static_cast<int>(blockIdx.y), dh = f.d_head;
    const int nq = static_cast<int>(f.N - t0 < warp_tile_rows ? f.N - t0 : warp_tile_rows);
    const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
    const int g = lane / 4, q = lane % 4, wq = nq - 16 * warp;  // the warp's rows (<= 0: none)
    const long long col = static_cast<long long>(h) * dh, r0 = b * f.N + t0;
    const long long rw = r0 + 16 * warp;  // the warp's first row
    constexpr int ldg = TF32 ? DHP : ld;  // dout's rows (TF32: each warp's FragmentRows)
    T* sq = dynamic_shared<T>();
    T* sg = sq + warp_tile_rows * ld;
    T* sk = sg + warp_tile_rows * ldg;
    T* sv = sk + TB * ld;
    warp_a_rows_load<T, TF32, KOrder::Split, DHP>(sq, ld, f.q + r0 * f.q_stride + col,
                                                  f.q_stride, nq, dh);
    warp_a_rows_load<T, TF32, Pass::O, DHP>(sg, ld, a.dout + r0 * a.dout_stride + col,
                                            a.dout_stride, nq, dh);
    T delta[2] = {T(0), T(0)};
    if (wq > 0) {
        warp_rows_delta(a, rw, wq, col, dh, g, q, delta);
    }
    WarpRows<T, DHP> w;  // o: dq's rows; m, l: the softmax statistics
    tile_zero(w.o);
    for (int r = 0; r < 2; ++r) {
        w.m[r] = -static_cast<T>(INFINITY);
        w.l[r] = T(0);
        w.qpos[r] = f.pos0 + f.qstride * (t0 + 16 * warp + g + 8 * r);
    }
    const Pass pass{a,
                    sk,
                    sv,
                    warp_a_operand<T, TF32, KOrder::Split, DHP>(sq, warp, ld),
                    warp_a_operand<T, TF32, Pass::O, DHP>(sg, warp, ld),
                    col,
                    f.pos0 + f.qstride * (t0 + 16 * warp),
                    dh,
                    wq,
                    g,
                    q};
    T inv[2];
    pass.statistics(w, inv, b, t0, nq, rw, h);
    // Pass 2: dS per key tile, dq += dS K.
    tiled_key_tiles(f, TiledShape{warp_tile_rows, TB}, b, t0, nq,
                    [&](long long kr, bool pre, int nk, long long key0) {
                        T s[1][NS][4];
                        pass.scores(kr, pre, nk, true, s);
                        if (wq > 0 && pass.unmasked(nk, key0)) {
                            pass.template adjoint<false>(w, s, inv, delta, nk, key0);
                        } else if (wq > 0) {
                            pass.template adjoint<true>(w, s, inv, delta, nk, key0);
                        }
                    });
    if (wq <= 0) {
        return;
    }
    tile_store(w.o, g, 2 * q, [&](int r, int c, T v) {
        if (r < wq && c < dh) {
            dq[(rw + r) * dq_stride + col + c] = v;
        }
    });
    for (int r = 0; r < 2; ++r) {
        if (q == 0 && g + 8 * r < wq) {
            const long long at = (rw + g + 8 * r) * f.H + h;
            a.mx[at] = w.m[r] * SoftmaxExp<T>::natural;
            a.inv[at] = inv[r];
            a.delta[at] = delta[r];
        }
    }
}

/// One query tile (rows q0 .. q0 + nq - 1, flattened b N + t) against the warp's 16 keys of a
/// key-pass block: dv += P^T dout, dk += dS^T Q (dk in w.o's place, dv in gv; dS without its
/// scale, which dk takes as it is stored).
template <class T, bool TF32, int DHP>
struct WarpKeyTile {
    using L = WarpBackwardLayout<T, DHP>;
    static constexpr int TB = L::tb, NS = TB / 8, ld = L::ld;
    using Row = RowOperand<T, TF32>;
    static constexpr Operands P = tf32_or_exact<TF32>;
    using Tr = TransposedOperand<T, TF32>;
    const TiledAttentionArgs<T>& f;
    WarpAOperand<T, TF32, KOrder::Split> ka, va;  // the warp's rows of K and V
    const T *sq, *sg, *st;
    int g, q;

    /// The tile of nq query rows, the first at position qp0 (queries at qp0 + qstride i; unused
    /// for prefix keys, key0 -1), against the warp's nk keys (16 or more: all real) from key0.
    __device__ void operator()(T (&dk)[1][DHP / 8][4], T (&dv)[1][DHP / 8][4], long long qp0,
                               int nq, long long key0, int nk) const {
        T s[1][NS][4], dp[1][NS][4];
        tile_zero(s);
        tile_zero(dp);
        TITANS_UNROLL
        for (int k0 = 0; k0 < DHP; k0 += 8) {
            tile_step<T, P, 1, NS>(s, ka, operand_at<Tr>(sq, ld), g, g, k0, g, q);
            tile_step<T, P, 1, NS>(dp, va, operand_at<Tr>(sg, ld), g, g, k0, g, q);
        }
        // No mask where every query of a full tile sees each of the warp's 16 keys.
        if (nq == TB && nk >= 16 &&
            keys_seen_by_all(key0, 16, qp0, qp0 + f.qstride * (TB - 1), f.window)) {  // uniform
            weights<false>(s, dp, qp0, nq, key0, nk);
        } else {
            weights<true>(s, dp, qp0, nq, key0, nk);
        }
        TITANS_UNROLL
        for (int ni = 0; ni < NS; ++ni) {  // dv += P^T dout, dk += dS^T Q
            tile_step_held<T, P, DHP / 8>(dv, s[0][ni], operand_at<Row>(sg, ld), g, 8 * ni, g, q);
            tile_step_held<T, P, DHP / 8>(dk, dp[0][ni], operand_at<Row>(sq, ld), g, 8 * ni, g, q);
        }
    }

    /// The scores s become P and dp becomes dS / scale (both rounded to TF32 for TF32 products;
    /// dk takes the scale once, as it is stored), each entry tested against the window unless
    /// Masked is false.
    template <bool Masked>
    __device__ void weights(T (&s)[1][NS][4], T (&dp)[1][NS][4], long long qp0, int nq,
                            long long key0, int nk) const {
        const T scale = f.scale * SoftmaxExp<T>::unit;
        TITANS_UNROLL
        for (int ni = 0; ni < NS; ++ni) {
            TITANS_UNROLL
            for (int e = 0; e < 4; ++e) {
                const FragPlace at = frag_place(ni, e, g, q);  // row: a key, col: a query
                bool seen = true;
                if constexpr (Masked) {
                    seen = at.col < nq && at.row < nk &&
                           tiled_sees(key0 < 0 ? -1 : key0 + at.row, qp0 + f.qstride * at.col,
                                      f.window);
                }
                const T* r = st + 3 * at.col;
                const T p = seen ? SoftmaxExp<T>::of(s[0][ni][e] * scale - r[0]) * r[1] : T(0);
                dp[0][ni][e] = tf32_stored<T, TF32>(p * (dp[0][ni][e] - r[2]));  // dS / scale
                s[0][ni][e] = tf32_stored<T, TF32>(p);
            }
        }
    }
};

/// The key pass: 64 keys (blockIdx.x) of one head (y) of sequence z's window (prefix false) or
/// of the prefix (sequence z's rows, or the shared rows for every sequence when z = 0 and the
/// prefix is shared).
template <class T, bool TF32, int DHP>
__global__ void __launch_bounds__(tiled_threads)
    warp_key_backward_kernel(TiledBackwardArgs<T> a, bool prefix, long long batch,
                             TiledKeyGrads<T> out) {
    using L = WarpBackwardLayout<T, DHP>;
    constexpr int TB = L::tb, ld = L::ld;
    const TiledAttentionArgs<T>& f = a.f;
    const long long b = blockIdx.z, j0 = static_cast<long long>(blockIdx.x) * warp_tile_rows;
    const int h = static_cast<int>(blockIdx.y), dh = f.d_head;
    const long long rows = prefix ? f.p : f.seq_rows;
    const int nk = static_cast<int>(rows - j0 < warp_tile_rows ? rows - j0 : warp_tile_rows);
    const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
    const int wk = nk - 16 * warp;  // the warp's keys (<= 0: none)
    const long long col = static_cast<long long>(h) * dh;
    const long long kr = prefix ? (f.shared ? 0 : b * f.p) + j0 : b * f.seq_rows + j0;
    T* sk = dynamic_shared<T>();
    T* sv = sk + warp_tile_rows * ld;
    T* sq = sv + warp_tile_rows * ld;
    T* sg = sq + TB * ld;
    T* st = sg + TB * ld;
    const T* k = prefix ? f.k_prefix : f.k_seq;
    const T* v = prefix ? f.v_prefix : f.v_seq;
    const long long ks = prefix ? f.kp_stride : f.seq_stride,
                    vs = prefix ? f.vp_stride : f.seq_stride;
    warp_a_rows_load<T, TF32, KOrder::Split, DHP>(sk, ld, k + kr * ks + col, ks, nk, dh);
    warp_a_rows_load<T, TF32, KOrder::Split, DHP>(sv, ld, v + kr * vs + col, vs, nk, dh);
    long long r0 = 0, r1 = 0;
    tiled_key_queries(f, prefix, batch, b, j0, nk, r0, r1);
    const WarpKeyTile<T, TF32, DHP> tile{f,
                                         warp_a_operand<T, TF32, KOrder::Split, DHP>(sk, warp, ld),
                                         warp_a_operand<T, TF32, KOrder::Split, DHP>(sv, warp, ld),
                                         sq,
                                         sg,
                                         st,
                                         lane / 4,
                                         lane % 4};
    T dk[1][DHP / 8][4], dv[1][DHP / 8][4];
    tile_zero(dk);
    tile_zero(dv);
    for (long long q0 = r0; q0 < r1; q0 += TB) {
        const int nq = static_cast<int>(r1 - q0 < TB ? r1 - q0 : TB);
        __syncthreads();  // the previous tile's reads are done
        warp_rows_load<T, TF32, DHP>(sq, ld, f.q + q0 * f.q_stride + col, f.q_stride, nq, TB, dh);
        warp_rows_load<T, TF32, DHP>(sg, ld, a.dout + q0 * a.dout_stride + col, a.dout_stride, nq,
                                     TB, dh);
        for (int r = threadIdx.x; r < TB; r += blockDim.x) {
            const long long at = (q0 + r) * f.H + h;
            st[3 * r] = r < nq ? a.mx[at] * SoftmaxExp<T>::unit : T(0);
            st[3 * r + 1] = r < nq ? a.inv[at] : T(0);
            st[3 * r + 2] = r < nq ? a.delta[at] : T(0);
        }
        __syncthreads();
        if (wk > 0) {
            tile(dk, dv, prefix ? 0 : f.pos0 + f.qstride * (q0 - b * f.N), nq,
                 prefix ? -1 : j0 + 16 * warp, wk);
        }
    }
    if (wk <= 0) {
        return;
    }
    const int g = lane / 4, q = lane % 4;
    tile_store(dk, g, 2 * q, [&](int r, int c, T x) {
        if (r < wk && c < dh) {
            out.dk[(kr + 16 * warp + r) * out.stride + col + c] = x * f.scale;  // dS's scale
        }
    });
    tile_store(dv, g, 2 * q, [&](int r, int c, T x) {
        if (r < wk && c < dh) {
            out.dv[(kr + 16 * warp + r) * out.stride + col + c] = x;
        }
    });
}

/// The three passes for head width DHP (see tiled_backward_passes).
template <class T, bool TF32, int DHP>
void warp_backward_launch(cudaStream_t stream, const TiledBackwardArgs<T>& a, long long B, T* dq,
                          long long dq_stride, TiledKeyGrads<T> window, TiledKeyGrads<T> prefix) {
    using L = WarpBackwardLayout<T, DHP>;
    const auto blocks = [](long long n) {
        return static_cast<unsigned>((n + warp_tile_rows - 1) / warp_tile_rows);
    };
    const auto H = static_cast<unsigned>(a.f.H);
    void (*query)(TiledBackwardArgs<T>, T*, long long) = warp_query_backward_kernel<T, TF32, DHP>;
    void (*keys)(TiledBackwardArgs<T>, bool, long long, TiledKeyGrads<T>) =
        warp_key_backward_kernel<T, TF32, DHP>;
    raise_shared_limit(query, L::bytes);
    raise_shared_limit(keys, L::bytes);
    if (a.f.N > 0) {
        launch_shared(query, dim3(blocks(a.f.N), H, static_cast<unsigned>(B)), dim3(tiled_threads),
                      L::bytes, stream, a, dq, dq_stride);
        check_launch("the warp-tiled attention backward (queries)");
    }
    if (a.f.seq_rows > 0) {
        launch_shared(keys, dim3(blocks(a.f.seq_rows), H, static_cast<unsigned>(B)),
                      dim3(tiled_threads), L::bytes, stream, a, false, B, window);
        check_launch("the warp-tiled attention backward (keys)");
    }
    if (a.f.p > 0) {
        launch_shared(keys, dim3(blocks(a.f.p), H, static_cast<unsigned>(a.f.shared ? 1 : B)),
                      dim3(tiled_threads), L::bytes, stream, a, true, B, prefix);
        check_launch("the warp-tiled attention backward (prefix keys)");
    }
}

/// The passes in warp tiles, on the tensor cores when tf32 (float only).
template <class T>
void warp_backward(cudaStream_t stream, const TiledBackwardArgs<T>& a, long long B, T* dq,
                   long long dq_stride, TiledKeyGrads<T> window, TiledKeyGrads<T> prefix,
                   bool tf32) {
    const int dhp = warp_tile_width(a.f.d_head);
    if constexpr (std::is_same_v<T, float>) {
        if (tf32) {
            dhp == 32
                ? warp_backward_launch<T, true, 32>(stream, a, B, dq, dq_stride, window, prefix)
            : dhp == 64
                ? warp_backward_launch<T, true, 64>(stream, a, B, dq, dq_stride, window, prefix)
                : warp_backward_launch<T, true, 128>(stream, a, B, dq, dq_stride, window, prefix);
            return;
        }
        dhp == 32 ? warp_backward_launch<T, false, 32>(stream, a, B, dq, dq_stride, window, prefix)
        : dhp == 64
            ? warp_backward_launch<T, false, 64>(stream, a, B, dq, dq_stride, window, prefix)
            : warp_backward_launch<T, false, 128>(stream, a, B, dq, dq_stride, window, prefix);
    } else {  // double: no block fits at d_h above 64 (warp_backward_fits)
        dhp == 32 ? warp_backward_launch<T, false, 32>(stream, a, B, dq, dq_stride, window, prefix)
                  : warp_backward_launch<T, false, 64>(stream, a, B, dq, dq_stride, window, prefix);
    }
}

/// Whether the backward of B sequences runs in warp tiles: N >= 16 queries a sequence, a block
/// that fits (warp_backward_bytes) within the device's opt-in limit, the grids within bounds.
template <class T>
bool warp_backward_fits(const TiledAttentionArgs<T>& f, long long B) {
    const std::size_t bytes = warp_backward_bytes(f.d_head, sizeof(T));
    const long long most =
        f.N > f.seq_rows ? (f.N > f.p ? f.N : f.p) : (f.seq_rows > f.p ? f.seq_rows : f.p);
    return f.N >= 16 && bytes > 0 &&
           tiled_grid_fits(B, most, f.H, TiledShape{warp_tile_rows, warp_tile_rows}) &&
           bytes <= shared_memory_limit();
}

/// The tiled backward's passes (the query pass, then the window's and the prefix's key
/// passes): in warp tiles where the mode is Auto and they fit, else in the scalar tiles where
/// tiles are on and one fits (tiled_backward_shape); false, nothing run, otherwise (the
/// per-row backward's case). tf32: the warp tiles' products on the tensor cores (float).
template <class T>
bool tiled_backward_passes(cudaStream_t stream, const TiledBackwardArgs<T>& a, long long B, T* dq,
                           long long dq_stride, TiledKeyGrads<T> window, TiledKeyGrads<T> prefix,
                           bool tf32) {
    const TiledAttentionMode mode = tiled_attention();
    if (mode == TiledAttentionMode::Auto && warp_backward_fits(a.f, B)) {
        warp_backward(stream, a, B, dq, dq_stride, window, prefix, tf32);
        return true;
    }
    const TiledShape shape = mode == TiledAttentionMode::Off
                                 ? TiledShape{}
                                 : tiled_backward_shape(a.f.d_head, sizeof(T));
    if (!tiled_grid_fits(B, a.f.N > a.f.seq_rows ? a.f.N : a.f.seq_rows, a.f.H, shape)) {
        return false;
    }
    tiled_query_backward(stream, a, B, shape, dq, dq_stride);
    tiled_key_backward(stream, a, B, shape, false, window);
    tiled_key_backward(stream, a, B, shape, true, prefix);
    return true;
}

#endif

}  // namespace titans::backend::cuda
