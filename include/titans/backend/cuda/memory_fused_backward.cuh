#pragma once
// titans/backend/cuda/memory_fused_backward.cuh: the memory's backward over full chunks in one
// kernel (math §9, a depth-2 memory with lagged retrieval; the fused forward's reverse).
//
// A block per (sequence, head) pair sweeps a run of full chunks, last first, as the sweep's
// stages do (memory_sweep.cuh), with the chunk's intermediates in shared memory (or, where
// they do not fit, in a device scratch of the block's own, which stays in L2) and the
// products in warp tiles (tile_product.cuh; TF32 or plain FMAs):
//   keys     Z = K W1, A = act(Z), D2 = A W2 (+ K) - V, Bk = D2 W2^T, Dl = Bk . act'(Z)
//   gates    theta0, theta (clipped), eta, alpha, g2 per row; g, s, beta, c, P of the end
//   weights  dW = be dW' (+ the products below), dS = ce dW' + pe dS', <dW',W>, <dW',S>, <dS',S>
//   read     R = Q W1, y = act(R) W2 (+ Q); dW2 += act(R)^T dy; R = act'(R) . (dy W2^T); dW1 += Q^T R;
//            dq += R W1^T (+ dy)
//   end      Db1 = -(g . K dW1' + s . K dS1'),  Ab0 = -(g Dl) dW1'^T - (s Dl) dS1'^T,
//            Db2 = -(g . A dW2' + s . A dS2'),  Ab1 = -(g D2) dW2'^T - (s D2) dS2'^T,
//            dg_i, ds_i the rows' dot products with Dl, D2
//   coefficients, clipping reversed (one thread, a warp per row)
//   tape     bb = Db1 . act'(Z), Zb = Db1 . Bk . act''(Z); Db2 += bb W2;
//            dW2 += bb^T D2 + A^T Db2; Ab1 += Db2 W2^T; Zb += Ab1 . act'(Z);
//            dW1 += K^T Zb; Ab0 += Zb W1^T; dk += Ab0 (+ Db2); dv -= Db2
//   logits   the gates' adjoints into the logits
// dW, dS (the chunk start's adjoints, device memory, two sets alternating with the chunk
// end's) are written by the weights pass and added to by the products' tiles. The same
// arithmetic as the sweep up to the order of sums; CPU parity in docs/cuda.md.

#include <atomic>
#include <cstddef>

#include "../../config.hpp"
#include "../../detail/activation.hpp"
#include "../../memory/chunk_coefficients.hpp"
#include "../../memory/chunk_coefficients_backward.hpp"
#include "fast_math.cuh"
#include "launch.cuh"
#include "memory_device.cuh"
#include "memory_fused.cuh"
#include "runtime.cuh"
#include "tile_product.cuh"

namespace titans::backend::cuda {

/// Launches of the fused backward kernel in this process (tests and benchmarks read it).
inline std::atomic<long long>& fused_backward_launches() {
    static std::atomic<long long> count{0};
    return count;
}

/// Whether the memory's backward runs its full chunks in the fused kernel where the forward's
/// fused_memory() setting would run the fused forward (the sweep's fused_plan). Opt-in until
/// a GPU has checked and timed it (off: the sweep's stages; benchmarks time both); on from
/// the start when the environment sets TITANS_FUSED_BACKWARD=1. Process-wide, read at every
/// backward call.
inline std::atomic<bool>& fused_backward_flag() {
    static std::atomic<bool> flag{env_switch("TITANS_FUSED_BACKWARD")};
    return flag;
}
inline void set_fused_backward(bool on) { fused_backward_flag().store(on); }

/// At most how many of the fused backward's six b x hidden arrays stay in shared memory
/// (-1: as many as fit, the default; tests set 0 to 6 so that every placement runs the same
/// code). Process-wide, read at every backward call.
inline std::atomic<int>& fused_backward_chip_flag() {
    static std::atomic<int> cap{-1};
    return cap;
}
inline void set_fused_backward_chip(int cap) { fused_backward_chip_flag().store(cap); }

/// The fused backward's arrays, in entries of T: four of b x (d_h + 8) in shared memory (K,
/// D2, and Q then Ab0, dy then Db2: the read's inputs, dead once the read is reversed, give
/// their place to the adjoints of K and D2 that the chunk end writes first), the pair's
/// vector, then the first `chip` of the six b x (h + 8) arrays, hottest first (R then Db1,
/// A, Dl, Bk then Zb, Z, Ab1); the others in a device scratch of the block's own.
struct FusedBackLayout {
    FusedLayout lay;
    int chip;  // b x hidden arrays in shared memory, 0 to 6
    TITANS_HOST_DEVICE long long small() const { return static_cast<long long>(lay.b) * lay.ldk(); }
    TITANS_HOST_DEVICE long long big() const { return static_cast<long long>(lay.b) * lay.ldh(); }
    /// Row partial sums of the end's row terms: b x (h + d_h) / 16 for each of dg, ds.
    TITANS_HOST_DEVICE long long parts() const {
        return static_cast<long long>(lay.b) * ((lay.h + lay.dh) / 16);
    }
    TITANS_HOST_DEVICE long long vec() const { return 4 * small(); }
    TITANS_HOST_DEVICE long long vec_entries() const { return 22LL * lay.b + 8 + 64 + 2 * parts(); }
    TITANS_HOST_DEVICE long long big_at() const { return vec() + vec_entries(); }
    /// Shared entries a block takes.
    TITANS_HOST_DEVICE long long shared() const { return big_at() + chip * big(); }
    /// Scratch entries a block takes.
    TITANS_HOST_DEVICE long long scratch() const { return (6 - chip) * big(); }
    /// The most b x hidden arrays that fit `bytes` of shared memory with entries of `size`
    /// bytes (-1: not even the rest does).
    [[nodiscard]] static int fitting(const FusedLayout& l, std::size_t size, std::size_t bytes) {
        for (int c = 6; c >= 0; --c) {
            if (static_cast<std::size_t>(FusedBackLayout{l, c}.shared()) * size <= bytes) return c;
        }
        return -1;
    }
};

/// The start memory of a fused backward launch's chunks: at[4 j + i], i = 0..3 for W1, W2,
/// S1, S2 of chunk j (0 the top one), P pairs each (the training trace's).
template <class T>
struct FusedBackMemory {
    const T* at[4 * fused_keep_chunks];
};

/// What the fused backward reads and writes. Pair-major arrays (N rows a pair, from the
/// pair's row 0); chunk j of the launch (0 the top one) is chunk `top - j` of the pairs,
/// its start memory mem.at[4 j + i] (W1, W2, S1, S2; P pairs each). dw[0], ds[0]: the top
/// chunk's end adjoints (read only where end_top), dw[1], ds[1] its start's; the sets
/// alternate down the chunks.
template <class T>
struct FusedBackArgs {
    const T* q;
    const T* k;
    const T* v;
    const T* dy;
    const T* lg;  // [p][N][3] logits (null with constant gates)
    T* y;  // the read's output, recomputed (W_O's gradient reads it)
    T* dq;
    T* dk;
    T* dv;
    T* dlg;
    T* dw[2][2];  // [set][layer]
    T* ds[2][2];
    FusedBackMemory<T> mem;
    T* scratch;
    long long N, P;
    int top, chunks;
    bool end_top;
    FusedBackLayout fl;
    GateParams<T> gp;
    Activation act;
    bool residual;
};

#if TITANS_CUDA_DEVICE_CODE

/// Offsets of a pair's vector in the fused backward's shared memory (n = b rows each).
struct FusedBackVec {
    int b;
    TITANS_HOST_DEVICE int theta0() const { return 0; }
    TITANS_HOST_DEVICE int theta() const { return b; }
    TITANS_HOST_DEVICE int eta() const { return 2 * b; }
    TITANS_HOST_DEVICE int alpha() const { return 3 * b; }
    TITANS_HOST_DEVICE int g2() const { return 4 * b; }
    TITANS_HOST_DEVICE int g() const { return 5 * b; }
    TITANS_HOST_DEVICE int s() const { return 6 * b; }
    TITANS_HOST_DEVICE int dtheta() const { return 7 * b; }  // then deta, dalpha, dbeta, dc
    TITANS_HOST_DEVICE int deta() const { return 8 * b; }
    TITANS_HOST_DEVICE int dalpha() const { return 9 * b; }
    TITANS_HOST_DEVICE int dbeta() const { return 10 * b; }
    TITANS_HOST_DEVICE int dc() const { return 11 * b; }
    TITANS_HOST_DEVICE int dg() const { return 12 * b; }
    TITANS_HOST_DEVICE int ds() const { return 13 * b; }
    TITANS_HOST_DEVICE int scratch() const { return 14 * b; }  // 6 b
    TITANS_HOST_DEVICE int ends() const { return 20 * b; }     // be, ce, pe, dbe, dce, dpe
    TITANS_HOST_DEVICE int warps() const { return 22 * b + 8; }  // 3 x 16 warp partials
    TITANS_HOST_DEVICE int parts() const { return 22 * b + 8 + 64; }
    /// Entries cleared at each chunk's start (the adjoints, from dtheta to the ends).
    TITANS_HOST_DEVICE int cleared_from() const { return dtheta(); }
    TITANS_HOST_DEVICE int cleared_to() const { return 22 * b + 8; }
};

/// The block's arrays (FusedBackLayout): shared memory from base, the scratch from spill.
template <class T>
struct FusedBackShared {
    T *k, *d2, *q, *dy, *ab0, *db2;  // b x ldk; ab0 over q, db2 over dy
    T* v;                            // the pair's vector (FusedBackVec)
    T *r, *a, *dl, *bk, *z, *ab1;    // b x ldh; r: the read's, then Db1; bk: then Zb
    __device__ FusedBackShared(T* base, T* spill, const FusedBackLayout& f) {
        const long long sm = f.small(), bg = f.big();
        k = base;
        d2 = k + sm;
        q = ab0 = d2 + sm;
        dy = db2 = q + sm;
        v = base + f.vec();
        T** big[6] = {&r, &a, &dl, &bk, &z, &ab1};
        for (int i = 0; i < 6; ++i) {
            *big[i] = i < f.chip ? base + f.big_at() + i * bg : spill + (i - f.chip) * bg;
        }
    }
};

/// acc1 += a b1, acc2 += a b2 over K for every warp tile of an M x N product (two products
/// sharing their left operand), then ft(acc1, acc2, i, j0). No barrier.
template <class T, Operands P, int MT, int NT, class FA, class FB1, class FB2, class FT>
__device__ void twin_product(int M, int N, int K, const FA& a, const FB1& b1, const FB2& b2,
                             const FT& ft) {
    const int warp = static_cast<int>(threadIdx.x / 32), warps = static_cast<int>(blockDim.x / 32);
    const int lane = static_cast<int>(threadIdx.x % 32), g = lane / 4, q = lane % 4;
    const int tiles_n = N / (8 * NT), tiles = (M / (16 * MT)) * tiles_n;
    for (int tile = warp; tile < tiles; tile += warps) {
        const int i = tile / tiles_n * 16 * MT + g, j = tile % tiles_n * 8 * NT + g;
        T acc1[MT][NT][4], acc2[MT][NT][4];
        tile_zero(acc1);
        tile_zero(acc2);
        for (int k0 = 0; k0 < K; k0 += k_step<P>) {
            tile_step<T, P, MT, NT>(acc1, a, b1, i, j, k0, g, q);
            tile_step<T, P, MT, NT>(acc2, a, b2, i, j, k0, g, q);
        }
        ft(acc1, acc2, i, j - g + 2 * q);
    }
}

/// acc = a1 b1 (over K1) + a2 b2 (over K2) for every warp tile of an M x N product, then
/// ft(acc, i, j0). No barrier.
template <class T, Operands P, int MT, int NT, class FA1, class FB1, class FA2, class FB2,
          class FT>
__device__ void sum_product(int M, int N, int K1, const FA1& a1, const FB1& b1, int K2,
                            const FA2& a2, const FB2& b2, const FT& ft) {
    const int warp = static_cast<int>(threadIdx.x / 32), warps = static_cast<int>(blockDim.x / 32);
    const int lane = static_cast<int>(threadIdx.x % 32), g = lane / 4, q = lane % 4;
    const int tiles_n = N / (8 * NT), tiles = (M / (16 * MT)) * tiles_n;
    for (int tile = warp; tile < tiles; tile += warps) {
        const int i = tile / tiles_n * 16 * MT + g, j = tile % tiles_n * 8 * NT + g;
        T acc[MT][NT][4];
        tile_zero(acc);
        for (int k0 = 0; k0 < K1; k0 += k_step<P>) {
            tile_step<T, P, MT, NT>(acc, a1, b1, i, j, k0, g, q);
        }
        for (int k0 = 0; k0 < K2; k0 += k_step<P>) {
            tile_step<T, P, MT, NT>(acc, a2, b2, i, j, k0, g, q);
        }
        ft(acc, i, j - g + 2 * q);
    }
}

/// An entry-wise epilogue that adds each entry to a row-major matrix (device memory, a warp
/// tile's entries owned by its warp).
template <class T>
__device__ inline auto add_into(T* m, int ld) {
    return [m, ld](int i, int j, T z) { m[i * ld + j] += z; };
}

namespace fused_bwd {

/// A chunk's pointers in the block: its rows in the pair-major arrays and its memory.
template <class T>
struct Chunk {
    long long row;  // the chunk's first row, pair-major (p N + c b)
    const T *w1, *w2, *s1, *s2;
    const T *dw1n, *dw2n, *ds1n, *ds2n;  // the chunk end's adjoints
    T *dw1, *dw2, *ds1, *ds2;            // the chunk start's
    bool end;
};

/// The key pass from the chunk's start memory (math §2): Z, A, D2, Bk, Dl.
template <class T, Operands P>
__device__ void keys(const FusedBackArgs<T>& f, const FusedBackShared<T>& sh, const Chunk<T>& c) {
    const FusedLayout& l = f.fl.lay;
    const int b = l.b, dh = l.dh, h = l.h, ldk = l.ldk(), ldh = l.ldh();
    const Activation act = f.act;
    const bool res = f.residual;
    const T* w1 = c.w1;
    const T* w2 = c.w2;
    block_product<T, P, 2, 2>(b, h, dh, RowMajor<T>{sh.k, ldk}, RowMajor<T>{w1, h},
                              each_entry([&](int i, int j, T z) {
                                  sh.z[i * ldh + j] = z;
                                  sh.a[i * ldh + j] = kernel_activate(act, z);
                              }));
    __syncthreads();
    const T* v = f.v + c.row * dh;
    block_product<T, P, 1, 2>(b, dh, h, RowMajor<T>{sh.a, ldh}, RowMajor<T>{w2, dh},
                              each_entry([&](int i, int j, T z) {
                                  T e = z - v[i * dh + j];
                                  if (res) e += sh.k[i * ldk + j];
                                  sh.d2[i * ldk + j] = e;
                              }));
    __syncthreads();
    block_product<T, P, 2, 2>(b, h, dh, RowMajor<T>{sh.d2, ldk}, Transposed<T>{w2, dh},
                              each_entry([&](int i, int j, T z) {
                                  sh.bk[i * ldh + j] = z;
                                  sh.dl[i * ldh + j] =
                                      z * kernel_activate_grad(act, sh.z[i * ldh + j]);
                              }));
    __syncthreads();
}

/// The gates of the chunk's rows (backward_gate_row, a warp per row) and, with an end, its
/// coefficients (one thread).
template <class T>
__device__ void gates(const FusedBackArgs<T>& f, const FusedBackShared<T>& sh, const Chunk<T>& c) {
    const FusedLayout& l = f.fl.lay;
    const FusedBackVec vo{l.b};
    const int ldk = l.ldk(), ldh = l.ldh();
    const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
    const T* lg = f.lg != nullptr ? f.lg + c.row * 3 : nullptr;
    T* v = sh.v;
    for (int r = warp; r < l.b; r += static_cast<int>(blockDim.x / 32)) {
        const BackwardGates<T> g = backward_gate_row<T>(
            f.gp, 2, lg, r, l.b,
            [&](int layer) {
                return layer == 0
                           ? detail::GradRows<T>{sh.k + r * ldk, l.dh, sh.dl + r * ldh, l.h}
                           : detail::GradRows<T>{sh.a + r * ldh, l.h, sh.d2 + r * ldk, l.dh};
            },
            lane);
        if (lane == 0) {
            v[vo.theta0() + r] = g.theta0;
            v[vo.theta() + r] = g.theta;
            v[vo.eta() + r] = g.eta;
            v[vo.alpha() + r] = g.alpha;
            v[vo.g2() + r] = g.g2;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && c.end) {
        chunk_end_coefficients<T>(l.b, v + vo.theta(), v + vo.eta(), v + vo.alpha(), v + vo.g(),
                                  v + vo.s(), v + vo.ends(), v + vo.ends() + 1, v + vo.ends() + 2);
    }
    __syncthreads();
}

/// The chunk end's weight terms (math §9 step 3), a layer's io entries by the block: dW =
/// be dW', dS = ce dW' + pe dS' (both 0 without an end: the first writes of the chunk start's
/// adjoints), and with an end the sums <dW', W>, <dW', S>, <dS', S> into the vector's dbe,
/// dce, dpe (warp sums, then the warps' in order: deterministic).
template <class T>
__device__ void weights_layer(const FusedBackShared<T>& sh, const FusedBackVec& vo, long long io,
                              const T* dwn, const T* dsn, const T* W, const T* S, T* dw, T* ds,
                              bool end) {
    T* v = sh.v;
    const T be = v[vo.ends()], ce = v[vo.ends() + 1], pe = v[vo.ends() + 2];
    T a0 = T(0), a1 = T(0), a2 = T(0);
    for (long long e = threadIdx.x; e < io; e += blockDim.x) {
        if (!end) {
            dw[e] = T(0);
            ds[e] = T(0);
            continue;
        }
        const T gw = dwn[e], gs = dsn[e], s = S[e];
        a0 += gw * W[e];
        a1 += gw * s;
        a2 += gs * s;
        dw[e] = be * gw;
        ds[e] = ce * gw + pe * gs;
    }
    const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
    const int warps = static_cast<int>(blockDim.x / 32);
    a0 = warp_sum(a0);
    a1 = warp_sum(a1);
    a2 = warp_sum(a2);
    T* wp = v + vo.warps();
    if (lane == 0) {
        wp[warp] = a0;
        wp[16 + warp] = a1;
        wp[32 + warp] = a2;
    }
    __syncthreads();
    if (threadIdx.x < 3 && end) {
        T sum = T(0);
        for (int w = 0; w < warps; ++w) sum += wp[16 * threadIdx.x + w];
        v[vo.ends() + 3 + threadIdx.x] += sum;
    }
    __syncthreads();
}

/// The read recomputed (y) and reversed (lagged, math §9 step 2): dW1, dW2 added, dq.
template <class T, Operands P>
__device__ void read(const FusedBackArgs<T>& f, const FusedBackShared<T>& sh, const Chunk<T>& c) {
    const FusedLayout& l = f.fl.lay;
    const int b = l.b, dh = l.dh, h = l.h, ldk = l.ldk(), ldh = l.ldh();
    const Activation act = f.act;
    const bool res = f.residual;
    block_product<T, P, 2, 2>(b, h, dh, RowMajor<T>{sh.q, ldk}, RowMajor<T>{c.w1, h},
                              each_entry([&](int i, int j, T z) { sh.r[i * ldh + j] = z; }));
    __syncthreads();
    const T* r = sh.r;
    T* y = f.y + c.row * dh;
    const T* q = sh.q;
    block_product<T, P, 1, 2>(
        b, dh, h, [&](int i, int k) { return kernel_activate(act, r[i * ldh + k]); },
        RowMajor<T>{c.w2, dh}, each_entry([&](int i, int j, T z) {
            y[i * dh + j] = z + (res ? q[i * ldk + j] : T(0));
        }));
    block_product<T, P, 2, 2>(
        h, dh, b, [&](int i, int k) { return kernel_activate(act, r[k * ldh + i]); },
        RowMajor<T>{sh.dy, ldk}, each_entry(add_into(c.dw2, dh)));
    __syncthreads();
    block_product<T, P, 2, 2>(b, h, dh, RowMajor<T>{sh.dy, ldk}, Transposed<T>{c.w2, dh},
                              each_entry([&](int i, int j, T z) {
                                  T& e = sh.r[i * ldh + j];
                                  e = kernel_activate_grad(act, e) * z;
                              }));
    __syncthreads();
    block_product<T, P, 2, 2>(dh, h, b, Transposed<T>{sh.q, ldk}, RowMajor<T>{r, ldh},
                              each_entry(add_into(c.dw1, h)));
    T* dq = f.dq + c.row * dh;
    const T* dy = sh.dy;
    block_product<T, P, 1, 2>(b, dh, h, RowMajor<T>{r, ldh}, Transposed<T>{c.w1, h},
                              each_entry([&](int i, int j, T z) {
                                  dq[i * dh + j] += z + (res ? dy[i * ldk + j] : T(0));
                              }));
    __syncthreads();
}

/// A row-term epilogue of the chunk end (math §9 step 3) for a warp tile of AW = A dW', AS =
/// A dS' against the layer's delta E: db = -(g AW + s AS) entry by entry, and the rows'
/// partial sums of AW . E, AS . E (over the tile's columns, the 4 lanes of a row summed by
/// shuffles) into pw[row][tile column], ps[row][tile column] (b x cols each).
template <class T, int MT, int NT>
__device__ void end_rows_tile(const T (&aw)[MT][NT][4], const T (&as)[MT][NT][4], int i, int j0,
                              const T* E, int lde, T* db, int ldb, const T* g, const T* s,
                              T* pw, T* ps, int cols) {
    const int q = static_cast<int>(threadIdx.x % 32) % 4;
    const int tc = (j0 - 2 * q) / (8 * NT);
    TITANS_UNROLL
    for (int mi = 0; mi < MT; ++mi) {
        TITANS_UNROLL
        for (int hf = 0; hf < 2; ++hf) {
            const int r = i + 16 * mi + 8 * hf;
            T sw = T(0), ss = T(0);
            TITANS_UNROLL
            for (int ni = 0; ni < NT; ++ni) {
                TITANS_UNROLL
                for (int cc = 0; cc < 2; ++cc) {
                    const int col = j0 + 8 * ni + cc, e = 2 * hf + cc;
                    const T d = E[r * lde + col];
                    sw += aw[mi][ni][e] * d;
                    ss += as[mi][ni][e] * d;
                    db[r * ldb + col] = -(g[r] * aw[mi][ni][e]) - s[r] * as[mi][ni][e];
                }
            }
            sw += __shfl_xor_sync(0xffffffffu, sw, 1);
            sw += __shfl_xor_sync(0xffffffffu, sw, 2);
            ss += __shfl_xor_sync(0xffffffffu, ss, 1);
            ss += __shfl_xor_sync(0xffffffffu, ss, 2);
            if (q == 0) {
                pw[r * cols + tc] = sw;
                ps[r * cols + tc] = ss;
            }
        }
    }
}


/// The chunk end reversed (math §9 step 3): the tape's adjoints Db1 (in r), Ab0, Db2, Ab1
/// written (zero without an end), dg, ds of the rows into the vector.
template <class T, Operands P>
__device__ void end(const FusedBackArgs<T>& f, const FusedBackShared<T>& sh, const Chunk<T>& c) {
    const FusedLayout& l = f.fl.lay;
    const int b = l.b, dh = l.dh, h = l.h, ldk = l.ldk(), ldh = l.ldh();
    if (!c.end) {
        each_shared(b, h, ldh, [&](int e) { sh.r[e] = sh.ab1[e] = T(0); });
        each_shared(b, dh, ldk, [&](int e) { sh.ab0[e] = sh.db2[e] = T(0); });
        __syncthreads();
        return;
    }
    const FusedBackVec vo{b};
    T* v = sh.v;
    const T* g = v + vo.g();
    const T* s = v + vo.s();
    const int c1 = h / 16, c2 = dh / 16;  // tile columns of the two layers' row terms
    T* pw1 = v + vo.parts();
    T* ps1 = pw1 + b * c1;
    T* pw2 = ps1 + b * c1;
    T* ps2 = pw2 + b * c2;
    const T* dl = sh.dl;
    const T* d2 = sh.d2;
    twin_product<T, P, 2, 2>(b, h, dh, RowMajor<T>{sh.k, ldk}, RowMajor<T>{c.dw1n, h},
                             RowMajor<T>{c.ds1n, h}, [&](const auto& aw, const auto& as, int i, int j0) {
                                 end_rows_tile<T, 2, 2>(aw, as, i, j0, dl, ldh, sh.r, ldh, g, s,
                                                        pw1, ps1, c1);
                             });
    sum_product<T, P, 1, 2>(
        b, dh, h, [&](int i, int k) { return -g[i] * dl[i * ldh + k]; }, Transposed<T>{c.dw1n, h},
        h, [&](int i, int k) { return -s[i] * dl[i * ldh + k]; }, Transposed<T>{c.ds1n, h},
        each_entry([&](int i, int j, T z) { sh.ab0[i * ldk + j] = z; }));
    twin_product<T, P, 1, 2>(b, dh, h, RowMajor<T>{sh.a, ldh}, RowMajor<T>{c.dw2n, dh},
                             RowMajor<T>{c.ds2n, dh}, [&](const auto& aw, const auto& as, int i, int j0) {
                                 end_rows_tile<T, 1, 2>(aw, as, i, j0, d2, ldk, sh.db2, ldk, g, s,
                                                        pw2, ps2, c2);
                             });
    sum_product<T, P, 2, 2>(
        b, h, dh, [&](int i, int k) { return -g[i] * d2[i * ldk + k]; }, Transposed<T>{c.dw2n, dh},
        dh, [&](int i, int k) { return -s[i] * d2[i * ldk + k]; }, Transposed<T>{c.ds2n, dh},
        each_entry([&](int i, int j, T z) { sh.ab1[i * ldh + j] = z; }));
    __syncthreads();
    for (int r = static_cast<int>(threadIdx.x); r < b; r += static_cast<int>(blockDim.x)) {
        T sw = T(0), ss = T(0);
        for (int t = 0; t < c1; ++t) {
            sw += pw1[r * c1 + t];
            ss += ps1[r * c1 + t];
        }
        for (int t = 0; t < c2; ++t) {
            sw += pw2[r * c2 + t];
            ss += ps2[r * c2 + t];
        }
        v[vo.dg() + r] = -sw;
        v[vo.ds() + r] = -ss;
    }
    __syncthreads();
}

/// The coefficients' recurrences reversed (one thread; math §9 step 4), then the clipping
/// (a warp per row whose g2 passed clip^2; step 5) into the tape's adjoints.
template <class T>
__device__ void gate_adjoints(const FusedBackArgs<T>& f, const FusedBackShared<T>& sh,
                              const Chunk<T>& c) {
    const FusedLayout& l = f.fl.lay;
    const FusedBackVec vo{l.b};
    const int n = l.b, ldk = l.ldk(), ldh = l.ldh();
    T* v = sh.v;
    if (threadIdx.x == 0) {
        if (c.end) {
            v[vo.dbeta() + n - 1] += v[vo.ends() + 3];
            v[vo.dc() + n - 1] += v[vo.ends() + 4];
        }
        chunk_coefficients_backward<T>(n, v + vo.theta(), v + vo.eta(), v + vo.alpha(),
                                       v + vo.dbeta(), v + vo.dc(), nullptr,
                                       c.end ? v + vo.dg() : nullptr, c.end ? v + vo.ds() : nullptr,
                                       c.end ? v[vo.ends() + 5] : T(0), v + vo.dtheta(),
                                       v + vo.deta(), v + vo.dalpha(), v + vo.scratch());
    }
    __syncthreads();
    const T clip = f.gp.clip;
    if (!(clip > T(0))) {
        return;
    }
    const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
    for (int r = warp; r < n; r += static_cast<int>(blockDim.x / 32)) {
        const T g2 = v[vo.g2() + r];
        if (!(g2 > clip * clip)) {
            continue;
        }
        const T fc = clip_row_backward<T>(
            clip, 2, [&](int layer) {
                return layer == 0
                           ? detail::GradRows<T>{sh.k + r * ldk, l.dh, sh.dl + r * ldh, l.h}
                           : detail::GradRows<T>{sh.a + r * ldh, l.h, sh.d2 + r * ldk, l.dh};
            },
            [&](int layer) {
                return layer == 0 ? AdjointRows<T>{sh.ab0 + r * ldk, sh.r + r * ldh}
                                  : AdjointRows<T>{sh.ab1 + r * ldh, sh.db2 + r * ldk};
            },
            v[vo.dtheta() + r], v[vo.theta0() + r], g2, lane);
        __syncwarp();  // every lane has read dtheta
        if (lane == 0) {
            v[vo.dtheta() + r] *= fc;
        }
    }
    __syncthreads();
}

/// The key pass reversed with its second-order terms (math §9 step 6, KeyTape::backward at
/// depth 2): dW1, dW2 added; dk, dv of the chunk's rows.
template <class T, Operands P>
__device__ void tape(const FusedBackArgs<T>& f, const FusedBackShared<T>& sh, const Chunk<T>& c) {
    const FusedLayout& l = f.fl.lay;
    const int b = l.b, dh = l.dh, h = l.h, ldk = l.ldk(), ldh = l.ldh();
    const Activation act = f.act;
    each_shared(b, h, ldh, [&](int e) {  // bb (in r) and Zb (in bk)
        const T db = sh.r[e], z = sh.z[e];
        sh.bk[e] = db * sh.bk[e] * kernel_activate_grad2(act, z);
        sh.r[e] = db * kernel_activate_grad(act, z);
    });
    __syncthreads();
    block_product<T, P, 1, 2>(b, dh, h, RowMajor<T>{sh.r, ldh}, RowMajor<T>{c.w2, dh},
                              each_entry([&](int i, int j, T z) { sh.db2[i * ldk + j] += z; }));
    __syncthreads();
    sum_product<T, P, 2, 2>(h, dh, b, Transposed<T>{sh.r, ldh}, RowMajor<T>{sh.d2, ldk}, b,
                            Transposed<T>{sh.a, ldh}, RowMajor<T>{sh.db2, ldk},
                            each_entry(add_into(c.dw2, dh)));
    block_product<T, P, 2, 2>(b, h, dh, RowMajor<T>{sh.db2, ldk}, Transposed<T>{c.w2, dh},
                              each_entry([&](int i, int j, T z) { sh.ab1[i * ldh + j] += z; }));
    __syncthreads();
    each_shared(b, h, ldh, [&](int e) {
        sh.bk[e] += sh.ab1[e] * kernel_activate_grad(act, sh.z[e]);
    });
    __syncthreads();
    block_product<T, P, 2, 2>(dh, h, b, Transposed<T>{sh.k, ldk}, RowMajor<T>{sh.bk, ldh},
                              each_entry(add_into(c.dw1, h)));
    block_product<T, P, 1, 2>(b, dh, h, RowMajor<T>{sh.bk, ldh}, Transposed<T>{c.w1, h},
                              each_entry([&](int i, int j, T z) { sh.ab0[i * ldk + j] += z; }));
    __syncthreads();
    T* dk = f.dk + c.row * dh;
    T* dv = f.dv + c.row * dh;
    const bool res = f.residual;
    each_shared(b, dh, ldk, [&](int e) {
        const int i = e / ldk, j = e % ldk;
        const T db = sh.db2[e];
        dv[i * dh + j] -= db;
        dk[i * dh + j] += sh.ab0[e] + (res ? db : T(0));
    });
}

/// The gates' adjoints (dtheta of theta0, deta, dalpha) into the logits, a thread per (row,
/// gate), as the sweep's gates_backward.
template <class T>
__device__ void logits(const FusedBackArgs<T>& f, const FusedBackShared<T>& sh, const Chunk<T>& c) {
    if (f.lg == nullptr) {
        return;
    }
    const int n = f.fl.lay.b;
    const FusedBackVec vo{n};
    const T* lg = f.lg + c.row * 3;
    T* dl = f.dlg + c.row * 3;
    const GateParams<T>& gp = f.gp;
    for (int i = static_cast<int>(threadIdx.x); i < 3 * n; i += static_cast<int>(blockDim.x)) {
        const int r = i / 3, which = i % 3;
        const T* adj = sh.v + (which == 0 ? vo.dtheta() : which == 1 ? vo.deta() : vo.dalpha());
        const T scale = which == 0 ? gp.tmax : which == 1 ? gp.se : gp.sa;
        dl[r * 3 + which] += gate_logit_adjoint<T>(gp.mode, scale, lg, adj, n, r, which);
    }
}

/// One chunk of one pair reversed.
template <class T, Operands P>
__device__ void chunk(const FusedBackArgs<T>& f, const FusedBackShared<T>& sh, const Chunk<T>& c) {
    const FusedLayout& l = f.fl.lay;
    const FusedBackVec vo{l.b};
    const long long io = static_cast<long long>(l.dh) * l.h;
    __syncthreads();  // the previous chunk's last reads
    copy_tile(sh.k, l.ldk(), f.k + c.row * l.dh, l.dh, l.b, l.dh);
    copy_tile(sh.q, l.ldk(), f.q + c.row * l.dh, l.dh, l.b, l.dh);
    copy_tile(sh.dy, l.ldk(), f.dy + c.row * l.dh, l.dh, l.b, l.dh);
    for (int i = vo.cleared_from() + static_cast<int>(threadIdx.x); i < vo.cleared_to();
         i += static_cast<int>(blockDim.x)) {
        sh.v[i] = T(0);
    }
    __syncthreads();
    keys<T, P>(f, sh, c);
    gates<T>(f, sh, c);
    weights_layer<T>(sh, vo, io, c.dw1n, c.ds1n, c.w1, c.s1, c.dw1, c.ds1, c.end);
    weights_layer<T>(sh, vo, io, c.dw2n, c.ds2n, c.w2, c.s2, c.dw2, c.ds2, c.end);
    read<T, P>(f, sh, c);
    end<T, P>(f, sh, c);
    gate_adjoints<T>(f, sh, c);
    tape<T, P>(f, sh, c);
    logits<T>(f, sh, c);
}

}  // namespace fused_bwd

/// The memory's backward over a run of full chunks of every pair (FusedBackArgs), last chunk
/// first: a block per pair in turn (blocks stride over the pairs: a persistent grid where
/// some b x hidden arrays spill to the scratch, each block's own).
template <class T, Operands P>
__global__ void __launch_bounds__(fused_threads)
    fused_backward_kernel(const TITANS_GRID_CONSTANT FusedBackArgs<T> f) {
    const FusedLayout& l = f.fl.lay;
    T* base = dynamic_shared<T>();
    T* spill = f.scratch != nullptr
                   ? f.scratch + static_cast<long long>(blockIdx.x) * f.fl.scratch()
                   : nullptr;
    const FusedBackShared<T> sh(base, spill, f.fl);
    const long long io = static_cast<long long>(l.dh) * l.h;
    for (long long p = blockIdx.x; p < f.P; p += gridDim.x) {
        for (int j = 0; j < f.chunks; ++j) {
            fused_bwd::Chunk<T> c;
            c.row = p * f.N + static_cast<long long>(f.top - j) * l.b;
            c.w1 = f.mem.at[4 * j] + p * io;
            c.w2 = f.mem.at[4 * j + 1] + p * io;
            c.s1 = f.mem.at[4 * j + 2] + p * io;
            c.s2 = f.mem.at[4 * j + 3] + p * io;
            const int in = j % 2, out = 1 - in;
            c.dw1n = f.dw[in][0] + p * io;
            c.dw2n = f.dw[in][1] + p * io;
            c.ds1n = f.ds[in][0] + p * io;
            c.ds2n = f.ds[in][1] + p * io;
            c.dw1 = f.dw[out][0] + p * io;
            c.dw2 = f.dw[out][1] + p * io;
            c.ds1 = f.ds[out][0] + p * io;
            c.ds2 = f.ds[out][1] + p * io;
            c.end = j > 0 || f.end_top;
            fused_bwd::chunk<T, P>(f, sh, c);
        }
    }
}

#endif

}  // namespace titans::backend::cuda
