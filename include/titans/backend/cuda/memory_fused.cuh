#pragma once
// titans/backend/cuda/memory_fused.cuh: the memory's full chunks in one kernel (math §2-5 and
// §10, the forward of a depth-2 memory with lagged retrieval).
//
// A block per (sequence, head) pair runs the pair's full chunks of a piece one after another
// (W and S stay in device memory, the chunk's intermediates in shared memory):
//   read    X = act(Q W1),  y = X W2 (+ Q)                           lagged: y_i = M_{W^s}(q_i)
//   keys    Z1 = K W1, A1 = act(Z1), X = act'(Z1),  D2 = A1 W2 (+ K) - V,  X = (D2 W2^T) . X
//   gates   theta (clipped by ||grad||, math §10), eta, alpha per row; g, s, beta, c, P
//   end     W1 = beta W1 + c S1 - K^T diag(g) X,   S1 = P S1 - K^T diag(s) X
//           W2 = beta W2 + c S2 - A1^T diag(g) D2,  S2 = P S2 - A1^T diag(s) D2
// Nine products of a chunk (b x d_h x h each) go through block_product (tile_product.cuh): on
// the tensor cores in float, in TF32 where the caller allows it or on bfloat16 operands where
// the caller asks for them (FusedOperands), else plain FMAs in T. The same
// algorithm as MemoryKernels<Cuda, T>::scan's segments; the last chunk's rows of A, Delta
// are written to the state's pending arrays as the unfused path leaves them. For a training
// trace (memory_training.cuh) a launch of at most fused_keep_chunks chunks also copies each
// chunk's W and S, as the chunk end loads them, to the trace's buffers (FusedKeep).

#include <atomic>
#include <cstddef>

#include "../../config.hpp"
#include "../../detail/activation.hpp"
#include "../../memory/chunk_coefficients.hpp"
#include "../../memory/config.hpp"
#include "fast_math.cuh"
#include "launch.cuh"
#include "memory_device.cuh"
#include "tile_product.cuh"

namespace titans::backend::cuda {

/// Which forward calls run their full chunks in the fused kernel (when the configuration
/// allows it: fused_plan): Auto where it runs on the tensor cores (float, with TF32 allowed
/// on the state's stream or bfloat16 operands asked for: FusedOperands), On always (plain FMAs
/// in double, and in float without either), Off never. Off also turns off the decode kernel
/// (memory_decode.cuh), which Auto and On run wherever it applies. Process-wide, read at every
/// forward call.
enum class FusedMemory { Auto, On, Off };

inline std::atomic<FusedMemory>& fused_memory_flag() {
    static std::atomic<FusedMemory> flag{FusedMemory::Auto};
    return flag;
}
inline void set_fused_memory(FusedMemory m) { fused_memory_flag().store(m); }
[[nodiscard]] inline FusedMemory fused_memory() { return fused_memory_flag().load(); }

/// The operands of the fused kernel's products in float: Float (TF32 where the state's stream
/// allows TF32, else exact FMAs), BF16 (rounded to bfloat16, 8 significant bits, to nearest
/// even; FP32 sums: mma.sync m16n8k16 on the tensor cores, twice TF32's rate; the error
/// against the CPU in docs/cuda.md). double ignores it; the chunk, d_h and hidden width are
/// multiples of 32 wherever the kernel runs, so of its k-step of 16. Process-wide, read at
/// every forward call.
enum class FusedOperands { Float, BF16 };

inline std::atomic<FusedOperands>& fused_operands_flag() {
    static std::atomic<FusedOperands> flag{FusedOperands::Float};
    return flag;
}
inline void set_fused_operands(FusedOperands o) { fused_operands_flag().store(o); }
[[nodiscard]] inline FusedOperands fused_operands() { return fused_operands_flag().load(); }

/// Launches of the fused kernel in this process (tests and benchmarks read it).
inline std::atomic<long long>& fused_launches() {
    static std::atomic<long long> count{0};
    return count;
}

/// Threads of a fused kernel's block (16 warps: each product of a chunk has 16 warp tiles at
/// the headline shape; at most 128 registers a thread).
inline constexpr int fused_threads = 512;

/// The fused kernel's shared memory for chunk b, head dim dh, hidden width h, in entries of T:
/// K and Q (then D2), b x (dh + 8); A1 and X, b x (h + 8); theta, eta, alpha, g, s (b each) and
/// beta, c, P. Rows are padded by 8 entries (d_h and h are multiples of 32): the lanes of a
/// warp tile's accesses hit distinct banks, row-major pairs in the Pair order and k-major
/// entries in the Split order (tile_product.cuh).
struct FusedLayout {
    int b, dh, h;
    TITANS_HOST_DEVICE int ldk() const { return dh + 8; }
    TITANS_HOST_DEVICE int ldh() const { return h + 8; }
    TITANS_HOST_DEVICE long long k() const { return 0; }
    TITANS_HOST_DEVICE long long q() const { return static_cast<long long>(b) * ldk(); }
    TITANS_HOST_DEVICE long long a1() const { return 2LL * b * ldk(); }
    TITANS_HOST_DEVICE long long x() const { return a1() + static_cast<long long>(b) * ldh(); }
    TITANS_HOST_DEVICE long long coef() const { return x() + static_cast<long long>(b) * ldh(); }
    TITANS_HOST_DEVICE long long entries() const { return coef() + 5LL * b + 3; }
    /// Whether the kernel's warp tiles cover this shape: b, d_h and h multiples of 32.
    [[nodiscard]] bool tiles() const { return b % 32 == 0 && dh % 32 == 0 && h % 32 == 0; }
};

/// Chunks of one fused launch whose start memory a training forward keeps (FusedKeep): its
/// launches take at most this many chunks each.
inline constexpr int fused_keep_chunks = 32;

/// Where one layer's chunk end copies W and S as they were (fused_end_layer): entry (r, c) to
/// w[r ld + c] and s[r ld + c]; w null: nowhere.
template <class T>
struct KeptAt {
    T* w = nullptr;
    T* s = nullptr;
    int ld = 0;
};

/// Where a fused launch copies each chunk's start memory, as a training trace keeps it
/// (memory_training.cuh), or its first chunk's, as a call's rollback keeps it: for chunk c of
/// the launch at[4 c + i], i = 0..3 for W1, W2, S1, S2, each P pairs of the state's layout;
/// at[4 c] null: chunk c's not kept. The pointers travel in the launch's arguments (1 KB in
/// 64-bit), so a call graph records them as any argument.
template <class T>
struct FusedKeep {
    T* at[4 * fused_keep_chunks];
    /// Where chunk c's layer l (0, 1) is kept: from entry `offset` of its W's and S's copies
    /// (a pair's, or a cluster rank's share of it), leading dimension ld; nowhere where none is.
    __device__ KeptAt<T> layer(int c, int l, long long offset, int ld) const {
        if (c >= fused_keep_chunks || at[4 * c] == nullptr) return {};
        return {at[4 * c + l] + offset, at[4 * c + 2 + l] + offset, ld};
    }
};

/// What the fused kernel reads and writes. Piece arrays are pair-major with N rows a pair and
/// point at the first fused chunk's row; W, S, A, Delta are the state's (pair strides in*out,
/// b*width). The reads y: rows ld_y apart, pair p = s H + h's row t at y + (s N + t) ld_y +
/// h d_h where H = y_heads (pair-major [p][N][d_h]: y_heads 1, ld_y d_h; sequence-major
/// (B N) x D, the output product's input: y_heads H, ld_y D).
template <class T>
struct FusedArgs {
    const T* q;
    const T* k;
    const T* v;
    const T* gates;  // [p][N][3] logits (unused with constant gates)
    T* y;
    long long ld_y;
    int y_heads;
    T* w[2];
    T* s[2];
    T* a[2];
    T* d[2];
    long long N;
    int chunks;
    FusedLayout lay;
    GateParams<T> gp;
    Activation act;
    bool residual;
    FusedKeep<T> keep;  // the chunks' start memory, for a training trace (fused_chunks_kernel)
    // The forward's checks of what the launch writes (FlagSink; off: the check kernel's): the
    // read's rows y (slot 1, key t P + p for piece row t = row0 + c b + i, P = pairs) and,
    // where check_state (the launch ends the call's last chunk), W and S (slot 2, key p).
    FlagSink sink;
    long long row0, pairs;
    bool check_state;
};

#if TITANS_CUDA_DEVICE_CODE

/// The shared arrays of one block (FusedLayout).
template <class T>
struct FusedShared {
    T* k;
    T* q;  // the chunk's queries, then D2
    T* a1;
    T* x;  // act(Q W1), then act'(Z1), then Delta_1
    T* theta;
    T* eta;
    T* alpha;
    T* g;
    T* s;
    T* ends;  // beta, c, P at the chunk end
    __device__ FusedShared(T* base, const FusedLayout& l)
        : k(base + l.k()), q(base + l.q()), a1(base + l.a1()), x(base + l.x()),
          theta(base + l.coef()), eta(theta + l.b), alpha(eta + l.b), g(alpha + l.b), s(g + l.b),
          ends(s + l.b) {}
};

/// rows x width entries from src (ld lds) into dst (ld ldd), by the block: a warp per row.
template <class T>
__device__ void copy_tile(T* dst, int ldd, const T* src, long long lds, int rows, int width) {
    const int warps = static_cast<int>(blockDim.x / 32), lane = static_cast<int>(threadIdx.x % 32);
    for (int r = static_cast<int>(threadIdx.x / 32); r < rows; r += warps) {
        for (int c = lane; c < width; c += 32) {
            dst[r * ldd + c] = src[r * lds + c];
        }
    }
}

/// f(e) for the entries e = r ld + c (r < rows, c < width) of a shared array, by the block: a
/// warp per row, the loop kept rolled (the activations' code once, not once per tile entry:
/// the kernel's instructions then fit the instruction caches).
template <class F>
__device__ void each_shared(int rows, int width, int ld, const F& f) {
    const int warps = static_cast<int>(blockDim.x / 32), lane = static_cast<int>(threadIdx.x % 32);
    for (int r = static_cast<int>(threadIdx.x / 32); r < rows; r += warps) {
        TITANS_NO_UNROLL
        for (int c = lane; c < width; c += 32) {
            f(r * ld + c);
        }
    }
}

/// The weights a fused kernel's products read: W1 (d_h x h, leading dimension ld1) and W2
/// (h x d_h, ld2), h the block's hidden width (FusedLayout::h): the pair's whole W in device
/// memory (fused_chunks_kernel), or a cluster rank's columns of W1 and rows of W2 in shared
/// memory (memory_cluster.cuh).
template <class T>
struct FusedWeights {
    const T* w1;
    int ld1;
    const T* w2;
    int ld2;
    __device__ T at1(int k, int j) const { return w1[k * ld1 + j]; }
    __device__ T at2(int k, int j) const { return w2[k * ld2 + j]; }
};

/// The lagged read of the chunk's queries (in sh.q): X = act(Q W1) into sh.x, then X W2 (b x
/// d_h) to the tile epilogue `out`. Products over the hidden width in warp tiles of HT x 2 HT
/// pieces (fused_chunks_kernel's 32 x 32; a cluster rank's smaller share takes 16 x 16).
template <class T, Operands P, int HT, class FT>
__device__ void fused_read(const FusedArgs<T>& f, const FusedShared<T>& sh,
                           const FusedWeights<T>& wt, const FT& out) {
    const FusedLayout& l = f.lay;
    const int ldk = l.ldk(), ldh = l.ldh();
    const Activation act = f.act;
    block_product<T, P, HT, 2 * HT, KOrder::Pair>(
        l.b, l.h, l.dh, RowMajor<T>{sh.q, ldk}, [&](int k, int j) { return wt.at1(k, j); },
        each_pair([&](int i, int j, T z0, T z1) { store_pair(sh.x + i * ldh + j, z0, z1); }));
    __syncthreads();
    each_shared(l.b, l.h, ldh, [&](int e) { sh.x[e] = kernel_activate(act, sh.x[e]); });
    __syncthreads();
    block_product<T, P, 1, 2, KOrder::Pair>(l.b, l.dh, l.h, RowMajor<T>{sh.x, ldh},
                                            [&](int k, int j) { return wt.at2(k, j); }, out);
    __syncthreads();
}

/// The chunk's keys (in sh.k) through W1 (math §2): A1 = act(K W1) into sh.a1, act'(K W1) into
/// sh.x.
template <class T, Operands P, int HT>
__device__ void fused_hidden(const FusedArgs<T>& f, const FusedShared<T>& sh,
                             const FusedWeights<T>& wt) {
    const FusedLayout& l = f.lay;
    const int ldh = l.ldh();
    const Activation act = f.act;
    block_product<T, P, HT, 2 * HT, KOrder::Pair>(
        l.b, l.h, l.dh, RowMajor<T>{sh.k, l.ldk()}, [&](int k, int j) { return wt.at1(k, j); },
        each_pair([&](int i, int j, T z0, T z1) { store_pair(sh.a1 + i * ldh + j, z0, z1); }));
    __syncthreads();
    each_shared(l.b, l.h, ldh, [&](int e) {
        const detail::ValueGrad<T> vg = kernel_activate_with_grad(act, sh.a1[e]);
        sh.a1[e] = vg.value;
        sh.x[e] = vg.grad;
    });
    __syncthreads();
}

/// The error's way back to the hidden layer (math §2): X = (D2 W2^T) . act'(K W1), D2 in sh.q,
/// act'(K W1) in sh.x, overwritten.
template <class T, Operands P, int HT>
__device__ void fused_back(const FusedArgs<T>& f, const FusedShared<T>& sh,
                           const FusedWeights<T>& wt) {
    const FusedLayout& l = f.lay;
    const int ldh = l.ldh();
    block_product<T, P, HT, 2 * HT, KOrder::Pair>(
        l.b, l.h, l.dh, RowMajor<T>{sh.q, l.ldk()}, Transposed<T>{wt.w2, wt.ld2},
        each_pair([&](int i, int j, T z0, T z1) {
            T* x = sh.x + i * ldh + j;
            const EntryPair<T> g = load_pair(x);
            store_pair(x, g.x * z0, g.y * z1);
        }));
    __syncthreads();
}

/// The chunk's keys (in sh.k) forward through W^s and back through the loss (math §2):
/// A1 = act(K W1), D2 = A1 W2 (+ K) - V (into sh.q), X = (D2 W2^T) . act'(K W1).
template <class T, Operands P>
__device__ void fused_keys(const FusedArgs<T>& f, const FusedShared<T>& sh,
                           const FusedWeights<T>& wt, const T* v) {
    const FusedLayout& l = f.lay;
    const int ldk = l.ldk(), dh = l.dh;
    fused_hidden<T, P, 2>(f, sh, wt);
    const bool res = f.residual;
    block_product<T, P, 1, 2, KOrder::Pair>(
        l.b, dh, l.h, RowMajor<T>{sh.a1, l.ldh()}, [&](int k, int j) { return wt.at2(k, j); },
        [&](const T(&acc)[1][2][4], int i, int j0) {
            T d[1][2][4], kt[1][2][4];  // V's entries first: their loads in flight together
            tile_gather(d, i, j0, [&](int r, int c) { return v[r * dh + c]; });
            tile_gather(kt, i, j0, [&](int r, int c) { return res ? sh.k[r * ldk + c] : T(0); });
            TITANS_UNROLL
            for (int n = 0; n < 2; ++n) {
                TITANS_UNROLL
                for (int e = 0; e < 4; ++e) {
                    d[0][n][e] = (acc[0][n][e] + kt[0][n][e]) - d[0][n][e];
                }
            }
            each_pair([&](int r, int c, T z0, T z1) { store_pair(sh.q + r * ldk + c, z0, z1); })(
                d, i, j0);
        });
    __syncthreads();
    fused_back<T, P, 2>(f, sh, wt);
}

/// Row r's theta, eta, alpha into shared memory (by lane 0 of the row's warp).
template <class T>
__device__ void store_gates(const FusedShared<T>& sh, int r, const GateValues<T>& v, int lane) {
    if (lane == 0) {
        sh.theta[r] = v.theta;
        sh.eta[r] = v.eta;
        sh.alpha[r] = v.alpha;
    }
}

/// The chunk-end coefficients of the chunk's b rows' gates (math §4), by one thread, between
/// two block barriers (after every row's store_gates).
template <class T>
__device__ void fused_coefficients(const FusedShared<T>& sh, int b) {
    __syncthreads();
    if (threadIdx.x == 0) {
        chunk_end_coefficients<T>(b, sh.theta, sh.eta, sh.alpha, sh.g, sh.s, sh.ends,
                                  sh.ends + 1, sh.ends + 2);
    }
    __syncthreads();
}

/// theta, eta, alpha of the chunk's rows (a warp per row), then its chunk-end coefficients.
template <class T>
__device__ void fused_gates(const FusedArgs<T>& f, const FusedShared<T>& sh, const T* gates) {
    const FusedLayout& l = f.lay;
    const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
    const int ldk = l.ldk(), ldh = l.ldh();
    for (int r = warp; r < l.b; r += static_cast<int>(blockDim.x / 32)) {
        const GateValues<T> gv = gate_row<T>(
            f.gp, 2, gates, r, l.b,
            [&](int layer) {
                return layer == 0
                           ? detail::GradRows<T>{sh.k + r * ldk, l.dh, sh.x + r * ldh, l.h}
                           : detail::GradRows<T>{sh.a1 + r * ldh, l.h, sh.q + r * ldk, l.dh};
            },
            lane);
        store_gates(sh, r, gv, lane);
    }
    fused_coefficients(sh, l.b);
}

/// One k-step (k_step<P>) of a layer's chunk end for a warp tile: accg += A^T diag(g) E and
/// accs += A^T diag(s) E over k in [k0, k0 + k_step<P>) (A, E k-major in shared memory, rows
/// padded by 8: the Split order's lanes hit distinct banks). On the tensor cores both products
/// share the A fragments and E's loads; elsewhere two tile steps.
template <class T, Operands P, int MT, int NT>
__device__ inline void end_step(T (&accg)[MT][NT][4], T (&accs)[MT][NT][4], const T* A, int lda,
                                const T* E, int lde, const T* g, const T* s, int i, int j, int k0,
                                int gl, int q) {
    const auto a = [&](int r, int k) { return A[k * lda + r]; };
#if defined(__CUDA_ARCH__)
    if constexpr (P != Operands::Exact) {
        constexpr KOrder O = KOrder::Split;
        constexpr int S = k_step<P> / 8;
        std::uint32_t af[S][MT][4], bg[S][NT][2], bs[S][NT][2];
        TITANS_UNROLL
        for (int st = 0; st < S; ++st) {
            const int ks = k0 + 8 * st;
            fragment_a<O, P>(af[st], a, i, ks, q);
            const int k = slot_k<O>(ks, q, 0), kh = slot_k<O>(ks, q, 1);
            const T g0 = g[k], g1 = g[kh], s0 = s[k], s1 = s[kh];
            TITANS_UNROLL
            for (int ni = 0; ni < NT; ++ni) {
                const T e0 = E[k * lde + j + 8 * ni], e1 = E[kh * lde + j + 8 * ni];
                bg[st][ni][0] = fragment_bits<P, void>(e0 * g0);
                bg[st][ni][1] = fragment_bits<P, void>(e1 * g1);
                bs[st][ni][0] = fragment_bits<P, void>(e0 * s0);
                bs[st][ni][1] = fragment_bits<P, void>(e1 * s1);
            }
        }
        fragment_mma<P>(accg, af, bg);
        fragment_mma<P>(accs, af, bs);
        return;
    }
#endif
    tile_step<T, P, MT, NT>(accg, a, [&](int k, int c) { return E[k * lde + c] * g[k]; }, i, j, k0,
                            gl, q);
    tile_step<T, P, MT, NT>(accs, a, [&](int k, int c) { return E[k * lde + c] * s[k]; }, i, j, k0,
                            gl, q);
}

/// One layer's chunk end (math §4): W = beta W + c S - A^T diag(g) E, S = P S - A^T diag(s) E,
/// A (b x in, ld lda) and E (b x out, ld lde) in shared memory, W and S (in x out, ld ldw) in
/// device or shared memory. A warp tile holds both products' accumulators; its W and S
/// entries are loaded together before any is stored. `kept` (or nowhere): W and S as they
/// were, each entry as it is loaded (a training trace's chunk-start memory). Returns whether
/// an entry of W or S this thread stored is not finite, where `check` (else false).
template <class T, Operands P>
__device__ bool fused_end_layer(const FusedShared<T>& sh, int b, int in, int out, const T* A,
                                int lda, const T* E, int lde, T* W, T* S, int ldw, bool check,
                                KeptAt<T> kept = {}) {
    constexpr int MT = 2, NT = 2;
    const T beta = sh.ends[0], c = sh.ends[1], pe = sh.ends[2];
    const int warp = static_cast<int>(threadIdx.x / 32), warps = static_cast<int>(blockDim.x / 32);
    const int lane = static_cast<int>(threadIdx.x % 32), gl = lane / 4, q = lane % 4;
    const int tiles_n = out / (8 * NT), tiles = (in / (16 * MT)) * tiles_n;
    bool bad = false;
    for (int tile = warp; tile < tiles; tile += warps) {
        const int i = tile / tiles_n * 16 * MT + gl, j = tile % tiles_n * 8 * NT + gl;
        T accg[MT][NT][4], accs[MT][NT][4], w[MT][NT][4], sv[MT][NT][4];
        tile_zero(accg);
        tile_zero(accs);
        for (int k0 = 0; k0 < b; k0 += k_step<P>) {
            end_step<T, P, MT, NT>(accg, accs, A, lda, E, lde, sh.g, sh.s, i, j, k0, gl, q);
        }
        const int j0 = j - gl + 2 * q;
        tile_gather(w, i, j0, [&](int r, int col) { return W[r * ldw + col]; });
        tile_gather(sv, i, j0, [&](int r, int col) { return S[r * ldw + col]; });
        if (kept.w != nullptr) {
            tile_store(w, i, j0, [&](int r, int col, T z) { kept.w[r * kept.ld + col] = z; });
            tile_store(sv, i, j0, [&](int r, int col, T z) { kept.s[r * kept.ld + col] = z; });
        }
        TITANS_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
            TITANS_UNROLL
            for (int ni = 0; ni < NT; ++ni) {
                TITANS_UNROLL
                for (int e = 0; e < 4; ++e) {
                    w[mi][ni][e] = beta * w[mi][ni][e] + c * sv[mi][ni][e] - accg[mi][ni][e];
                    sv[mi][ni][e] = pe * sv[mi][ni][e] - accs[mi][ni][e];
                }
            }
        }
        if (check) {  // (uniform: the call's last chunk end only)
            TITANS_UNROLL
            for (int e = 0; e < MT * NT * 4; ++e) {
                bad = bad | not_finite((&w[0][0][0])[e]) | not_finite((&sv[0][0][0])[e]);
            }
        }
        tile_store(w, i, j0, [&](int r, int col, T z) { W[r * ldw + col] = z; });
        tile_store(sv, i, j0, [&](int r, int col, T z) { S[r * ldw + col] = z; });
    }
    return bad;
}

/// The first row of chunk c's reads of pair p (FusedArgs::y; its rows f.ld_y apart).
template <class T>
__device__ T* fused_y_rows(const FusedArgs<T>& f, long long p, int c) {
    const long long s = p / f.y_heads, h = p % f.y_heads;
    return f.y + (s * f.N + static_cast<long long>(c) * f.lay.b) * f.ld_y + h * f.lay.dh;
}

/// Whether chunk c of a fused launch checks the W and S it ends with (FusedArgs::check_state).
template <class T>
__device__ bool fused_checks_state(const FusedArgs<T>& f, int c) {
    return f.check_state && c + 1 == f.chunks;
}

/// The fused launch's checks of chunk c of pair p (FusedArgs::sink): y's first non-finite row
/// `bad_row` (b: none), and whether a W or S entry a thread stored is not finite (`bad_state`,
/// checked where fused_checks_state).
template <class T>
__device__ void fused_flags(const FusedArgs<T>& f, long long p, int c, int bad_row,
                            bool bad_state) {
    const int b = f.lay.b;
    if (bad_row < b) {
        flag_report(f.sink, 1, (f.row0 + static_cast<long long>(c) * b + bad_row) * f.pairs + p);
    }
    if (bad_state) {
        flag_report(f.sink, 2, p);
    }
}

/// The full chunks of one pair (blockIdx.x): read, keys, gates, chunk end, chunk by chunk;
/// each chunk's start memory into f.keep where that is given.
template <class T, Operands P>
__global__ void __launch_bounds__(fused_threads)
    fused_chunks_kernel(const TITANS_GRID_CONSTANT FusedArgs<T> f) {
    const long long p = blockIdx.x;
    const FusedLayout& l = f.lay;
    const FusedShared<T> sh(dynamic_shared<T>(), l);
    const long long io = static_cast<long long>(l.dh) * l.h;
    T* w1 = f.w[0] + p * io;
    T* w2 = f.w[1] + p * io;
    T* s1 = f.s[0] + p * io;
    T* s2 = f.s[1] + p * io;
    const FusedWeights<T> wt{w1, l.h, w2, l.dh};
    for (int c = 0; c < f.chunks; ++c) {
        const long long row = p * f.N + static_cast<long long>(c) * l.b;  // first row, pair-major
        copy_tile(sh.q, l.ldk(), f.q + row * l.dh, l.dh, l.b, l.dh);
        copy_tile(sh.k, l.ldk(), f.k + row * l.dh, l.dh, l.b, l.dh);
        __syncthreads();
        T* y = fused_y_rows(f, p, c);
        const bool res = f.residual;
        const long long ldy = f.ld_y;
        const int ldk = l.ldk();
        int bad_row = l.b;  // the first row of y this thread stored a non-finite entry of
        fused_read<T, P, 2>(f, sh, wt, each_entry([&](int i, int j, T z) {
                                const T yz = res ? z + sh.q[i * ldk + j] : z;
                                y[i * ldy + j] = yz;
                                bad_row = not_finite(yz) && i < bad_row ? i : bad_row;
                            }));
        fused_keys<T, P>(f, sh, wt, f.v + row * l.dh);
        fused_gates<T>(f, sh, f.gates != nullptr ? f.gates + row * 3 : nullptr);
        const bool check = fused_checks_state(f, c);
        const bool bad1 =
            fused_end_layer<T, P>(sh, l.b, l.dh, l.h, sh.k, l.ldk(), sh.x, l.ldh(), w1, s1, l.h,
                                  check, f.keep.layer(c, 0, p * io, l.h));
        const bool bad2 = fused_end_layer<T, P>(sh, l.b, l.h, l.dh, sh.a1, l.ldh(), sh.q,
                                                l.ldk(), w2, s2, l.dh, check,
                                                f.keep.layer(c, 1, p * io, l.dh));
        fused_flags(f, p, c, bad_row, bad1 || bad2);
        if (c + 1 == f.chunks) {  // the last chunk's rows: the state's pending A, Delta
            const long long pb = p * l.b;
            copy_tile(f.a[0] + pb * l.dh, l.dh, sh.k, l.ldk(), l.b, l.dh);
            copy_tile(f.a[1] + pb * l.h, l.h, sh.a1, l.ldh(), l.b, l.h);
            copy_tile(f.d[0] + pb * l.h, l.h, sh.x, l.ldh(), l.b, l.h);
            copy_tile(f.d[1] + pb * l.dh, l.dh, sh.q, l.ldk(), l.b, l.dh);
        }
        __syncthreads();
    }
}

#endif

}  // namespace titans::backend::cuda
