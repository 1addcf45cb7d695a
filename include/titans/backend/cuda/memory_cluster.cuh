#pragma once
// titans/backend/cuda/memory_cluster.cuh: the fused chunk kernel (memory_fused.cuh) as a
// thread-block cluster per (sequence, head) pair, W and S resident in shared memory across the
// pair's chunks (math §2-5 and §10; the forward of a depth-2 memory with lagged retrieval).
//
// The pair's hidden width h is split over the cluster's R ranks (2, 4 or 8 blocks): rank r
// holds columns J_r = [r h/R, (r+1) h/R) of W1 and S1 and those rows of W2 and S2, loaded once
// at the piece's start and stored once at its end, where fused_chunks_kernel streams all of W
// and S through device memory every chunk. Per chunk, every rank:
//   read    X_r = act(Q W1[:, J_r]),  part_y_r = X_r W2[J_r, :]
//           (cluster barrier) y = sum_r part_y_r (+ Q), each rank b/R of the rows
//   keys    A1_r = act(K W1[:, J_r]),  part_d_r = A1_r W2[J_r, :]
//           (cluster barrier) D2 = sum_r part_d_r (+ K) - V, every rank all of it
//           X_r = (D2 W2[J_r, :]^T) . act'(K W1[:, J_r])
//   gates   each rank's share of the rows' squared norms of X and A1; (cluster barrier) their
//           sums in rank order, so every rank clips theta alike (math §10)
//   end     W1[:, J_r], S1[:, J_r] from K and X_r; W2[J_r, :], S2[J_r, :] from A1_r and D2
// The partial sums are read from the other ranks' shared memory (cluster_shared), always in
// rank order: the result does not depend on which block finishes first. Three cluster
// barriers a chunk; the buffers each writes are read before the next chunk's writer passes
// the barrier after.
//
// Opt-in (set_fused_cluster, TITANS_FUSED_CLUSTER=1) until it is timed on a GPU; checked
// against the CPU under the emulator (tests/cuda/test_cuda_memory.cu, "fused cluster").

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "memory_fused.cuh"
#include "runtime.cuh"

namespace titans::backend::cuda {

/// How the fused chunk kernel is split into clusters: 0 never (fused_chunks_kernel, the
/// default), -1 the fewest ranks (2, 4, 8) whose shared memory fits the device, 2, 4 or 8
/// exactly that many (where the shape allows it; else no cluster). The default is -1 where
/// the environment sets TITANS_FUSED_CLUSTER=1. Process-wide, read at every forward call.
inline std::atomic<int>& fused_cluster_flag() {
    static std::atomic<int> flag{env_switch("TITANS_FUSED_CLUSTER") ? -1 : 0};
    return flag;
}
inline void set_fused_cluster(int ranks) { fused_cluster_flag().store(ranks); }
[[nodiscard]] inline int fused_cluster() { return fused_cluster_flag().load(); }

/// Launches of the cluster kernel in this process (tests and benchmarks read it).
inline std::atomic<long long>& fused_cluster_launches() {
    static std::atomic<long long> count{0};
    return count;
}

/// A cluster rank's shared memory, in entries of T: FusedLayout{b, d_h, h / R} (the chunk's K
/// and Q, then D2, the rank's columns of A1 and X, the gate coefficients), then its W1 and S1
/// columns (d_h x h/R, rows padded by 8), its W2 and S2 rows (h/R x d_h, padded by 8), the
/// partial sums of the read and of D2 (b x d_h each, K's padding) and the rows' norm parts (b
/// x 6). Each region starts at a multiple of 4 entries (pair accesses stay aligned).
struct ClusterLayout {
    FusedLayout lay;  // lay.h: the rank's share of the hidden width
    int ranks;
    static TITANS_HOST_DEVICE long long up4(long long n) { return (n + 3) / 4 * 4; }
    TITANS_HOST_DEVICE int ldw1() const { return lay.h + 8; }
    TITANS_HOST_DEVICE int ldw2() const { return lay.dh + 8; }
    TITANS_HOST_DEVICE long long w1() const { return up4(lay.entries()); }
    TITANS_HOST_DEVICE long long s1() const { return w1() + static_cast<long long>(lay.dh) * ldw1(); }
    TITANS_HOST_DEVICE long long w2() const { return s1() + static_cast<long long>(lay.dh) * ldw1(); }
    TITANS_HOST_DEVICE long long s2() const { return w2() + static_cast<long long>(lay.h) * ldw2(); }
    TITANS_HOST_DEVICE long long part_y() const { return s2() + static_cast<long long>(lay.h) * ldw2(); }
    TITANS_HOST_DEVICE long long part_d() const { return part_y() + static_cast<long long>(lay.b) * lay.ldk(); }
    TITANS_HOST_DEVICE long long norms() const { return part_d() + static_cast<long long>(lay.b) * lay.ldk(); }
    TITANS_HOST_DEVICE long long entries() const { return norms() + 6LL * lay.b; }
    /// The layout of hidden width h over `ranks` ranks.
    static ClusterLayout of(int b, int dh, int h, int ranks) { return {{b, dh, h / ranks}, ranks}; }
    /// Whether the kernel covers the shape: h splits evenly into shares the warp tiles cover
    /// (multiples of 32, as b and d_h), b rows split evenly over the ranks.
    [[nodiscard]] static bool covers(int b, int dh, int h, int ranks) {
        return ranks >= 2 && ranks <= 8 && h % ranks == 0 && b % ranks == 0 &&
               FusedLayout{b, dh, h / ranks}.tiles();
    }
};

#if TITANS_CUDA_DEVICE_CODE

/// A cluster rank's own arrays beside FusedShared's (ClusterLayout).
template <class T>
struct ClusterShared {
    T* w1;
    T* s1;
    T* w2;
    T* s2;
    T* part_y;
    T* part_d;
    T* norms;
    __device__ ClusterShared(T* base, const ClusterLayout& c)
        : w1(base + c.w1()), s1(base + c.s1()), w2(base + c.w2()), s2(base + c.s2()),
          part_y(base + c.part_y()), part_d(base + c.part_d()), norms(base + c.norms()) {}
};

/// A pair epilogue into a rank's partial sums (rows of ld entries).
template <class T>
struct PartStore {
    T* part;
    int ld;
    __device__ void operator()(int i, int j, T z0, T z1) const {
        store_pair(part + i * ld + j, z0, z1);
    }
};

/// sum over the cluster's ranks, in rank order, of the entry at `local`'s place in each rank's
/// shared memory.
template <class T>
__device__ T cluster_sum(T* local, int ranks) {
    T z = *cluster_shared(local, 0u);
    for (int r = 1; r < ranks; ++r) {
        z += *cluster_shared(local, static_cast<unsigned>(r));
    }
    return z;
}

/// sum_c x_c^2 and sum_c y_c^2 over c < n by a warp (every lane returns both, as x and y).
template <class T>
__device__ EntryPair<T> warp_squares(const T* x, const T* y, int n, int lane) {
    T sx = T(0), sy = T(0);
    for (int c = lane; c < n; c += 32) {
        sx += x[c] * x[c];
        sy += y[c] * y[c];
    }
    return {warp_sum(sx), warp_sum(sy)};
}

/// A row's norm as mantissa m in [1, 2) (0 for a zero row) and exponent, from the ranks'
/// shares (m_r, e_r) at parts[0], parts[1] of each rank: sqrt(sum_r (m_r 2^e_r)^2) without
/// overflow (each term scaled by the largest exponent).
template <class T>
__device__ T cluster_norm_mantissa(T* parts, int ranks, int& e) {
    int emax = 0;
    bool any = false;
    for (int r = 0; r < ranks; ++r) {
        const T* p = cluster_shared(parts, static_cast<unsigned>(r));
        if (p[0] > T(0)) {
            const int er = static_cast<int>(p[1]);
            emax = any && emax > er ? emax : er;
            any = true;
        }
    }
    e = 0;
    if (!any) return T(0);
    T ss = T(0);
    for (int r = 0; r < ranks; ++r) {
        const T* p = cluster_shared(parts, static_cast<unsigned>(r));
        if (p[0] > T(0)) {
            const T z = std::ldexp(p[0], static_cast<int>(p[1]) - emax);
            ss += z * z;
        }
    }
    const T n = std::sqrt(ss);
    const int f = detail::scale_exponent(n);
    e = emax + f;
    return std::ldexp(n, -f);
}

/// The rank's share of row r's norm of x (w entries, its plain sum of squares ss), as
/// mantissa and exponent into out[0], out[1] (row_norm_mantissa's form; the plain sum where it
/// is finite).
template <class T>
__device__ void share_norm_parts(const T* x, int w, T ss, T* out) {
    int e = 0;
    T m;
    if (ss <= detail::largest_finite<T>()) {
        const T n = std::sqrt(ss);
        const int f = detail::scale_exponent(n);
        m = std::ldexp(n, -f);
        e = f;
    } else {
        m = detail::row_norm_mantissa(x, w, e);
    }
    out[0] = m;
    out[1] = static_cast<T>(e);
}

/// theta, eta, alpha of the chunk's rows (a warp per row) with math §10's clip over the whole
/// gradient, |k|^2 |x|^2 + |a1|^2 |d2|^2, where x and a1 are split over the ranks: each rank's
/// shares of the rows' norms (plain sums, and mantissa form for rows whose sums overflow) go
/// to its norms array, and after a cluster barrier every rank sums them in rank order. Then
/// the chunk-end coefficients (fused_gates' second half).
template <class T>
__device__ void cluster_gates(const FusedArgs<T>& f, const FusedShared<T>& sh, T* norms,
                              int ranks, const T* gates) {
    const FusedLayout& l = f.lay;
    const int warp = static_cast<int>(threadIdx.x / 32), warps = static_cast<int>(blockDim.x / 32);
    const int lane = static_cast<int>(threadIdx.x % 32), ldk = l.ldk(), ldh = l.ldh();
    const bool clip = f.gp.clip > T(0);
    for (int r = warp; clip && r < l.b; r += warps) {
        const T* x = sh.x + r * ldh;
        const T* a = sh.a1 + r * ldh;
        const EntryPair<T> ss = warp_squares(x, a, l.h, lane);
        if (lane == 0) {
            T* out = norms + 6 * r;
            out[0] = ss.x;
            out[1] = ss.y;
            share_norm_parts(x, l.h, ss.x, out + 2);
            share_norm_parts(a, l.h, ss.y, out + 4);
        }
    }
    cluster_sync();
    for (int r = warp; r < l.b; r += warps) {
        GateValues<T> v = gate_logits_row<T>(f.gp, gates, r, l.b, lane);
        if (clip) {
            const T* k = sh.k + r * ldk;
            const T* d = sh.q + r * ldk;
            const EntryPair<T> kd = warp_squares(k, d, l.dh, lane);
            const T g2 = kd.x * cluster_sum(norms + 6 * r, ranks) +
                         cluster_sum(norms + 6 * r + 1, ranks) * kd.y;
            if (g2 > f.gp.clip * f.gp.clip) {  // the plain sum where finite, else the scaled norm
                T factor;
                if (g2 <= detail::largest_finite<T>()) {
                    factor = f.gp.clip / sqrt(g2);
                } else {
                    factor = detail::scaled_grad_norm_of<T>(2, [&](int layer) {
                                 detail::NormPair<T> n;
                                 if (layer == 0) {
                                     n.ma = detail::row_norm_mantissa(k, l.dh, n.ea);
                                     n.md = cluster_norm_mantissa(norms + 6 * r + 2, ranks, n.ed);
                                 } else {
                                     n.ma = cluster_norm_mantissa(norms + 6 * r + 4, ranks, n.ea);
                                     n.md = detail::row_norm_mantissa(d, l.dh, n.ed);
                                 }
                                 return n;
                             }).clip_factor(f.gp.clip);
                }
                v.theta *= factor;
            }
        }
        store_gates(sh, r, v, lane);
    }
    fused_coefficients(sh, l.b);
}

/// The read's partial sums of the ranks, added in rank order (+ Q): rows [r b/R, (r+1) b/R)
/// of y (its rows f.ld_y apart) by rank r. Returns the first row this thread stored a
/// non-finite entry of (b: none).
template <class T>
__device__ int cluster_read_rows(const FusedArgs<T>& f, const FusedShared<T>& sh,
                                 T* part_y, int rank, int ranks, T* y) {
    const FusedLayout& l = f.lay;
    const int rows = l.b / ranks, ldk = l.ldk();
    const int warp = static_cast<int>(threadIdx.x / 32), warps = static_cast<int>(blockDim.x / 32);
    int bad_row = l.b;
    for (int i = rank * rows + warp; i < (rank + 1) * rows; i += warps) {
        for (int j = static_cast<int>(threadIdx.x % 32); j < l.dh; j += 32) {
            const T z = cluster_sum(part_y + i * ldk + j, ranks);
            const T yz = f.residual ? z + sh.q[i * ldk + j] : z;
            y[i * f.ld_y + j] = yz;
            bad_row = not_finite(yz) && i < bad_row ? i : bad_row;
        }
    }
    return bad_row;
}

/// D2 = sum_r part_d_r (+ K) - V into sh.q, all rows, by every rank.
template <class T>
__device__ void cluster_delta(const FusedArgs<T>& f, const FusedShared<T>& sh, T* part_d,
                              int ranks, const T* v) {
    const FusedLayout& l = f.lay;
    const int ldk = l.ldk();
    const int warp = static_cast<int>(threadIdx.x / 32), warps = static_cast<int>(blockDim.x / 32);
    for (int i = warp; i < l.b; i += warps) {
        for (int j = static_cast<int>(threadIdx.x % 32); j < l.dh; j += 32) {
            const T z = cluster_sum(part_d + i * ldk + j, ranks);
            const T kt = f.residual ? sh.k[i * ldk + j] : T(0);
            sh.q[i * ldk + j] = (z + kt) - v[i * l.dh + j];
        }
    }
    __syncthreads();
}

/// The rank's W and S (ClusterShared) from or to device memory: W1, S1 columns J_r (ld h), W2,
/// S2 rows J_r (ld d_h). `load`: device to shared, else back.
template <class T>
__device__ void cluster_weights(const FusedArgs<T>& f, const ClusterLayout& cl,
                                const ClusterShared<T>& cs, long long p, int rank, bool load) {
    const FusedLayout& l = f.lay;
    const long long h = static_cast<long long>(l.h) * cl.ranks, io = l.dh * h;
    T* w1 = f.w[0] + p * io + static_cast<long long>(rank) * l.h;
    T* s1 = f.s[0] + p * io + static_cast<long long>(rank) * l.h;
    T* w2 = f.w[1] + p * io + static_cast<long long>(rank) * l.h * l.dh;
    T* s2 = f.s[1] + p * io + static_cast<long long>(rank) * l.h * l.dh;
    if (load) {
        copy_tile(cs.w1, cl.ldw1(), w1, h, l.dh, l.h);
        copy_tile(cs.s1, cl.ldw1(), s1, h, l.dh, l.h);
        copy_tile(cs.w2, cl.ldw2(), w2, l.dh, l.h, l.dh);
        copy_tile(cs.s2, cl.ldw2(), s2, l.dh, l.h, l.dh);
    } else {
        copy_tile(w1, static_cast<int>(h), cs.w1, cl.ldw1(), l.dh, l.h);
        copy_tile(s1, static_cast<int>(h), cs.s1, cl.ldw1(), l.dh, l.h);
        copy_tile(w2, l.dh, cs.w2, cl.ldw2(), l.h, l.dh);
        copy_tile(s2, l.dh, cs.s2, cl.ldw2(), l.h, l.dh);
    }
}

/// The last chunk's rows into the state's pending arrays: K and D2 by rank 0, the rank's
/// columns of A1 and X by each.
template <class T>
__device__ void cluster_pending(const FusedArgs<T>& f, const FusedShared<T>& sh, long long p,
                                int rank, int ranks) {
    const FusedLayout& l = f.lay;
    const long long pb = p * l.b, h = static_cast<long long>(l.h) * ranks;
    const long long col = static_cast<long long>(rank) * l.h;
    if (rank == 0) {
        copy_tile(f.a[0] + pb * l.dh, l.dh, sh.k, l.ldk(), l.b, l.dh);
        copy_tile(f.d[1] + pb * l.dh, l.dh, sh.q, l.ldk(), l.b, l.dh);
    }
    copy_tile(f.a[1] + pb * h + col, static_cast<int>(h), sh.a1, l.ldh(), l.b, l.h);
    copy_tile(f.d[0] + pb * h + col, static_cast<int>(h), sh.x, l.ldh(), l.b, l.h);
}

/// The full chunks of one pair by a cluster of `ranks` blocks (blockIdx.x / ranks the pair):
/// f.lay.h is a rank's share of the hidden width; each chunk's start memory, the rank's share
/// of it, into f.keep where that is given.
template <class T, Operands P>
__global__ void __launch_bounds__(fused_threads)
    fused_cluster_kernel(const TITANS_GRID_CONSTANT FusedArgs<T> f, int ranks) {
    const int rank = static_cast<int>(cluster_rank());
    const long long p = blockIdx.x / static_cast<unsigned>(ranks);
    const FusedLayout& l = f.lay;
    const ClusterLayout cl{l, ranks};
    T* base = dynamic_shared<T>();
    const FusedShared<T> sh(base, l);
    const ClusterShared<T> cs(base, cl);
    cluster_weights(f, cl, cs, p, rank, true);
    const FusedWeights<T> wt{cs.w1, cl.ldw1(), cs.w2, cl.ldw2()};
    const long long h = static_cast<long long>(l.h) * ranks, io = l.dh * h;
    const long long col = static_cast<long long>(rank) * l.h;  // the rank's first hidden unit
    for (int c = 0; c < f.chunks; ++c) {
        const long long row = p * f.N + static_cast<long long>(c) * l.b;  // first row, pair-major
        copy_tile(sh.q, l.ldk(), f.q + row * l.dh, l.dh, l.b, l.dh);
        copy_tile(sh.k, l.ldk(), f.k + row * l.dh, l.dh, l.b, l.dh);
        __syncthreads();
        const int ldk = l.ldk();
        fused_read<T, P, 1>(f, sh, wt, each_pair(PartStore<T>{cs.part_y, ldk}));
        cluster_sync();
        const int bad_row =
            cluster_read_rows(f, sh, cs.part_y, rank, ranks, fused_y_rows(f, p, c));
        fused_hidden<T, P, 1>(f, sh, wt);
        block_product<T, P, 1, 2, KOrder::Pair>(l.b, l.dh, l.h, RowMajor<T>{sh.a1, l.ldh()},
                                                [&](int k, int j) { return wt.at2(k, j); },
                                                each_pair(PartStore<T>{cs.part_d, ldk}));
        cluster_sync();
        cluster_delta(f, sh, cs.part_d, ranks, f.v + row * l.dh);
        fused_back<T, P, 1>(f, sh, wt);
        cluster_gates<T>(f, sh, cs.norms, ranks, f.gates != nullptr ? f.gates + row * 3 : nullptr);
        const bool check = fused_checks_state(f, c);
        const bool bad1 = fused_end_layer<T, P>(
            sh, l.b, l.dh, l.h, sh.k, ldk, sh.x, l.ldh(), cs.w1, cs.s1, cl.ldw1(), check,
            f.keep.layer(c, 0, p * io + col, static_cast<int>(h)));
        const bool bad2 = fused_end_layer<T, P>(sh, l.b, l.h, l.dh, sh.a1, l.ldh(), sh.q, ldk,
                                                cs.w2, cs.s2, cl.ldw2(), check,
                                                f.keep.layer(c, 1, p * io + col * l.dh, l.dh));
        fused_flags(f, p, c, bad_row, bad1 || bad2);
        if (c + 1 == f.chunks) {
            cluster_pending(f, sh, p, rank, ranks);
        }
        __syncthreads();
    }
    cluster_weights(f, cl, cs, p, rank, false);
    cluster_sync();  // no rank leaves while another may still read its shared memory
}

#endif

}  // namespace titans::backend::cuda
