#pragma once
// titans/backend/cuda/memory_device.cuh: the CUDA backend's own kernels where the element-wise
// launcher (launch.cuh) would waste the GPU: row-wise work (a block per token row, a warp per
// head row) whose index arithmetic and reductions are per row, not per entry.

#include <atomic>
#include <cmath>

#include "../../config.hpp"
#include "../../detail/activation.hpp"
#include "../../detail/norm_scale.hpp"
#include "../../limits.hpp"
#include "../../memory/config.hpp"
#include "launch.cuh"
#include "tile_product.cuh"

namespace titans::backend::cuda {

/// Per-layer pointers of the pending rows a kernel reads (captured by value).
template <class T>
struct PendingLayers {
    const T* a[limits::max_depth];
    const T* d[limits::max_depth];
    int in[limits::max_depth];
    int out[limits::max_depth];
    int depth;
};

/// Where a kernel reports a non-finite entry among those it writes (the producer doing
/// flag_rows_kernel's check as it stores): flags[slot] = min(flags[slot], key), keys capped
/// below cap, or *raise = 1 where raise is given (a deferred check: flags untouched). Both
/// null: no check (flag_report does nothing).
struct FlagSink {
    int* flags = nullptr;
    unsigned* raise = nullptr;
    int cap = 0;
    [[nodiscard]] TITANS_HOST_DEVICE bool on() const {
        return flags != nullptr || raise != nullptr;
    }
};

/// Entries queued for the memory forward's check kernel (flag_rows_kernel) in this process:
/// what the checks read after the fact, beside what the producers check as they write (tests
/// and benchmarks read it).
inline std::atomic<long long>& flag_check_entries() {
    static std::atomic<long long> n{0};
    return n;
}

#if TITANS_CUDA_DEVICE_CODE

/// Reports key into slot of sink (FlagSink), if the sink checks at all.
__device__ inline void flag_report(const FlagSink& sink, int slot, long long key) {
    if (sink.raise != nullptr) {
        atomicMax(sink.raise, 1u);
    } else if (sink.flags != nullptr) {
        atomicMin(sink.flags + slot, static_cast<int>(key < sink.cap ? key : sink.cap - 1));
    }
}

/// Warp sum (every lane gets it).
template <class T>
__device__ T warp_sum(T x) {
    for (int o = 16; o > 0; o >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, o);
    }
    return x;
}

/// Warp maximum (every lane gets it).
template <class T>
__device__ T warp_max(T x) {
    for (int o = 16; o > 0; o >>= 1) {
        const T y = __shfl_xor_sync(0xffffffffu, x, o);
        x = y > x ? y : x;
    }
    return x;
}

/// One set of rows a non-finite check covers: rows r < `rows` of P matrices (`cols` wide, row
/// stride ld, pair stride ps) from x, row r of matrix p keyed (p / div) a + r b into
/// flags[slot].
template <class T>
struct FlagRows {
    const T* x;
    long long P, rows;
    int cols;
    long long ld, ps;
    int slot;
    long long div, a, b;

    /// Whether the rows lie end to end (ld = cols, ps = rows ld where P > 1): then the check
    /// walks the entries flat (flag_flat_entries a warp) instead of a warp a row.
    [[nodiscard]] TITANS_HOST_DEVICE bool flat() const {
        return ld == cols && (P == 1 || ps == rows * ld);
    }
};

/// Entries a warp checks in a flat set (FlagRows::flat): 16 loads in flight a lane.
inline constexpr int flag_flat_loads = 16;
inline constexpr long long flag_flat_entries = 32LL * flag_flat_loads;

/// The warps flag_rows_kernel gives set f: one per flag_flat_entries entries of a flat set,
/// else one per row.
template <class T>
long long flag_warps(const FlagRows<T>& f) {
    const long long rows = f.P * f.rows;
    return f.flat() ? (rows * f.cols + flag_flat_entries - 1) / flag_flat_entries : rows;
}

/// How many row sets one flag_rows_kernel launch takes (its parameters stay under 1.5 KB).
inline constexpr int flag_sets_max = 12;

/// The row sets of one flag_rows_kernel launch: set i's warps are [first[i], first[i + 1])
/// (flag_warps).
template <class T>
struct FlagSets {
    FlagRows<T> set[flag_sets_max];
    long long first[flag_sets_max + 1];
    int count;
};

/// The smallest of the lanes' keys (every lane gets it).
__device__ inline long long warp_min_key(long long x) {
    for (int o = 16; o > 0; o >>= 1) {
        const long long y = __shfl_xor_sync(0xffffffffu, x, o);
        x = y < x ? y : x;
    }
    return x;
}

/// The key of set f's row k (k = p rows + r), capped below cap.
template <class T>
__device__ int flag_key(const FlagRows<T>& f, long long k, int cap) {
    const long long p = k / f.rows, r = k % f.rows;
    const long long key = (p / f.div) * f.a + r * f.b;
    return static_cast<int>(key < cap ? key : cap - 1);
}

/// Warp w of flat set f: entries [w E, (w + 1) E) (E = flag_flat_entries), all loads in
/// flight before any test; a lane's key is computed only where an entry is not finite. The
/// smallest key of the warp (cap: none).
template <class T>
__device__ int flag_flat_warp(const FlagRows<T>& f, long long w, int lane, int cap) {
    const long long total = f.P * f.rows * f.cols, e0 = w * flag_flat_entries + lane;
    T v[flag_flat_loads];
    if ((w + 1) * flag_flat_entries <= total) {  // every warp but a set's last: no tests
        TITANS_UNROLL
        for (int u = 0; u < flag_flat_loads; ++u) {
            v[u] = f.x[e0 + 32LL * u];
        }
    } else {
        TITANS_UNROLL
        for (int u = 0; u < flag_flat_loads; ++u) {
            const long long e = e0 + 32LL * u;
            v[u] = e < total ? f.x[e] : T(0);
        }
    }
    int bad = 0;
    TITANS_UNROLL
    for (int u = 0; u < flag_flat_loads; ++u) {
        bad |= not_finite(v[u]) ? 1 << u : 0;
    }
    long long key = cap;
    for (int u = 0; bad != 0 && u < flag_flat_loads; ++u) {  // (rare: a non-finite entry)
        if ((bad >> u & 1) != 0) {
            const int k = flag_key(f, (e0 + 32LL * u) / f.cols, cap);
            key = k < key ? k : key;
        }
    }
    return static_cast<int>(warp_min_key(key));
}

/// Warp w of row set f: row w, its columns strided over the lanes. The row's key if it holds
/// a non-finite entry, else cap.
template <class T>
__device__ int flag_row_warp(const FlagRows<T>& f, long long w, int lane, int cap) {
    const long long p = w / f.rows, r = w % f.rows;
    const T* row = f.x + p * f.ps + r * f.ld;
    int bad = 0;
    for (int col = lane; col < f.cols; col += 32) {
        bad |= not_finite(row[col]) ? 1 : 0;
    }
    return warp_max(bad) != 0 ? flag_key(f, w, cap) : cap;
}

/// flags[slot] = the smallest key of the rows holding a NaN or an infinity, if any
/// (atomicMin; the slot starts above every key, keys capped below `cap`), for every row of
/// every set in `sets`; with `raise` given, *raise = 1 instead (a deferred check: flags is
/// not touched). A warp per row, or per flag_flat_entries entries of a set whose rows lie end
/// to end; the checks of a call's stage go in one launch.
template <class T>
__global__ void flag_rows_kernel(FlagSets<T> sets, int* flags, int cap, unsigned* raise) {
    const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (w >= sets.first[sets.count]) {
        return;  // the whole warp
    }
    int i = 0;
    while (w >= sets.first[i + 1]) {
        ++i;
    }
    const FlagRows<T>& f = sets.set[i];
    const long long k = w - sets.first[i];
    const int key = f.flat() ? flag_flat_warp(f, k, lane, cap) : flag_row_warp(f, k, lane, cap);
    if (key < cap && lane == 0) {
        flag_report(FlagSink{flags, raise, cap}, f.slot, key);
    }
}

/// One run of rows copied per pair: run entries of each of P pairs, pair p's from
/// src + p ss to dst + p ds.
template <class T>
struct RowCopy {
    T* dst;
    const T* src;
    unsigned run;
    long long ds, ss;
};

/// How many row copies one copy_rows_kernel launch takes.
inline constexpr int row_copies_max = 8;

/// The copies of one copy_rows_kernel launch: copy i's entries are [first[i], first[i + 1]).
template <class T>
struct RowCopies {
    RowCopy<T> set[row_copies_max];
    unsigned first[row_copies_max + 1];
    int count;
};

/// Every copy of `c` (disjoint destinations, none a source of another), a thread per entry
/// (grid-stride): the pending rows a call saves, or writes, in one launch instead of one each.
template <class T>
__global__ void copy_rows_kernel(RowCopies<T> c) {
    const unsigned total = c.first[c.count], step = gridDim.x * blockDim.x;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        int k = 0;
        while (i >= c.first[k + 1]) {
            ++k;
        }
        const RowCopy<T>& r = c.set[k];
        const unsigned j = i - c.first[k], p = j / r.run, e = j % r.run;
        r.dst[p * r.ds + e] = r.src[p * r.ss + e];
        if (total - i <= step) {
            break;  // i + step would wrap
        }
    }
}

/// The chunk end's weight-shaped arrays of each of `depth` layers, pair-major (P x io[l] each):
/// the next chunk start's adjoints dW', dS' and the chunk's start memory W, S (read), the start
/// memory's adjoints dW (added to) and dS (added to, or written when assign_s: the chunk end
/// is its first writer).
template <class T>
struct EndWeights {
    const T* dwn[limits::max_depth];
    const T* dsn[limits::max_depth];
    const T* w[limits::max_depth];
    const T* s[limits::max_depth];
    T* dw[limits::max_depth];
    T* ds[limits::max_depth];
    long long io[limits::max_depth];
    int depth;
    bool assign_s;
};

/// The chunk end's reversed weight terms of the memory's training backward (memory_sweep.cuh),
/// a block of 256 threads per pair p, layer by layer: dW += be dW', dS += ce dW' + pe dS' (or
/// =, assign_s) entry by entry, and the block sums v[3] += <dW', W>, v[4] += <dW', S>,
/// v[5] += <dS', S>, v = ends + p * stride holding be, ce, pe at v[0..2]. One pass over the
/// six arrays where a thread per entry (the update) and a warp per pair (the sums) made two,
/// and a block per pair where 8 pairs (B = 1 at the headline) had 8 warps on the GPU for
/// their sums.
template <class T>
__global__ void chunk_end_weights_kernel(const TITANS_GRID_CONSTANT EndWeights<T> ew, T* ends,
                                         long long stride) {
    __shared__ T part[256];
    const long long p = blockIdx.x;
    T* v = ends + p * stride;
    const T be = v[0], ce = v[1], pe = v[2];
    for (int l = 0; l < ew.depth; ++l) {
        const long long io = ew.io[l], o = p * io;
        const T* dwn = ew.dwn[l] + o;
        const T* dsn = ew.dsn[l] + o;
        const T* W = ew.w[l] + o;
        const T* S = ew.s[l] + o;
        T* dw = ew.dw[l] + o;
        T* ds = ew.ds[l] + o;
        T a0 = T(0), a1 = T(0), a2 = T(0);
        for (long long e = threadIdx.x; e < io; e += blockDim.x) {
            const T gw = dwn[e], gs = dsn[e], s = S[e];
            a0 += gw * W[e];
            a1 += gw * s;
            a2 += gs * s;
            dw[e] += be * gw;
            const T add = ce * gw + pe * gs;
            ds[e] = ew.assign_s ? add : ds[e] + add;
        }
        a0 = block_reduce<false>(part, a0);
        a1 = block_reduce<false>(part, a1);
        a2 = block_reduce<false>(part, a2);
        if (threadIdx.x == 0) {
            v[3] += a0;
            v[4] += a1;
            v[5] += a2;
        }
    }
}

/// The chunk end's reversed row terms of the memory's training backward, a warp per row r of
/// pair p (P x n rows of `out` entries at pair stride bw): dbar -= g_r AW, then dbar -= s_r AS,
/// entry by entry, and v[dg + r] -= <AW_r, D_r>, v[ds + r] -= <AS_r, D_r>, with v = vec + p vs
/// holding the gates g, s and their adjoints dg, ds at those offsets (dbar = -g_r AW - s_r AS
/// when assign: its first write). AW and AS are then overwritten with -diag(g) D and
/// -diag(s) D, the left factors of the input adjoint's two products (abar += AW dW'^T +
/// AS dS'^T, summed by cuBLAS into abar).
template <class T>
__global__ void end_rows_kernel(T* AW, T* AS, const T* D, T* dbar, T* vec,
                                long long vs, long long g, long long s, long long dg,
                                long long ds, long long P, long long n, long long out,
                                long long bw, bool assign) {
    const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (w >= P * n) {
        return;  // the whole warp
    }
    const long long p = w / n, r = w % n, o = p * bw + r * out;
    T* v = vec + p * vs;
    const T gk = v[g + r], sk = v[s + r];
    T sw = T(0), ss = T(0);
    for (long long c = lane; c < out; c += 32) {
        const long long e = o + c;
        const T aw = AW[e], as = AS[e], d = D[e];
        sw += aw * d;
        ss += as * d;
        T db = assign ? T(0) : dbar[e];
        db -= gk * aw;
        db -= sk * as;
        dbar[e] = db;
        AW[e] = -gk * d;
        AS[e] = -sk * d;
    }
    sw = warp_sum(sw);
    ss = warp_sum(ss);
    if (lane == 0) {
        v[dg + r] -= sw;
        v[ds + r] -= ss;
    }
}

/// A row of d_h entries divided by its L2 norm, at least 1e-12, by the 32 lanes of a warp
/// (every lane calls it). A row whose sum of squares overflows is divided scaled by 2^-e
/// (detail/norm_scale.hpp), as on the CPU.
template <class T>
__device__ bool l2_row(T* row, int dh, int lane) {
    T ss = T(0);
    for (int j = lane; j < dh; j += 32) {
        ss += row[j] * row[j];
    }
    ss = warp_sum(ss);
    bool bad = false;  // an entry this lane wrote is not finite
    if (ss <= detail::largest_finite<T>()) {
        const T nrm = sqrt(ss) > T(1e-12) ? sqrt(ss) : T(1e-12);
        for (int j = lane; j < dh; j += 32) {
            row[j] /= nrm;
            bad = bad || not_finite(row[j]);
        }
        return bad;
    }
    T amax = T(0);
    for (int j = lane; j < dh; j += 32) {
        amax = fabs(row[j]) > amax ? fabs(row[j]) : amax;
    }
    const int e = detail::scale_exponent(warp_max(amax));
    T scaled = T(0);
    for (int j = lane; j < dh; j += 32) {
        const T z = detail::scale_down(row[j], e);
        scaled += z * z;
    }
    const T nrm = sqrt(warp_sum(scaled));
    for (int j = lane; j < dh; j += 32) {
        row[j] = detail::scale_down(row[j], e) / nrm;
        bad = bad || not_finite(row[j]);
    }
    return bad;
}

/// Rows of d_h entries (`rows` of a, then `rows` of b when b is given) through l2_row, one
/// warp per row. `sink` (where on): the forward's check of the rows written, pair-major
/// ([s H + h][t], N rows a pair) and keyed s N + t into slot 0.
template <class T>
__global__ void l2_rows_kernel(T* a, T* b, long long rows, int dh, FlagSink sink, long long N,
                               int H) {
    const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (w >= (b != nullptr ? 2 * rows : rows)) {
        return;  // the whole warp
    }
    const long long r = w % rows;
    const bool bad = l2_row((w < rows ? a : b) + r * dh, dh, lane);
    if (warp_max(bad ? 1 : 0) != 0 && lane == 0) {
        flag_report(sink, 0, r / N / H * N + r % N);
    }
}

/// The gate settings of a MemoryConfig (math §1 gates, §10 clipping), as kernels take them:
/// the sigmoids' factors (tmax, se, sa: MemoryConfig::gate_scale) and the constant gates
/// (MemoryConfig::gate_constant).
template <class T>
struct GateParams {
    GateMode mode;
    T tmax, se, sa, ct, ce, ca, clip;
    static GateParams of(const MemoryConfig& cfg) {
        return {cfg.gates,
                static_cast<T>(cfg.gate_scale(0)),
                static_cast<T>(cfg.gate_scale(1)),
                static_cast<T>(cfg.gate_scale(2)),
                static_cast<T>(cfg.gate_constant(0)),
                static_cast<T>(cfg.gate_constant(1)),
                static_cast<T>(cfg.gate_constant(2)),
                static_cast<T>(cfg.max_grad_norm)};
    }
};

template <class T>
struct GateValues {
    T theta, eta, alpha;
};

/// theta, eta, alpha of row r of a chunk before clipping (math §1), computed by one warp
/// (every lane returns them). `gates`: the chunk's gate logits (rows of 3, the row r at
/// gates + 3 r; PerChunk averages the first n).
template <class T>
__device__ GateValues<T> gate_logits_row(const GateParams<T>& gp, const T* gates, int r, int n,
                                         int lane) {
    if (gp.mode == GateMode::DataDependent) {
        const T* g = gates + 3LL * r;
        return {gp.tmax * detail::sigmoid(g[0]), gp.se * detail::sigmoid(g[1]),
                gp.sa * detail::sigmoid(g[2])};
    }
    if (gp.mode == GateMode::PerChunk) {
        T s0 = T(0), s1 = T(0), s2 = T(0);
        for (int j = lane; j < n; j += 32) {
            s0 += gates[3LL * j];
            s1 += gates[3LL * j + 1];
            s2 += gates[3LL * j + 2];
        }
        return {gp.tmax * detail::sigmoid(warp_sum(s0) / T(n)),
                gp.se * detail::sigmoid(warp_sum(s1) / T(n)),
                gp.sa * detail::sigmoid(warp_sum(s2) / T(n))};
    }
    return {gp.ct, gp.ce, gp.ca};
}

/// The squared norm of a row's surprise gradient (math §10), Σ_l |a_{l-1}|^2 |delta_l|^2,
/// each norm a warp's sum (every lane returns it); rows(l): the row's GradRows<T> of layer l.
template <class T, class Rows>
__device__ T gate_grad_norm2(int depth, Rows rows, int lane) {
    T g2 = T(0);
    for (int l = 0; l < depth; ++l) {
        const detail::GradRows<T> row = rows(l);
        T sa = T(0), sd = T(0);
        for (long long c = lane; c < row.na; c += 32) {
            sa += row.a[c] * row.a[c];
        }
        for (long long c = lane; c < row.nd; c += 32) {
            sd += row.d[c] * row.d[c];
        }
        g2 += warp_sum(sa) * warp_sum(sd);
    }
    return g2;
}

/// The factor math §10 puts on theta for a row of squared gradient norm g2 > clip^2:
/// clip / sqrt(g2) where g2 is finite, else from the scaled norm.
template <class T, class Rows>
__device__ T gate_clip_factor(T clip, int depth, Rows rows, T g2) {
    return g2 <= detail::largest_finite<T>()
               ? clip / sqrt(g2)
               : detail::scaled_grad_norm<T>(depth, rows).clip_factor(clip);
}

/// theta, eta, alpha of one pending row r of a chunk, theta clipped by math §10, computed by
/// one warp (every lane returns them): gate_logits_row, then the clip where
/// gate_grad_norm2 passes clip^2.
template <class T, class Rows>
__device__ GateValues<T> gate_row(const GateParams<T>& gp, int depth, const T* gates, int r,
                                  int n, Rows rows, int lane) {
    GateValues<T> v = gate_logits_row<T>(gp, gates, r, n, lane);
    if (gp.clip > T(0)) {
        const T g2 = gate_grad_norm2<T>(depth, rows, lane);
        if (g2 > gp.clip * gp.clip) {  // the plain sum where finite, else the scaled norm
            v.theta *= gate_clip_factor<T>(gp.clip, depth, rows, g2);
        }
    }
    return v;
}

/// What the memory's backward recomputes of a row's gates (math §1, §10): theta0 before the
/// clip, theta after it (the forward's, bit for bit), eta, alpha, and g2 (the squared
/// gradient norm; 0 without clipping).
template <class T>
struct BackwardGates {
    T theta0, theta, eta, alpha, g2;
};

/// BackwardGates of row r of a chunk of n rows, computed by one warp (every lane returns
/// them) with the forward's gate_logits_row, gate_grad_norm2 and gate_clip_factor. lg: the
/// chunk's logits (rows of 3); rows(l): the row's GradRows<T> of layer l.
template <class T, class Rows>
__device__ BackwardGates<T> backward_gate_row(const GateParams<T>& gp, int depth, const T* lg,
                                              int r, int n, Rows rows, int lane) {
    const GateValues<T> g = gate_logits_row<T>(gp, lg, r, n, lane);
    const bool clipping = gp.clip > T(0);
    const T g2 = clipping ? gate_grad_norm2<T>(depth, rows, lane) : T(0);
    const T theta = clipping && g2 > gp.clip * gp.clip
                        ? g.theta * gate_clip_factor<T>(gp.clip, depth, rows, g2)
                        : g.theta;
    return {g.theta, theta, g.eta, g.alpha, g2};
}

/// The adjoint of gate `which`'s logit (0 theta, 1 eta, 2 alpha; scale its gate_scale) at row
/// r of a chunk of n rows from the gate values' adjoints adj (n of them) and the chunk's
/// logits lg (rows of 3): sigmoid's derivative at the logit (DataDependent) or at the chunk's
/// mean logit, the adjoints summed over the chunk and spread evenly (PerChunk; summed in row
/// order by each row's caller, so no thread stores as it walks the rows).
template <class T>
TITANS_HOST_DEVICE T gate_logit_adjoint(GateMode mode, T scale, const T* lg, const T* adj, int n,
                                        int r, int which) {
    if (mode == GateMode::PerChunk) {
        T m = T(0), dd = T(0);
        for (int q = 0; q < n; ++q) {
            m += lg[q * 3 + which];
            dd += adj[q];
        }
        m /= static_cast<T>(n);
        const T sg = detail::sigmoid(m);
        return dd * scale * (sg * (T(1) - sg)) / static_cast<T>(n);
    }
    const T sg = detail::sigmoid(lg[r * 3 + which]);
    return adj[r] * scale * (sg * (T(1) - sg));
}

/// Where a row's adjoints of a_{l-1} and delta_l are added to (clip_row_backward).
template <class T>
struct AdjointRows {
    T* a;
    T* d;
};

/// theta = theta0 min(1, clip / sqrt(g2)) reversed for one row whose g2 passed clip^2, by one
/// warp (math §9 step 5): g2's adjoint from dtheta goes into adj(l).a (x 2 |delta_l|^2 a_l)
/// and adj(l).d (x 2 |a_l|^2 delta_l), through the scaled norm where g2 overflowed. Returns
/// the factor f = min(1, clip / |u|): theta0's adjoint is dtheta f. The norms are the
/// forward's warp sums; rows(l) as for gate_grad_norm2.
template <class T, class Rows, class Adj>
__device__ T clip_row_backward(T clip, int depth, Rows rows, Adj adj, T dtheta, T theta0, T g2,
                               int lane) {
    if (!(g2 <= detail::largest_finite<T>())) {  // g2 overflowed: scaled
        const detail::GradNorm<T> g = detail::scaled_grad_norm<T>(depth, rows);
        const T f = g.clip_factor(clip);
        const T scale = -dtheta * theta0 * f;
        for (int l = 0; l < depth; ++l) {
            const detail::GradRows<T> x = rows(l);
            const AdjointRows<T> e = adj(l);
            const T ra = g.ratio(x.a, x.na), rd = g.ratio(x.d, x.nd);
            for (long long c = lane; c < x.na; c += 32) e.a[c] += (scale * rd) * (rd * x.a[c]);
            for (long long c = lane; c < x.nd; c += 32) e.d[c] += (scale * ra) * (ra * x.d[c]);
        }
        return f;
    }
    const T f = clip / sqrt(g2);
    const T dg2 = T(-0.5) * dtheta * theta0 * f / g2;
    for (int l = 0; l < depth; ++l) {
        const detail::GradRows<T> x = rows(l);
        const AdjointRows<T> e = adj(l);
        T na = T(0), nd = T(0);
        for (long long c = lane; c < x.na; c += 32) na += x.a[c] * x.a[c];
        for (long long c = lane; c < x.nd; c += 32) nd += x.d[c] * x.d[c];
        na = warp_sum(na);
        nd = warp_sum(nd);
        for (long long c = lane; c < x.na; c += 32) e.a[c] += (T(2) * dg2 * nd) * x.a[c];
        for (long long c = lane; c < x.nd; c += 32) e.d[c] += (T(2) * dg2 * na) * x.d[c];
    }
    return f;
}

/// theta, eta, alpha of pending rows [0, n) of every pair into coef (rows 0..2, CS apart per
/// pair), theta clipped by math §10. One warp per (pair, row).
template <class T>
__global__ void gate_values_kernel(GateParams<T> gp, PendingLayers<T> ly, const T* gates,
                                   T* coef, long long P, int b, int n, long long CS) {
    const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (w >= P * n) {
        return;
    }
    const long long p = w / n, r = w % n;
    const GateValues<T> v = gate_row<T>(
        gp, ly.depth, gates + p * b * 3, static_cast<int>(r), n,
        [&](int l) {
            return detail::GradRows<T>{ly.a[l] + (p * b + r) * ly.in[l], ly.in[l],
                                       ly.d[l] + (p * b + r) * ly.out[l], ly.out[l]};
        },
        lane);
    if (lane == 0) {
        T* cf = coef + p * CS;
        cf[r] = v.theta;
        cf[b + r] = v.eta;
        cf[2 * b + r] = v.alpha;
    }
}

/// Blocks of 256 threads for `warps` warps of work.
inline unsigned warp_blocks(long long warps) {
    return static_cast<unsigned>((warps * 32 + 255) / 256);
}

#endif

}  // namespace titans::backend::cuda
