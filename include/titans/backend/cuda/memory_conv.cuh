#pragma once
// titans/backend/cuda/memory_conv.cuh: the projections' kernel after the input product (math
// §1): the causal conv, phi and the gate logits' bias in the pair-major layout, and, in the
// same kernel, q and k divided by their rows' L2 norms where a block covers whole heads.

#include <cstddef>
#include <type_traits>

#include "../../config.hpp"
#include "../../detail/activation.hpp"
#include "../../detail/norm_scale.hpp"
#include "fast_math.cuh"
#include "launch.cuh"
#include "memory_device.cuh"

namespace titans::backend::cuda {

/// Threads (columns) and token rows of a conv_tile_kernel block.
inline constexpr int conv_threads = 128;
inline constexpr int conv_rows = 32;

/// Row stride of the q and k values a block stages for norm_tile (a column a thread; the one
/// extra entry puts a warp's reads of 32 rows in distinct banks).
inline constexpr int conv_shared_ld = conv_threads + 1;

/// Whether conv_tile_kernel normalises q and k itself (ConvTile::norm) for heads of d_h: its
/// blocks' columns then cover whole heads and each warp's lie in one (d_h = 32, 64, 128).
TITANS_HOST_DEVICE constexpr bool conv_norms(long long dh) {
    return dh % 32 == 0 && conv_threads % dh == 0;
}

/// The dynamic shared memory of a normalising conv_tile_kernel block: the staged values, the
/// warps' sums of squares and the heads' reciprocal norms (at most one a warp), a row each.
template <class T>
constexpr std::size_t conv_norm_shared() {
    return sizeof(T) * conv_rows * (conv_shared_ld + 2 * (conv_threads / 32));
}

/// The conv kernel size conv_tile_kernel has a compiled row loop for (its template argument
/// KT; 0: any K, read at run time): K = 4, the default (MemoryConfig::conv_kernel).
TITANS_HOST_DEVICE constexpr int conv_compiled_k(bool conv, int K) {
    return conv && K == 4 ? 4 : 0;
}

#if TITANS_CUDA_DEVICE_CODE

/// A column's conv taps in registers (K - 1 <= held): older[i] weighs input t - (K - 1) + i,
/// newest input t. older[i] is 0 from i = K - 1 on, where the window holds 0 too (conv_column
/// never slides an input there), so conv_step's sum over every i adds exact zeros and needs
/// no test of K. Loaded once a column: read in the row loop, the taps were loaded again after
/// every row's store (the store may alias them for the compiler), K loads a row.
template <class T, int held>
struct ConvTaps {
    T older[held];
    T newest;
};

/// One row t of conv_column: x (its input) through the conv, phi (SiLU on fast_sigmoid: the
/// special function unit in float), into *out (returned). With in_registers, tp holds the taps
/// and win the last K - 1 inputs, advanced by one row (where K is a compile-time constant the
/// slide is register renames; at run time a select an entry); else (K - 1 > held) the taps are
/// read from `taps` and the inputs by input(tt).
template <class T, int held, class In>
__device__ inline T conv_step(const ConvTaps<T, held>& tp, const T* taps, T x,
                              T (&win)[held], int C3, int K, int c, bool conv, bool silu,
                              bool in_registers, const In& input, long long t, T* out) {
    T val = x;
    if (conv && in_registers) {
        val *= tp.newest;
        TITANS_UNROLL
        for (int i = 0; i < held; ++i) {
            val += tp.older[i] * win[i];
        }
        TITANS_UNROLL
        for (int i = 0; i < held; ++i) {  // slide: the newest input last
            win[i] = i + 1 < K - 1 ? win[i + 1 < held ? i + 1 : i]
                                   : (i + 1 == K - 1 ? x : win[i]);
        }
    } else if (conv) {
        val *= taps[static_cast<long long>(K - 1) * C3 + c];
        for (int i = 0; i < K - 1; ++i) {
            val += taps[static_cast<long long>(i) * C3 + c] * input(t - K + 1 + i);
        }
    }
    *out = silu ? val * fast_sigmoid(val) : val;
    return *out;
}

/// What conv_tile_kernel reads and writes (math §1 after the input product). u: M x ld, the
/// product x [W_Q | W_K | W_V | w_theta | w_eta | w_alpha] (M = B N rows, sequence-major).
/// Its columns [0, C) (C = D for queries only, else 3D) go through the causal conv (rows
/// before the piece from `tail`, (K-1) x 3D per sequence), phi, and into the pair-major
/// layout [s*H + h][t][d_h] of q (and k, v). Its G columns [C, C + G) (G = 3H, or 0) are the
/// gate logits: lp[[s*H + h][t][g]] = u + bias (g: theta, eta, alpha). Blocks of `rows` token
/// rows, `tiles` a sequence; `advance` (one tile a sequence only): the conv tails advanced
/// too. `sink` (where on): the forward's check of what the kernel writes, row t of sequence
/// s keyed s N + t: v into slot 0, and q and k where `check_qk` (no L2 norm after it), the gate
/// logits into slot 4. `norm` (conv_norms(dh), blocks of conv_threads x conv_rows and
/// conv_norm_shared bytes of dynamic shared memory): q and k divided by their rows' L2 norms
/// in the kernel (norm_tile), checked into slot 0 where the sink is on.
template <class T>
struct ConvTile {
    const T* u;
    long long ld;
    const T* taps;
    T* tail;
    T *q, *k, *v;
    long long N;
    int C, C3, K, D, dh, H;
    bool conv, silu;
    int rows;
    long long tiles;
    bool advance;
    const T* bias;
    T* lp;
    int G;
    FlagSink sink;
    bool check_qk;
    bool norm;
};

/// Column c's conv tail of sequence s (ConvTile::advance): the last K - 1 inputs of [tail; u],
/// from the window in registers (in_registers) or input(t), over the old tail the column's
/// thread alone read; ascending, row r reads row r + N > r (advance_tail's order).
template <class T, int held, class In>
__device__ void conv_advance_tail(const ConvTile<T>& a, long long s, int c, int K,
                                  const T (&win)[held], bool in_registers, const In& input) {
    for (int r = 0; r < K - 1; ++r) {
        T x = T(0);
        if (in_registers) {
            TITANS_UNROLL
            for (int i = 0; i < held; ++i) {
                x = i == r ? win[i] : x;
            }
        } else {
            x = input(a.N - (K - 1) + r);
        }
        a.tail[(s * (K - 1) + r) * a.C3 + c] = x;
    }
}

/// Column c of u (c < C) over token rows [t0, t1) of sequence s (ConvTile). The thread walks
/// the column down the rows with the last K - 1 inputs and the K taps in registers (K <= 8;
/// longer kernels read them again), so each entry of u is read once, in batches of 8 rows whose
/// loads are in flight together. KT (conv_compiled_k: a.conv and a.K == KT) makes K a
/// compile-time constant; 0 reads it from a. With `advance` (one thread walks the whole sequence, t0 = 0 and t1 = N)
/// the thread then writes the column's new tail, the last K - 1 inputs of [tail; u], over the
/// old one it alone read.
template <class T, int KT = 0>
__device__ void conv_column(const ConvTile<T>& a, long long s, long long t0, long long t1,
                            int c, T* staged_rows = nullptr) {
    constexpr int held = KT > 1 ? KT - 1 : 7;  // inputs kept in registers: K - 1 <= held
    const long long N = a.N;
    const int K = KT > 0 ? KT : a.K, C3 = a.C3, D = a.D, dh = a.dh;
    const bool conv = KT > 0 || a.conv;
    const int which = c / D, h = (c - which * D) / dh, j = c - which * D - h * dh;
    T* out = (which == 0 ? a.q : (which == 1 ? a.k : a.v)) + (s * a.H + h) * N * dh + j;
    // q and k normalised in the kernel: the rows go to the block's shared memory first
    const bool staged = staged_rows != nullptr && which < 2;
    T* const at = staged ? staged_rows : out + t0 * dh;
    const long long stride = staged ? conv_shared_ld : dh;
    const T* u = a.u;
    const T* tail = a.tail;
    const long long ld = a.ld;
    const auto input = [&](long long tt) {  // pre-conv row tt of the sequence (tt < 0: tail)
        return tt >= 0 ? u[(s * N + tt) * ld + c] : tail[(s * (K - 1) + tt + K - 1) * C3 + c];
    };
    const bool in_registers = K - 1 <= held;
    T win[held];  // win[i] = input(t - (K - 1) + i)
    ConvTaps<T, held> tp{};
    TITANS_UNROLL
    for (int i = 0; i < held; ++i) {
        const bool used = conv && in_registers && i < K - 1;
        win[i] = used ? input(t0 - (K - 1) + i) : T(0);
        tp.older[i] = used ? a.taps[static_cast<long long>(i) * C3 + c] : T(0);
    }
    tp.newest = conv && in_registers ? a.taps[static_cast<long long>(K - 1) * C3 + c] : T(0);
    constexpr int batch = 8;  // rows whose inputs are loaded before any output is stored
    T chk = T(0);  // the sum of z - z over the outputs: 0, or NaN where one is not finite
    // Row pointers advanced by a row's stride (ld and stride are below 2^31 entries: the
    // projection's GEMM takes ld as an int), not recomputed from 64-bit products each row
    // (about 16 integer instructions a row's load did); a pointer moves on only where the next
    // row exists.
    const int step = static_cast<int>(ld), ostep = static_cast<int>(stride);
    const T* src = u + (s * N + t0) * ld + c;
    T* dst = at;
    // m rows from tb; `whole` (m = batch, known when compiled): no test a row
    const auto rows = [&](auto whole, long long tb, int m, bool more) {
        constexpr bool all = decltype(whole)::value;
        T xs[batch];
        TITANS_UNROLL
        for (int r = 0; r < batch; ++r) {
            xs[r] = all || r < m ? *src : T(0);
            src = (all ? r + 1 < batch : r + 1 < m) || more ? src + step : src;
        }
        TITANS_UNROLL
        for (int r = 0; r < batch; ++r) {
            if (all || r < m) {
                const T z = conv_step(tp, a.taps, xs[r], win, C3, K, c, conv, a.silu,
                                      in_registers, input, tb + r, dst);
                dst = (all ? r + 1 < batch : r + 1 < m) || more ? dst + ostep : dst;
                chk += z - z;
            }
        }
    };
    for (long long tb = t0; tb < t1; tb += batch) {
        const bool more = tb + batch < t1;  // rows after the batch
        if (tb + batch <= t1) {
            rows(std::true_type{}, tb, batch, more);
        } else {
            rows(std::false_type{}, tb, static_cast<int>(t1 - tb), more);
        }
    }
    const bool bad = !(chk == T(0));  // an output not finite
    // (rare) which row: the thread's own stores again (staged q and k: norm_tile checks them)
    if (bad && !staged && (which == 2 || a.check_qk)) {
        long long t = t0;
        while (t + 1 < t1 && !not_finite(out[t * dh])) ++t;
        flag_report(a.sink, 0, s * N + t);
    }
    if (a.advance) {
        conv_advance_tail(a, s, c, K, win, in_registers, input);
    }
}

/// out[3 t] = col[t ld] + bias for t < n, 8 rows' loads in flight before their stores (a
/// store may alias col for the compiler: a plain loop waits on each row's load in turn).
/// Returns the first t whose logit is not finite (n: none). Not inlined: its registers stay
/// out of the conv columns' count (conv_tile_kernel's occupancy).
template <class T>
__device__ __noinline__ long long gate_rows(const T* col, long long ld, T* out, T bias,
                                            long long n) {
    constexpr int batch = 8;
    long long bad = n;
    for (long long tb = 0; tb < n; tb += batch) {
        T xs[batch];
        if (tb + batch <= n) {  // a whole batch: no tests between the loads
            TITANS_UNROLL
            for (int r = 0; r < batch; ++r) {
                xs[r] = col[(tb + r) * ld];
            }
        } else {
            TITANS_UNROLL
            for (int r = 0; r < batch; ++r) {
                xs[r] = tb + r < n ? col[(tb + r) * ld] : T(0);
            }
        }
        TITANS_UNROLL
        for (int r = 0; r < batch; ++r) {
            if (tb + r < n) {
                const T z = xs[r] + bias;
                out[(tb + r) * 3] = z;
                bad = not_finite(z) && bad == n ? tb + r : bad;
            }
        }
    }
    return bad;
}

/// Gate column g (< G) of u over token rows [t0, t1) of sequence s: the logits plus their
/// bias, pair-major (ConvTile).
template <class T>
__device__ void gate_column(const ConvTile<T>& a, long long s, long long t0, long long t1,
                            int g) {
    const int which = g / a.H, h = g - which * a.H;
    const long long bad = gate_rows(a.u + (s * a.N + t0) * a.ld + a.C + g, a.ld,
                                    a.lp + ((s * a.H + h) * a.N + t0) * 3 + which, a.bias[g],
                                    t1 - t0);
    if (bad < t1 - t0) {
        flag_report(a.sink, 4, s * a.N + t0 + bad);
    }
}

/// Entry j of a row of d_h entries (`row`, contiguous) over the row's L2 norm where its sum of
/// squares overflows: every entry scaled by 2^-e first (l2_row's scaled path,
/// detail/norm_scale.hpp). Not inlined: the rare path's registers stay out of norm_tile's.
template <class T>
__device__ __noinline__ T scaled_unit(const T* row, int dh, int j) {
    T amax = T(0);
    for (int i = 0; i < dh; ++i) {
        amax = fabs(row[i]) > amax ? fabs(row[i]) : amax;
    }
    const int e = detail::scale_exponent(amax);
    T scaled = T(0);
    for (int i = 0; i < dh; ++i) {
        const T z = detail::scale_down(row[i], e);
        scaled += z * z;
    }
    return detail::scale_down(row[j], e) / sqrt(scaled);
}

/// The q and k columns [cb, cb + conv_threads) of one tile (n rows from t0 of sequence s)
/// divided by their rows' L2 norms, at least 1e-12 (l2_row's math), from the values conv_column
/// staged in `sh` (conv_rows x conv_shared_ld, a column a thread) into the pair-major q and k.
/// Warp w sums the squares of its 32 columns, a lane a row, after the values; a thread a (row,
/// head) then adds the head's d_h / 32 sums into the reciprocal of the row's norm, and each
/// thread multiplies its column by it (one division a row and head, not an entry; -1 marks a
/// sum that overflowed or is NaN: scaled_unit's path). Columns from min(C, 2D) on (v, the
/// gates) are left alone. The check (where a.sink is on): each thread's first non-finite row,
/// keyed s N + t into slot 0. Every thread of the block calls it (a barrier inside).
template <class T>
__device__ void norm_tile(const ConvTile<T>& a, long long s, long long t0, int n, int cb,
                          T* sh) {
    constexpr int ld = conv_shared_ld, warps = conv_threads / 32;
    T* const sums = sh + conv_rows * ld;
    T* const inv = sums + conv_rows * warps;  // [row][head of the block]
    const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, w = tid / 32;
    const int qk = a.C < 2 * a.D ? a.C : 2 * a.D, dh = a.dh;
    const int per = dh / 32, heads = conv_threads / dh;  // a head's warps, the block's heads
    if (cb + 32 * w < qk && lane < n) {  // a warp's columns lie in one head (d_h % 32 == 0)
        const T* row = sh + lane * ld + 32 * w;
        T ss = T(0);
        for (int j = 0; j < 32; ++j) {
            ss += row[j] * row[j];
        }
        sums[lane * warps + w] = ss;
    }
    __syncthreads();
    if (tid < n * heads && cb + tid % heads * dh < qk) {  // row tid / heads, its head's norm
        const int r = tid / heads, hb = tid % heads;
        T ss = T(0);
        for (int i = 0; i < per; ++i) {
            ss += sums[r * warps + hb * per + i];
        }
        const T nrm = sqrt(ss) > T(1e-12) ? sqrt(ss) : T(1e-12);
        inv[r * heads + hb] = ss <= detail::largest_finite<T>() ? T(1) / nrm : T(-1);
    }
    __syncthreads();
    const int c = cb + tid;
    if (c >= qk) {
        return;
    }
    const int hb = tid / dh, first = hb * dh;  // the column's head in the block, its first
    const int which = c / a.D, h = (c - which * a.D) / dh;
    T* const out = (which == 0 ? a.q : a.k) + ((s * a.H + h) * a.N + t0) * dh + c % dh;
    int bad = n;
    for (int r = 0; r < n; ++r) {
        const T iv = inv[r * heads + hb];
        const T z = iv > T(0) ? sh[r * ld + tid] * iv
                              : scaled_unit(sh + r * ld + first, dh, tid - first);
        out[static_cast<long long>(r) * dh] = z;
        bad = not_finite(z) && bad == n ? r : bad;
    }
    if (bad < n) {
        flag_report(a.sink, 0, s * a.N + t0 + bad);
    }
}

/// conv_column and gate_column over tiles of `rows` token rows: blockIdx.x = s * tiles + tile,
/// the C + G columns strided over blockIdx.y in blocks of blockDim.x (a warp's 32 columns make
/// its reads and writes coalesce). With a.norm, a block's q and k columns are staged in its
/// dynamic shared memory and normalised by norm_tile (a block covers whole heads: d_h divides
/// conv_threads). KT: conv_compiled_k(a.conv, a.K) (conv_column).
template <class T, int KT>
__global__ void conv_tile_kernel(ConvTile<T> a) {
    const long long s = blockIdx.x / a.tiles, t0 = blockIdx.x % a.tiles * a.rows;
    const long long t1 = t0 + a.rows < a.N ? t0 + a.rows : a.N;
    T* const sh = a.norm ? dynamic_shared<T>() : nullptr;
    const int qk = a.C < 2 * a.D ? a.C : 2 * a.D, width = static_cast<int>(blockDim.x);
    // cb is the same for the whole block (the barriers in norm_tile)
    for (int cb = static_cast<int>(blockIdx.y) * width; cb < a.C + a.G;
         cb += static_cast<int>(gridDim.y) * width) {
        const int c = cb + static_cast<int>(threadIdx.x);
        if (c < a.C) {
            conv_column<T, KT>(a, s, t0, t1, c, sh == nullptr ? nullptr : sh + threadIdx.x);
        } else if (c < a.C + a.G) {
            gate_column(a, s, t0, t1, c - a.C);
        }
        if (sh != nullptr && cb < qk) {
            __syncthreads();
            norm_tile(a, s, t0, static_cast<int>(t1 - t0), cb, sh);
            __syncthreads();  // the values read before the next columns' are staged
        }
    }
}

#endif  // TITANS_CUDA_DEVICE_CODE

}  // namespace titans::backend::cuda
