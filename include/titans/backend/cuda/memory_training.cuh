#pragma once
// titans/backend/cuda/memory_training.cuh: the neural memory's training pass on CUDA (math §9),
// giving the CPU's results (cpu/memory_training.hpp), every update, retrieval and gate mode.
//
// forward runs Kernels::forward a chunk at a time (from a chunk boundary; one transaction over
// the call, so an error leaves the state as it was), keeping in device memory what the CPU's
// Trace keeps: the input, the incoming conv tails, the pre-conv products u = x [W_Q | W_K |
// W_V], the gate logits (bias added) and the memory (W, S) at every chunk start, laid out as
// the state's (per layer, pairs contiguous) so that it feeds batched GEMMs as is.
//
// backward, all pairs at once, chunks last first (deterministic, no atomics):
//   1. the projections' stages recomputed from u and the tails (conv, phi, norms), q, k, v and
//      the logits pair-major; dyh = dy W_O^T.
//   2. per chunk, from its start memory: the key pass with its intermediates (batched GEMMs),
//      gates with clipping, the read recomputed and reversed (lagged, or the dual form with G
//      from chunk_row_coefficients), the chunk end reversed, the coefficients by the shared
//      TITANS_HOST_DEVICE chunk_coefficients_backward (a thread per pair), clipping, the key
//      pass's second-order terms (detail::KeyTape::backward as batched GEMMs), the gates; the
//      start memory's adjoint carried to the chunk before.
//   3. the projections reversed (norm, phi, conv transposed, tails), dx and the gradients.
// Not here yet: the staged reverse MAC's training drives (cpu: Reverse, start, forward_part,
// read_weights_backward), hence staged = false and Block<T, Cuda> is not trainable.

#include <cstdint>
#include <utility>
#include <vector>

#include "../../detail/activation.hpp"
#include "../../detail/norm_scale.hpp"
#include "../../detail/trace.hpp"
#include "../../memory/chunk_coefficients.hpp"
#include "../../memory/chunk_coefficients_backward.hpp"
#include "../../memory/state_gradient.hpp"
#include "../backend.hpp"
#include "blas.cuh"
#include "layer_kernels.cuh"
#include "launch.cuh"
#include "memory_kernels.cuh"
#include "runtime.cuh"
#include "transfer.cuh"
#include "../../memory/kernels_decl.hpp"

namespace titans::backend {

template <class T>
struct MemoryTraining<Cuda, T> {
    static constexpr bool available = true;
    /// No staged reverse (Reverse, start, forward_part, read_weights_backward) yet: MAC's
    /// training needs it, so Block<T, Cuda> is not trainable.
    static constexpr bool staged = false;
    using Kernels = MemoryKernels<Cuda, T>;
    using Buf = cuda::DeviceBuffer<T>;
    using Mat = Matrix<T>;
    using Index = Eigen::Index;

    using DeviceMatrix = cuda::DeviceMatrix<T>;

    /// What backward needs, in device memory (the CPU Trace's members, same meaning):
    /// x (B*N) x d; tail_in B x (K-1) x 3D; u (B*N) x 3D; logits (B*N) x 3H (Constant gates:
    /// none); memory[ch * 2L + l] the weights W_{l+1} and memory[ch * 2L + L + l] the momentum
    /// S_{l+1} at chunk ch's start (P x layer_in x layer_out, pair p = s H + h), chunks =
    /// ceil(N / b).
    struct Trace {
        MemoryConfig cfg;
        DeviceMatrix x;
        int batch = 0;
        std::int64_t start = 0;
        Buf tail_in, u, logits;
        std::vector<Buf> memory;
        long long chunks = 0;
        detail::TraceFilled filled;  // a moved-from trace is empty
        [[nodiscard]] bool empty() const { return !filled; }
        [[nodiscard]] Index rows() const { return x.rows(); }
    };

    /// The sizes forward leaves in a trace of B sequences of N rows for cfg, past the checks
    /// of batch, rows and start (NeuralMemory::validate_trace), as the CPU's check_trace: the
    /// input's elements, the tails, products and logits, and ceil(N / b) chunk starts of 2L
    /// buffers of P = B*H layer_in x layer_out matrices. ShapeError naming the part otherwise.
    static void check_trace(const MemoryConfig& cfg, const Trace& tr, const char* where) {
        using detail::check_trace_part;
        const long long B = tr.batch, rows = tr.x.rows(), N = rows / B, D = cfg.inner_dim();
        const long long K1 = cfg.use_conv ? cfg.conv_kernel - 1 : 0, b = cfg.effective_chunk();
        const long long H = cfg.n_heads, L = cfg.depth, gated = cfg.gates != GateMode::Constant;
        const auto size = [&](const Buf& buf, long long expected, const char* part) {
            check_trace_part(static_cast<long long>(buf.size()) == expected, where, part,
                             buf.size(), detail::concat(expected, " elements"));
        };
        size(tr.x.mem, rows * tr.x.cols(), "x.mem.size()");
        size(tr.tail_in, B * K1 * 3 * D, "tail_in.size()");
        size(tr.u, rows * 3 * D, "u.size()");
        size(tr.logits, gated * rows * 3 * H, "logits.size()");
        check_trace_part(tr.chunks == (N + b - 1) / b, where, "chunks", tr.chunks,
                         detail::concat("ceil(N / chunk) = ", (N + b - 1) / b));
        check_trace_part(static_cast<long long>(tr.memory.size()) == tr.chunks * 2 * L, where,
                         "memory.size()", tr.memory.size(), "2 depth per chunk start");
        for (std::size_t i = 0; i < tr.memory.size(); ++i) {
            const int l = static_cast<int>(i % static_cast<std::size_t>(L)) + 1;
            size(tr.memory[i], B * H * cfg.layer_in(l) * cfg.layer_out(l), "memory[i].size()");
        }
    }

    /// Kernels::forward from a state at a chunk boundary, recording the trace (x, y device
    /// views, (B*N) x d, sequence-major); diag (optional, on the host) as Kernels::forward
    /// fills it. On an error the state is as before.
    static void forward(const MemoryConfig& cfg, const typename Kernels::Prepared& pp,
                        typename Kernels::State& st, View<const T> x, View<T> y, Trace& trace,
                        Diagnostics<T>* diag = nullptr) {
        const int B = st.batch();
        const long long N = x.rows / B, d = cfg.d_model, b = cfg.effective_chunk();
        Trace t = start(cfg, st, x);
        if (diag != nullptr) {
            diag->loss.setZero(x.rows, cfg.n_heads);
            diag->grad_norm.setZero(x.rows, cfg.n_heads);
        }
        Buf xs(static_cast<std::size_t>(B * b * d)), ys(static_cast<std::size_t>(B * b * d));
        Diagnostics<T> part;
        const cudaStream_t sm = st.ctx_->stream();
        const bool own = Kernels::begin(st);
        try {
            for (long long ch = 0; ch < t.chunks; ++ch) {
                const long long t0 = ch * b, m = std::min(b, N - t0);
                keep_chunk_start(cfg, st, t, ch);
                // The chunk's rows of every sequence, contiguous (B*m x d), and back.
                const ChunkRows rows{B, N, t0, m};
                rows.gather(sm, x.data, x.stride, xs.data(), d);
                if (diag != nullptr) {  // forward_piece writes into a sized one
                    part.loss.setZero(B * m, cfg.n_heads);
                    part.grad_norm.setZero(B * m, cfg.n_heads);
                }
                Kernels::forward_piece(cfg, *pp, st, View<const T>{xs.data(), B * m, d, d},
                                       View<T>{ys.data(), B * m, d, d},
                                       diag != nullptr ? &part : nullptr);
                rows.scatter(sm, ys.data(), y.data, y.stride, d, nullptr);
                keep_products(cfg, pp, st, t, rows);
                if (diag != nullptr) {
                    rows.place(part, *diag);
                }
            }
            st.ctx_->synchronize();
        } catch (...) {
            Kernels::rollback(st);
            throw;
        }
        if (own) {
            Kernels::commit(st);
        }
        t.filled = true;
        trace = std::move(t);
    }

    // The forward's parts (public: nvcc's extended lambdas may not sit in private members).

    /// Rows [t0, t0 + m) of each of B sequences of N rows: pieces of a sequence-major matrix
    /// moved to and from a contiguous (B*m) x cols one.
    struct ChunkRows {
        long long B, N, t0, m;
        /// to (B*m x cols, contiguous) <- the chunk's rows of from (row stride ld).
        void gather(cudaStream_t sm, const T* from, long long ld, T* to, long long cols) const {
            const long long n = N, first = t0, rows = m;
            cuda::each(sm, B * m * cols, [=] __device__(unsigned i) {
                const long long r = i / cuda::u32(cols), c = i % cuda::u32(cols),
                                s = cuda::u32(r) / cuda::u32(rows), tt = cuda::u32(r) % cuda::u32(rows);
                to[i] = from[(s * n + first + tt) * ld + c];
            });
        }
        /// The chunk's rows of to (row stride ld) <- from (B*m x cols, contiguous), plus
        /// bias[c] per column when bias is given.
        void scatter(cudaStream_t sm, const T* from, T* to, long long ld, long long cols,
                     const T* bias) const {
            const long long n = N, first = t0, rows = m;
            cuda::each(sm, B * m * cols, [=] __device__(unsigned i) {
                const long long r = i / cuda::u32(cols), c = i % cuda::u32(cols),
                                s = cuda::u32(r) / cuda::u32(rows), tt = cuda::u32(r) % cuda::u32(rows);
                to[(s * n + first + tt) * ld + c] = bias != nullptr ? from[i] + bias[c] : from[i];
            });
        }
        /// The chunk's diagnostics (B*m rows, on the host) into the call's (B*N rows).
        void place(const Diagnostics<T>& part, Diagnostics<T>& all) const {
            for (long long s = 0; s < B; ++s) {
                all.loss.middleRows(s * N + t0, m) = part.loss.middleRows(s * m, m);
                all.grad_norm.middleRows(s * N + t0, m) = part.grad_norm.middleRows(s * m, m);
            }
        }
    };

    /// A trace for x's rows from st: the input and the incoming tails copied, the products,
    /// logits and chunk-start memories allocated.
    static Trace start(const MemoryConfig& cfg, const typename Kernels::State& st,
                       View<const T> x) {
        const int B = st.batch();
        const long long N = x.rows / B, D = cfg.inner_dim(), H = cfg.n_heads,
                        b = cfg.effective_chunk(), K1 = cfg.use_conv ? cfg.conv_kernel - 1 : 0;
        Trace t;
        t.cfg = cfg;
        t.batch = B;
        t.start = st.position();
        t.x = DeviceMatrix::copy_of(x, "cudaMemcpy2D (memory trace input)");
        t.tail_in = Buf(static_cast<std::size_t>(B * K1 * 3 * D));
        if (K1 > 0) {
            Kernels::copy_into(t.tail_in, st.tail_, st.ctx_->stream());
        }
        t.u = Buf(static_cast<std::size_t>(B * N * 3 * D));
        const bool gated = cfg.gates != GateMode::Constant;
        t.logits = Buf(static_cast<std::size_t>(gated ? B * N * 3 * H : 0));
        t.chunks = (N + b - 1) / b;
        t.memory.resize(static_cast<std::size_t>(t.chunks * 2 * cfg.depth));
        return t;
    }

    /// The memory (W, S of every layer) at chunk ch's start, from the state, into the trace.
    static void keep_chunk_start(const MemoryConfig& cfg, const typename Kernels::State& st,
                                 Trace& t, long long ch) {
        const long long L = cfg.depth;
        const cudaStream_t sm = st.ctx_->stream();
        for (long long l = 0; l < L; ++l) {
            const auto li = static_cast<std::size_t>(l);
            const auto at = static_cast<std::size_t>(ch * 2 * L + l);
            t.memory[at] = Buf(st.w_[li].size());
            t.memory[at + static_cast<std::size_t>(L)] = Buf(st.s_[li].size());
            Kernels::copy_into(t.memory[at], st.w_[li], sm);
            Kernels::copy_into(t.memory[at + static_cast<std::size_t>(L)], st.s_[li], sm);
        }
    }

    /// The chunk's products u and gate logits (bias added), from the state's workspace.
    static void keep_products(const MemoryConfig& cfg, const typename Kernels::Prepared& pp,
                              const typename Kernels::State& st, Trace& t, const ChunkRows& rows) {
        const cudaStream_t sm = st.ctx_->stream();
        const auto& w = *st.work_;
        rows.scatter(sm, w.u.data(), t.u.data(), 3 * cfg.inner_dim(), 3 * cfg.inner_dim(),
                     nullptr);
        if (cfg.gates != GateMode::Constant) {
            rows.scatter(sm, w.logits.data(), t.logits.data(), 3 * cfg.n_heads,
                         3 * cfg.n_heads, pp->b_gates.data());
        }
    }

    // ---------------------------------------------------------------------------------------
    // backward (math §9): every pair at once, chunks last first.
    // ---------------------------------------------------------------------------------------
    /// A device matrix product over P pairs: C_p = alpha op(A_p) op(B_p) + beta C_p.
    static void mm(const cuda::StreamContext& cx, bool ta, bool tb, long long m, long long n,
                   long long k, T alpha, const T* a, long long lda, long long sa, const T* b,
                   long long ldb, long long sb, T beta, T* c, long long ldc, long long sc, long long P) {
        if (k == 0) {  // cuBLAS leaves C untouched when k = 0 only if beta is applied
            if (m * n > 0 && beta != T(1)) {
                cuda::each(cx.stream(), P * m * n, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(m * n), rc = i % cuda::u32(m * n);
                    T& e = c[p * sc + (rc / n) * ldc + rc % n];
                    e = beta == T(0) ? T(0) : e * beta;
                });
            }
            return;
        }
        cuda::gemm<T>(cx.blas(), ta, tb, static_cast<int>(m), static_cast<int>(n),
                      static_cast<int>(k), alpha, {a, static_cast<int>(lda), sa},
                      {b, static_cast<int>(ldb), sb}, beta, c, static_cast<int>(ldc), sc,
                      static_cast<int>(P));
    }
    static Buf zeros(std::size_t n) {
        Buf b(n);
        if (n > 0) {
            cuda::check(cudaMemsetAsync(b.data(), 0, n * sizeof(T), cuda::thread_context().stream()),
                        "cudaMemsetAsync (memory backward)");
        }
        return b;
    }
    /// The key tape's adjoints per layer (written by the clipping's reverse).
    struct Adjoints {
        T* a[limits::max_depth];
        T* d[limits::max_depth];
    };
    static void upload_to(T* to, const Mat& m) {
        if (m.size() > 0) {
            cuda::check(cudaMemcpy(to, m.data(), static_cast<std::size_t>(m.size()) * sizeof(T),
                                   cudaMemcpyHostToDevice),
                        "cudaMemcpy (memory backward to device)");
        }
    }
    static Mat download_mat(const T* from, Index rows, Index cols) {
        Mat m(rows, cols);
        if (m.size() > 0) {
            cuda::check(cudaMemcpy(m.data(), from, static_cast<std::size_t>(m.size()) * sizeof(T),
                                   cudaMemcpyDeviceToHost),
                        "cudaMemcpy (memory backward to host)");
        }
        return m;
    }

    /// Offsets in a pair's vector block (b = the chunk size).
    struct Vec {
        long long b;
        TITANS_HOST_DEVICE long long theta0() const { return 0; }
        TITANS_HOST_DEVICE long long theta() const { return b; }
        TITANS_HOST_DEVICE long long eta() const { return 2 * b; }
        TITANS_HOST_DEVICE long long alpha() const { return 3 * b; }
        TITANS_HOST_DEVICE long long g2() const { return 4 * b; }
        TITANS_HOST_DEVICE long long beta() const { return 5 * b; }
        TITANS_HOST_DEVICE long long c() const { return 6 * b; }
        TITANS_HOST_DEVICE long long g() const { return 7 * b; }
        TITANS_HOST_DEVICE long long s() const { return 8 * b; }
        TITANS_HOST_DEVICE long long dtheta() const { return 9 * b; }
        TITANS_HOST_DEVICE long long deta() const { return 10 * b; }
        TITANS_HOST_DEVICE long long dalpha() const { return 11 * b; }
        TITANS_HOST_DEVICE long long dbeta() const { return 12 * b; }
        TITANS_HOST_DEVICE long long dc() const { return 13 * b; }
        TITANS_HOST_DEVICE long long dg() const { return 14 * b; }
        TITANS_HOST_DEVICE long long ds() const { return 15 * b; }
        TITANS_HOST_DEVICE long long scratch() const { return 16 * b; }  // 6 b
        TITANS_HOST_DEVICE long long ends() const { return 22 * b; }     // be, ce, pe, dbe, dce, dpe
        TITANS_HOST_DEVICE long long G() const { return 22 * b + 6; }    // b x b
        TITANS_HOST_DEVICE long long dG() const { return 22 * b + 6 + b * b; }
        TITANS_HOST_DEVICE long long size() const { return 22 * b + 6 + 2 * b * b; }
    };

    static void backward(const MemoryConfig& cfg, const typename Kernels::Prepared& pp,
                         const Trace& tr, View<const T> dyv, View<T> dxv, MemoryParams<T>& g,
                         const MemoryStateGradient<T>* d_out = nullptr,
                         MemoryStateGradient<T>* d_in = nullptr) {
        const cuda::StreamContext& cx = cuda::thread_context();
        const cudaStream_t sm = cx.stream();
        const typename Kernels::Params& prm = *pp;
        const int B = tr.batch, L = cfg.depth;
        const long long M = tr.rows(), N = M / B, d = cfg.d_model, D = cfg.inner_dim(),
                        H = cfg.n_heads, dh = cfg.head_dim(), P = B * H, C3 = 3 * D, G3 = 3 * H,
                        b = cfg.effective_chunk();
        const long long K = cfg.conv_kernel, K1 = cfg.use_conv ? K - 1 : 0;
        const bool gated = cfg.gates != GateMode::Constant, silu = cfg.qkv_activation == Activation::SiLU,
                   norm = cfg.normalize_qk, conv = cfg.use_conv, residual = cfg.residual,
                   inchunk = cfg.retrieval == Retrieval::InChunk;
        const Activation act = cfg.activation;
        const GateMode gmode = cfg.gates;
        const T tmax = static_cast<T>(cfg.theta_max), ct = static_cast<T>(cfg.constant_theta),
                ce = static_cast<T>(cfg.constant_eta), ca = static_cast<T>(cfg.constant_alpha),
                clip = static_cast<T>(cfg.max_grad_norm);
        const bool clipping = cfg.max_grad_norm > 0;
        const T* x = tr.x.mem.data();
        const T* u = tr.u.data();
        const T* tail = tr.tail_in.data();
        const T* taps = prm.taps.data();
        // 1. The projections' stages: c (conv), pre = phi(c), qkv (norm), norms of pre's heads.
        Buf cb(static_cast<std::size_t>(M * C3)), preb(static_cast<std::size_t>(M * C3)),
            qkvb(static_cast<std::size_t>(M * C3)), nb(static_cast<std::size_t>(M * 4 * H));
        T* cc = cb.data();
        T* pre = preb.data();
        T* qkv = qkvb.data();
        T* nrm = nb.data();
        cuda::each(sm, M * C3, [=] __device__(unsigned i) {
            const long long r = i / cuda::u32(C3), j = i % cuda::u32(C3), s = cuda::u32(r) / cuda::u32(N),
                            t = cuda::u32(r) % cuda::u32(N);
            T v = u[i];
            if (conv) {
                v *= taps[(K - 1) * C3 + j];
                for (long long q = 0; q < K - 1; ++q) {
                    const long long tt = t - K + 1 + q;
                    v += taps[q * C3 + j] * (tt >= 0 ? u[(s * N + tt) * C3 + j]
                                                     : tail[(s * K1 + tt + K - 1) * C3 + j]);
                }
            }
            cc[i] = v;
            pre[i] = silu ? detail::silu(v) : v;
        });
        // Each head's norm as n 2^e (detail::row_norm_parts; e > 0 where the sum of squares
        // overflows): nrm[2 k] = n, nrm[2 k + 1] = e.
        cuda::each(sm, M * 2 * H, [=] __device__(unsigned i) {
            const long long r = i / cuda::u32(2 * H), h = i % cuda::u32(2 * H);
            int e = 0;
            nrm[2 * i] = detail::row_norm_parts(pre + r * C3 + h * dh, dh, e);
            nrm[2 * i + 1] = static_cast<T>(e);
        });
        cuda::each(sm, M * C3, [=] __device__(unsigned i) {
            const long long r = i / cuda::u32(C3), j = i % cuda::u32(C3);
            T v = pre[i];
            if (norm && j < 2 * D) {
                const long long k = r * 2 * H + j / dh;
                const T n0 = nrm[2 * k];
                const int e = static_cast<int>(nrm[2 * k + 1]);
                v = e > 0 ? detail::scale_down(v, e) / n0 : v / (n0 > T(1e-12) ? n0 : T(1e-12));
            }
            qkv[i] = v;
        });
        // Pair-major q, k, v ([p][N][dh]), logits ([p][N][3]), dyh = dy W_O^T.
        Buf Qb(static_cast<std::size_t>(P * N * dh)), Kb(Qb.size()), Vb(Qb.size()),
            DYb(Qb.size()), Yb(Qb.size());
        Buf dQb = zeros(Qb.size()), dKb = zeros(Qb.size()), dVb = zeros(Qb.size());
        Buf LGb(static_cast<std::size_t>(P * N * 3)), dLGb = zeros(LGb.size());
        Buf dyhb(static_cast<std::size_t>(M * D));
        mm(cx, false, true, M, D, d, T(1), dyv.data, dyv.stride, 0, prm.w_o.data(), d, 0, T(0),
           dyhb.data(), D, 0, 1);
        {
            T* Q = Qb.data();
            T* Kp = Kb.data();
            T* V = Vb.data();
            T* DY = DYb.data();
            const T* dyh = dyhb.data();
            cuda::each(sm, P * N * dh, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(N * dh), t = (i / cuda::u32(dh)) % cuda::u32(N),
                                j = i % cuda::u32(dh), s = p / H, h = p % H, r = s * N + t;
                Q[i] = qkv[r * C3 + h * dh + j];
                Kp[i] = qkv[r * C3 + D + h * dh + j];
                V[i] = qkv[r * C3 + 2 * D + h * dh + j];
                DY[i] = dyh[r * D + h * dh + j];
            });
            if (gated) {
                const T* lg = tr.logits.data();
                T* LG = LGb.data();
                cuda::each(sm, P * N * 3, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(N * 3), t = (i / 3) % cuda::u32(N),
                                    w = i % 3, s = p / H, h = p % H;
                    LG[i] = lg[(s * N + t) * G3 + w * H + h];
                });
            }
        }
        // 2. The reverse sweep. Per layer l: in_l x out_l matrices, P of them.
        std::vector<long long> lin(static_cast<std::size_t>(L)), lout(lin.size()), lio(lin.size());
        long long wd = dh;
        for (int l = 0; l < L; ++l) {
            lin[static_cast<std::size_t>(l)] = cfg.layer_in(l + 1);
            lout[static_cast<std::size_t>(l)] = cfg.layer_out(l + 1);
            lio[static_cast<std::size_t>(l)] = lin[static_cast<std::size_t>(l)] * lout[static_cast<std::size_t>(l)];
            wd = std::max({wd, lin[static_cast<std::size_t>(l)], lout[static_cast<std::size_t>(l)]});
        }
        const auto Ls = static_cast<std::size_t>(L);
        std::vector<Buf> dW(Ls), dS(Ls), dWn(Ls), dSn(Ls);
        std::vector<Buf> ta(Ls), tz(Ls), td1(Ls), tdelta(Ls), tback(Ls), tabar(Ls), tdbar(Ls), tzbar(Ls);
        std::vector<Buf> hin(Ls + 1), zr(Ls), p1(Ls), p2(Ls), sc(Ls);
        const long long BW = b * wd;
        for (std::size_t l = 0; l < Ls; ++l) {
            const auto io = static_cast<std::size_t>(P * lio[l]);
            dW[l] = zeros(io);
            dS[l] = zeros(io);
            dWn[l] = zeros(io);
            dSn[l] = zeros(io);
            for (std::vector<Buf>* v : {&ta, &tz, &td1, &tdelta, &tback, &tabar, &tdbar, &tzbar,
                                        &zr, &p1, &p2}) {
                (*v)[l] = zeros(static_cast<std::size_t>(P * BW));
            }
            sc[l] = zeros(static_cast<std::size_t>(P * b * b));
        }
        for (auto& hb : hin) hb = zeros(static_cast<std::size_t>(P * BW));
        Buf tmpb = zeros(static_cast<std::size_t>(P * BW)), dHb = zeros(tmpb.size()),
            scaledb = zeros(tmpb.size()), AWb = zeros(tmpb.size()), ASb = zeros(tmpb.size()),
            bbarb = zeros(tmpb.size()), dMb = zeros(static_cast<std::size_t>(P * b * b));
        const Vec vo{b};
        const long long VS = vo.size();
        Buf vecb = zeros(static_cast<std::size_t>(P * VS));
        T* vec = vecb.data();
        const bool given = d_out != nullptr && !d_out->empty();
        if (given) {
            for (long long p = 0; p < P; ++p) {
                for (std::size_t l = 0; l < Ls; ++l) {
                    upload_to(dWn[l].data() + p * lio[l], d_out->weights[static_cast<std::size_t>(p)][l]);
                    upload_to(dSn[l].data() + p * lio[l], d_out->momentum[static_cast<std::size_t>(p)][l]);
                }
            }
        }
        for (long long ch = tr.chunks - 1; ch >= 0; --ch) {
            const long long c0 = ch * b, n = std::min(b, N - c0);
            const bool end = c0 + n < N || given;
            std::vector<const T*> Wl(Ls), Sl(Ls);
            for (std::size_t l = 0; l < Ls; ++l) {
                Wl[l] = tr.memory[static_cast<std::size_t>(ch) * 2 * Ls + l].data();
                Sl[l] = tr.memory[static_cast<std::size_t>(ch) * 2 * Ls + Ls + l].data();
                cuda::check(cudaMemsetAsync(dW[l].data(), 0, dW[l].size() * sizeof(T), sm), "cudaMemsetAsync");
                cuda::check(cudaMemsetAsync(dS[l].data(), 0, dS[l].size() * sizeof(T), sm), "cudaMemsetAsync");
            }
            // The key tape (a, z, d1, delta, back; abar, dbar zero).
            {
                const T* Kp = Kb.data() + c0 * dh;
                T* a0 = ta[0].data();
                cuda::each(sm, P * n * dh, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh);
                    a0[p * BW + rc] = Kp[p * N * dh + rc];
                });
            }
            for (std::size_t l = 0; l < Ls; ++l) {
                const long long in = lin[l], out = lout[l];
                mm(cx, false, false, n, out, in, T(1), ta[l].data(), in, BW, Wl[l], out, lio[l],
                   T(0), tz[l].data(), out, BW, P);
                if (l + 1 < Ls) {
                    const T* z = tz[l].data();
                    T* an = ta[l + 1].data();
                    T* d1 = td1[l].data();
                    cuda::each(sm, P * n * out, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n * out), rc = i % cuda::u32(n * out);
                        an[p * BW + rc] = detail::activate(act, z[p * BW + rc]);
                        d1[p * BW + rc] = detail::activate_grad(act, z[p * BW + rc]);
                    });
                }
            }
            {
                const T* z = tz[Ls - 1].data();
                const T* Kp = Kb.data() + c0 * dh;
                const T* V = Vb.data() + c0 * dh;
                T* dl = tdelta[Ls - 1].data();
                cuda::each(sm, P * n * dh, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh);
                    T e = z[p * BW + rc] - V[p * N * dh + rc];
                    if (residual) e += Kp[p * N * dh + rc];
                    dl[p * BW + rc] = e;
                });
            }
            for (std::size_t l = Ls - 1; l > 0; --l) {
                const long long in = lin[l], out = lout[l];
                mm(cx, false, true, n, in, out, T(1), tdelta[l].data(), out, BW, Wl[l], out, lio[l],
                   T(0), tback[l].data(), in, BW, P);
                const T* bk = tback[l].data();
                const T* d1 = td1[l - 1].data();
                T* dl = tdelta[l - 1].data();
                cuda::each(sm, P * n * in, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * in), rc = i % cuda::u32(n * in);
                    dl[p * BW + rc] = bk[p * BW + rc] * d1[p * BW + rc];
                });
            }
            for (std::size_t l = 0; l < Ls; ++l) {
                cuda::check(cudaMemsetAsync(tabar[l].data(), 0, tabar[l].size() * sizeof(T), sm), "cudaMemsetAsync");
                cuda::check(cudaMemsetAsync(tdbar[l].data(), 0, tdbar[l].size() * sizeof(T), sm), "cudaMemsetAsync");
            }
            cuda::check(cudaMemsetAsync(vec, 0, vecb.size() * sizeof(T), sm), "cudaMemsetAsync");
            // Gates with clipping.
            typename Kernels::Layers ly{};
            ly.depth = L;
            for (int l = 0; l < L; ++l) {
                ly.a[l] = ta[static_cast<std::size_t>(l)].data();
                ly.d[l] = tdelta[static_cast<std::size_t>(l)].data();
                ly.in[l] = static_cast<int>(lin[static_cast<std::size_t>(l)]);
                ly.out[l] = static_cast<int>(lout[static_cast<std::size_t>(l)]);
            }
            {
                const T* LG = LGb.data() + c0 * 3;
                cuda::each(sm, P * n, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n), r = i % cuda::u32(n);
                    T* v = vec + p * VS;
                    const T* lg = LG + p * N * 3;
                    T th, et, al;
                    if (gmode == GateMode::Constant) {
                        th = ct;
                        et = ce;
                        al = ca;
                    } else if (gmode == GateMode::PerChunk) {
                        T m0 = T(0), m1 = T(0), m2 = T(0);
                        for (long long q = 0; q < n; ++q) {
                            m0 += lg[q * 3];
                            m1 += lg[q * 3 + 1];
                            m2 += lg[q * 3 + 2];
                        }
                        th = tmax * detail::sigmoid(m0 / static_cast<T>(n));
                        et = detail::sigmoid(m1 / static_cast<T>(n));
                        al = detail::sigmoid(m2 / static_cast<T>(n));
                    } else {
                        th = tmax * detail::sigmoid(lg[r * 3]);
                        et = detail::sigmoid(lg[r * 3 + 1]);
                        al = detail::sigmoid(lg[r * 3 + 2]);
                    }
                    T g2 = T(0);
                    for (int l = 0; l < ly.depth; ++l) {
                        T sa = T(0), sd = T(0);
                        for (int c = 0; c < ly.in[l]; ++c) {
                            const T a = ly.a[l][p * BW + r * ly.in[l] + c];
                            sa += a * a;
                        }
                        for (int c = 0; c < ly.out[l]; ++c) {
                            const T e = ly.d[l][p * BW + r * ly.out[l] + c];
                            sd += e * e;
                        }
                        g2 += sa * sd;
                    }
                    v[vo.theta0() + r] = th;
                    v[vo.eta() + r] = et;
                    v[vo.alpha() + r] = al;
                    v[vo.g2() + r] = g2;
                    const T f = !(clipping && g2 > clip * clip) ? T(1)
                                : g2 <= detail::largest_finite<T>()
                                    ? clip / sqrt(g2)
                                    : detail::scaled_grad_norm<T>(ly.depth, [&](int l) {
                                          return detail::GradRows<T>{
                                              ly.a[l] + p * BW + r * ly.in[l], ly.in[l],
                                              ly.d[l] + p * BW + r * ly.out[l], ly.out[l]};
                                      }).clip_factor(clip);
                    v[vo.theta() + r] = clipping && g2 > clip * clip ? th * f : th;
                });
            }
            // The read, recomputed and reversed.
            {
                const T* Q = Qb.data() + c0 * dh;
                T* h0 = hin[0].data();
                T* tm = tmpb.data();
                const T* DY = DYb.data() + c0 * dh;
                cuda::each(sm, P * n * dh, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh);
                    h0[p * BW + rc] = Q[p * N * dh + rc];
                    tm[p * BW + rc] = DY[p * N * dh + rc];
                });
            }
            if (inchunk) {
                cuda::each(sm, P, [=] __device__(unsigned p) {
                    T* v = vec + p * VS;
                    chunk_row_coefficients<T>(static_cast<int>(n), 0, v + vo.theta(), v + vo.eta(),
                                              v + vo.alpha(), v + vo.beta(), v + vo.c(), v + vo.G());
                });
            }
            for (std::size_t l = 0; l < Ls; ++l) {
                const long long in = lin[l], out = lout[l];
                T* z = zr[l].data();
                mm(cx, false, false, n, out, in, T(1), hin[l].data(), in, BW, Wl[l], out, lio[l],
                   T(0), z, out, BW, P);
                if (inchunk) {
                    T* q1 = p1[l].data();
                    T* q2 = p2[l].data();
                    T* s2 = sc[l].data();
                    cuda::check(cudaMemcpyAsync(q1, z, static_cast<std::size_t>(P * BW) * sizeof(T),
                                                cudaMemcpyDeviceToDevice, sm), "cudaMemcpyAsync");
                    mm(cx, false, false, n, out, in, T(1), hin[l].data(), in, BW, Sl[l], out, lio[l],
                       T(0), q2, out, BW, P);
                    mm(cx, false, true, n, n, in, T(1), hin[l].data(), in, BW, ta[l].data(), in, BW,
                       T(0), s2, n, b * b, P);
                    T* dM = dMb.data();
                    const long long bb = b * b;
                    cuda::each(sm, P * n * n, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n * n), rc = i % cuda::u32(n * n);
                        dM[p * bb + rc] = vec[p * VS + vo.G() + rc] * s2[p * bb + rc];
                    });
                    cuda::each(sm, P * n * out, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n * out), r = (i / cuda::u32(out)) % cuda::u32(n),
                                        rc = i % cuda::u32(n * out);
                        const T* v = vec + p * VS;
                        z[p * BW + rc] = v[vo.beta() + r] * q1[p * BW + rc] + v[vo.c() + r] * q2[p * BW + rc];
                    });
                    mm(cx, false, false, n, out, n, T(-1), dM, n, bb, tdelta[l].data(), out, BW,
                       T(1), z, out, BW, P);
                }
                if (l + 1 < Ls) {
                    T* hn = hin[l + 1].data();
                    cuda::each(sm, P * n * out, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n * out), rc = i % cuda::u32(n * out);
                        hn[p * BW + rc] = detail::activate(act, z[p * BW + rc]);
                    });
                }
            }
            {
                const T* z = zr[Ls - 1].data();
                T* Y = Yb.data() + c0 * dh;
                const T* Q = Qb.data() + c0 * dh;
                cuda::each(sm, P * n * dh, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh);
                    Y[p * N * dh + rc] = z[p * BW + rc] + (residual ? Q[p * N * dh + rc] : T(0));
                });
            }
            for (std::size_t l = Ls; l-- > 0;) {
                const long long in = lin[l], out = lout[l];
                T* tm = tmpb.data();
                if (!inchunk) {
                    mm(cx, true, false, in, out, n, T(1), hin[l].data(), in, BW, tm, out, BW, T(1),
                       dW[l].data(), out, lio[l], P);
                    mm(cx, false, true, n, in, out, T(1), tm, out, BW, Wl[l], out, lio[l], T(0),
                       dHb.data(), in, BW, P);
                } else {
                    const T* q1 = p1[l].data();
                    const T* q2 = p2[l].data();
                    cuda::each(sm, P * n, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n), r = i % cuda::u32(n);
                        T s1 = T(0), s2 = T(0);
                        for (long long c = 0; c < out; ++c) {
                            s1 += tm[p * BW + r * out + c] * q1[p * BW + r * out + c];
                            s2 += tm[p * BW + r * out + c] * q2[p * BW + r * out + c];
                        }
                        vec[p * VS + vo.dbeta() + r] += s1;
                        vec[p * VS + vo.dc() + r] += s2;
                    });
                    T* scd = scaledb.data();
                    for (int which = 0; which < 2; ++which) {
                        const long long off = which == 0 ? vo.beta() : vo.c();
                        cuda::each(sm, P * n * out, [=] __device__(unsigned i) {
                            const long long p = i / cuda::u32(n * out), r = (i / cuda::u32(out)) % cuda::u32(n),
                                            rc = i % cuda::u32(n * out);
                            scd[p * BW + rc] = vec[p * VS + off + r] * tm[p * BW + rc];
                        });
                        mm(cx, true, false, in, out, n, T(1), hin[l].data(), in, BW, scd, out, BW,
                           T(1), (which == 0 ? dW[l] : dS[l]).data(), out, lio[l], P);
                        mm(cx, false, true, n, in, out, T(1), scd, out, BW, which == 0 ? Wl[l] : Sl[l],
                           out, lio[l], which == 0 ? T(0) : T(1), dHb.data(), in, BW, P);
                    }
                    const long long bb = b * b;
                    T* Mx = dMb.data();
                    const T* s2 = sc[l].data();
                    cuda::each(sm, P * n * n, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n * n), rc = i % cuda::u32(n * n);
                        Mx[p * bb + rc] = vec[p * VS + vo.G() + rc] * s2[p * bb + rc];
                    });
                    mm(cx, true, false, n, out, n, T(-1), Mx, n, bb, tm, out, BW, T(1),
                       tdbar[l].data(), out, BW, P);
                    // dM = -dZ Delta^T (reuse Mx), dG += dM . sc, dsc = dM . G (in Mx).
                    mm(cx, false, true, n, n, out, T(-1), tm, out, BW, tdelta[l].data(), out, BW,
                       T(0), Mx, n, bb, P);
                    cuda::each(sm, P * n * n, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n * n), rc = i % cuda::u32(n * n);
                        T* v = vec + p * VS;
                        v[vo.dG() + rc] += Mx[p * bb + rc] * s2[p * bb + rc];
                        Mx[p * bb + rc] *= v[vo.G() + rc];
                    });
                    mm(cx, false, false, n, in, n, T(1), Mx, n, bb, ta[l].data(), in, BW, T(1),
                       dHb.data(), in, BW, P);
                    mm(cx, true, false, n, in, n, T(1), Mx, n, bb, hin[l].data(), in, BW, T(1),
                       tabar[l].data(), in, BW, P);
                }
                if (l > 0) {
                    const T* zp = zr[l - 1].data();
                    const T* dH = dHb.data();
                    cuda::each(sm, P * n * in, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n * in), rc = i % cuda::u32(n * in);
                        tm[p * BW + rc] = detail::activate_grad(act, zp[p * BW + rc]) * dH[p * BW + rc];
                    });
                }
            }
            {
                const T* dH = dHb.data();
                T* dQ = dQb.data() + c0 * dh;
                const T* DY = DYb.data() + c0 * dh;
                cuda::each(sm, P * n * dh, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh);
                    dQ[p * N * dh + rc] += dH[p * BW + rc] + (residual ? DY[p * N * dh + rc] : T(0));
                });
            }
            // The chunk end, reversed.
            T* ends = nullptr;
            if (end) {
                cuda::each(sm, P, [=] __device__(unsigned p) {
                    T* v = vec + p * VS;
                    chunk_end_coefficients<T>(static_cast<int>(n), v + vo.theta(), v + vo.eta(),
                                              v + vo.alpha(), v + vo.g(), v + vo.s(),
                                              v + vo.ends(), v + vo.ends() + 1, v + vo.ends() + 2);
                });
                for (std::size_t l = 0; l < Ls; ++l) {
                    const long long in = lin[l], out = lout[l], io = lio[l];
                    const T* Wp = Wl[l];
                    const T* Sp = Sl[l];
                    const T* dwn = dWn[l].data();
                    const T* dsn = dSn[l].data();
                    T* dw = dW[l].data();
                    T* ds = dS[l].data();
                    cuda::each(sm, P * io, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(io);
                        const T* v = vec + p * VS + vo.ends();
                        dw[i] += v[0] * dwn[i];
                        ds[i] += v[1] * dwn[i] + v[2] * dsn[i];
                    });
                    cuda::launch(cuda::pair_dots_kernel<T>, cuda::warp_blocks(P), 256, sm, dwn,
                                 dsn, Wp, Sp, io, P, vec + vo.ends() + 3, VS);
                    cuda::check_launch("the chunk end's sums");
                    T* AW = AWb.data();
                    T* AS = ASb.data();
                    mm(cx, false, false, n, out, in, T(1), ta[l].data(), in, BW, dwn, out, io, T(0),
                       AW, out, BW, P);
                    mm(cx, false, false, n, out, in, T(1), ta[l].data(), in, BW, dsn, out, io, T(0),
                       AS, out, BW, P);
                    const T* Dl = tdelta[l].data();
                    T* dbar = tdbar[l].data();
                    cuda::launch(cuda::end_rows_kernel<T>, cuda::warp_blocks(P * n), 256, sm, AW,
                                 AS, Dl, dbar, vec, VS, vo.g(), vo.s(), vo.dg(), vo.ds(), P, n,
                                 out, BW);
                    cuda::check_launch("the chunk end's row terms");
                    mm(cx, false, true, n, in, out, T(1), Dl, out, BW, dwn, out, io, T(0), AW, in, BW, P);
                    mm(cx, false, true, n, in, out, T(1), Dl, out, BW, dsn, out, io, T(0), AS, in, BW, P);
                    T* abar = tabar[l].data();
                    cuda::each(sm, P * n * in, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n * in), r = (i / cuda::u32(in)) % cuda::u32(n),
                                        rc = i % cuda::u32(n * in);
                        const T* v = vec + p * VS;
                        abar[p * BW + rc] -= v[vo.g() + r] * AW[p * BW + rc];
                        abar[p * BW + rc] -= v[vo.s() + r] * AS[p * BW + rc];
                    });
                }
                ends = vec;
            }
            // The coefficients, clipping, the key pass, the gates.
            cuda::each(sm, P, [=] __device__(unsigned p) {
                T* v = vec + p * VS;
                const int nn = static_cast<int>(n);
                if (end) {
                    v[vo.dbeta() + nn - 1] += v[vo.ends() + 3];
                    v[vo.dc() + nn - 1] += v[vo.ends() + 4];
                }
                chunk_coefficients_backward<T>(nn, v + vo.theta(), v + vo.eta(), v + vo.alpha(),
                                               v + vo.dbeta(), v + vo.dc(),
                                               inchunk ? v + vo.dG() : nullptr,
                                               end ? v + vo.dg() : nullptr,
                                               end ? v + vo.ds() : nullptr,
                                               end ? v[vo.ends() + 5] : T(0), v + vo.dtheta(),
                                               v + vo.deta(), v + vo.dalpha(), v + vo.scratch());
            });
            (void)ends;
            if (clipping) {
                Adjoints lb{};
                for (int l = 0; l < L; ++l) {
                    lb.a[l] = tabar[static_cast<std::size_t>(l)].data();
                    lb.d[l] = tdbar[static_cast<std::size_t>(l)].data();
                }
                cuda::each(sm, P * n, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n), r = i % cuda::u32(n);
                    T* v = vec + p * VS;
                    const T g2 = v[vo.g2() + r];
                    if (!(g2 > clip * clip)) return;
                    if (!(g2 <= detail::largest_finite<T>())) {  // g2 overflowed: scaled
                        const detail::GradNorm<T> g =
                            detail::scaled_grad_norm<T>(ly.depth, [&](int l) {
                                return detail::GradRows<T>{
                                    ly.a[l] + p * BW + r * ly.in[l], ly.in[l],
                                    ly.d[l] + p * BW + r * ly.out[l], ly.out[l]};
                            });
                        const T fs = g.clip_factor(clip);
                        const T scale = -v[vo.dtheta() + r] * v[vo.theta0() + r] * fs;
                        v[vo.dtheta() + r] *= fs;
                        for (int l = 0; l < ly.depth; ++l) {
                            const T* a = ly.a[l] + p * BW + r * ly.in[l];
                            const T* e = ly.d[l] + p * BW + r * ly.out[l];
                            const T ra = g.ratio(a, ly.in[l]), rd = g.ratio(e, ly.out[l]);
                            for (int c = 0; c < ly.in[l]; ++c) {
                                lb.a[l][p * BW + r * ly.in[l] + c] += (scale * rd) * (rd * a[c]);
                            }
                            for (int c = 0; c < ly.out[l]; ++c) {
                                lb.d[l][p * BW + r * ly.out[l] + c] += (scale * ra) * (ra * e[c]);
                            }
                        }
                        return;
                    }
                    const T f = clip / sqrt(g2);
                    const T dg2 = T(-0.5) * v[vo.dtheta() + r] * v[vo.theta0() + r] * f / g2;
                    v[vo.dtheta() + r] *= f;
                    for (int l = 0; l < ly.depth; ++l) {
                        T na = T(0), nd = T(0);
                        for (int c = 0; c < ly.in[l]; ++c) {
                            const T a = ly.a[l][p * BW + r * ly.in[l] + c];
                            na += a * a;
                        }
                        for (int c = 0; c < ly.out[l]; ++c) {
                            const T e = ly.d[l][p * BW + r * ly.out[l] + c];
                            nd += e * e;
                        }
                        for (int c = 0; c < ly.in[l]; ++c) {
                            lb.a[l][p * BW + r * ly.in[l] + c] += (T(2) * dg2 * nd) * ly.a[l][p * BW + r * ly.in[l] + c];
                        }
                        for (int c = 0; c < ly.out[l]; ++c) {
                            lb.d[l][p * BW + r * ly.out[l] + c] += (T(2) * dg2 * na) * ly.d[l][p * BW + r * ly.out[l] + c];
                        }
                    }
                });
            }
            // detail::KeyTape::backward.
            for (std::size_t l = 0; l < Ls; ++l) {
                cuda::check(cudaMemsetAsync(tzbar[l].data(), 0, tzbar[l].size() * sizeof(T), sm), "cudaMemsetAsync");
            }
            for (std::size_t l = 1; l < Ls; ++l) {
                const long long in = lin[l], out = lout[l];  // delta[l-1] is n x in
                const T* db = tdbar[l - 1].data();
                const T* d1 = td1[l - 1].data();
                const T* bk = tback[l].data();
                const T* zp = tz[l - 1].data();
                T* zb = tzbar[l - 1].data();
                T* bb = bbarb.data();
                cuda::each(sm, P * n * in, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * in), e = p * BW + i % cuda::u32(n * in);
                    bb[e] = db[e] * d1[e];
                    zb[e] += db[e] * bk[e] * detail::activate_grad2(act, zp[e]);
                });
                mm(cx, false, false, n, out, in, T(1), bb, in, BW, Wl[l], out, lio[l], T(1),
                   tdbar[l].data(), out, BW, P);
                mm(cx, true, false, in, out, n, T(1), bb, in, BW, tdelta[l].data(), out, BW, T(1),
                   dW[l].data(), out, lio[l], P);
            }
            {
                const T* db = tdbar[Ls - 1].data();
                T* zb = tzbar[Ls - 1].data();
                T* dV = dVb.data() + c0 * dh;
                T* dK = dKb.data() + c0 * dh;
                cuda::each(sm, P * n * dh, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh), e = p * BW + rc;
                    zb[e] += db[e];
                    dV[p * N * dh + rc] -= db[e];
                    if (residual) dK[p * N * dh + rc] += db[e];
                });
            }
            for (std::size_t l = Ls; l-- > 0;) {
                const long long in = lin[l], out = lout[l];
                T* zb = tzbar[l].data();
                if (l + 1 < Ls) {
                    const T* ab = tabar[l + 1].data();
                    const T* d1 = td1[l].data();
                    cuda::each(sm, P * n * out, [=] __device__(unsigned i) {
                        const long long p = i / cuda::u32(n * out), e = p * BW + i % cuda::u32(n * out);
                        zb[e] += ab[e] * d1[e];
                    });
                }
                mm(cx, true, false, in, out, n, T(1), ta[l].data(), in, BW, zb, out, BW, T(1),
                   dW[l].data(), out, lio[l], P);
                mm(cx, false, true, n, in, out, T(1), zb, out, BW, Wl[l], out, lio[l], T(1),
                   tabar[l].data(), in, BW, P);
            }
            {
                const T* ab = tabar[0].data();
                T* dK = dKb.data() + c0 * dh;
                cuda::each(sm, P * n * dh, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh);
                    dK[p * N * dh + rc] += ab[p * BW + rc];
                });
            }
            if (gated) {
                const T* LG = LGb.data() + c0 * 3;
                T* dLG = dLGb.data() + c0 * 3;
                cuda::each(sm, P * 3, [=] __device__(unsigned i) {
                    const long long p = i / 3, which = i % 3;
                    const T* v = vec + p * VS;
                    const T* adj = v + (which == 0 ? vo.dtheta() : which == 1 ? vo.deta() : vo.dalpha());
                    const T scale = which == 0 ? tmax : T(1);
                    const T* lg = LG + p * N * 3;
                    T* dl = dLG + p * N * 3;
                    if (gmode == GateMode::PerChunk) {
                        T m = T(0), dd = T(0);
                        for (long long r = 0; r < n; ++r) {
                            m += lg[r * 3 + which];
                            dd += adj[r];
                        }
                        m /= static_cast<T>(n);
                        const T sg = detail::sigmoid(m);
                        const T dl0 = dd * scale * (sg * (T(1) - sg)) / static_cast<T>(n);
                        for (long long r = 0; r < n; ++r) dl[r * 3 + which] += dl0;
                    } else {
                        for (long long r = 0; r < n; ++r) {
                            const T sg = detail::sigmoid(lg[r * 3 + which]);
                            dl[r * 3 + which] += adj[r] * scale * (sg * (T(1) - sg));
                        }
                    }
                });
            }
            std::swap(dW, dWn);
            std::swap(dS, dSn);
        }
        // 3. The projections reversed: dqkv (row-major), norm and phi, the conv, dx, gradients.
        Buf dqb(static_cast<std::size_t>(M * C3)), dub(static_cast<std::size_t>(M * C3)),
            dlgb = zeros(static_cast<std::size_t>(gated ? M * G3 : 0)), yhb(static_cast<std::size_t>(M * D));
        T* dq = dqb.data();
        T* du = dub.data();
        {
            const T* dQ = dQb.data();
            const T* dK = dKb.data();
            const T* dV = dVb.data();
            const T* Y = Yb.data();
            T* yh = yhb.data();
            cuda::each(sm, M * D, [=] __device__(unsigned i) {
                const long long r = i / cuda::u32(D), c = i % cuda::u32(D), s = r / N, t = r % N,
                                h = c / dh, j = c % dh, e = ((s * H + h) * N + t) * dh + j;
                dq[r * C3 + c] = dQ[e];
                dq[r * C3 + D + c] = dK[e];
                dq[r * C3 + 2 * D + c] = dV[e];
                yh[i] = Y[e];
            });
            cuda::each(sm, M * 2 * H, [=] __device__(unsigned i) {
                const long long r = i / cuda::u32(2 * H), h = i % cuda::u32(2 * H);
                T* dd = dq + r * C3 + h * dh;
                if (norm) {
                    const T* y = qkv + r * C3 + h * dh;
                    const T n0 = nrm[2 * i];
                    const int e = static_cast<int>(nrm[2 * i + 1]);
                    if (e > 0 || n0 > T(1e-12)) {
                        T dot = T(0);
                        for (long long j = 0; j < dh; ++j) dot += y[j] * dd[j];
                        for (long long j = 0; j < dh; ++j) {
                            dd[j] = detail::scale_down(dd[j] - dot * y[j], e) / n0;
                        }
                    } else {
                        for (long long j = 0; j < dh; ++j) dd[j] /= T(1e-12);
                    }
                }
            });
            cuda::each(sm, M * C3, [=] __device__(unsigned i) {
                if (silu) dq[i] *= detail::silu_grad(cc[i]);
            });
            cuda::each(sm, M * C3, [=] __device__(unsigned i) {
                const long long r = i / cuda::u32(C3), j = i % cuda::u32(C3), t = r % N;
                if (!conv) {
                    du[i] = dq[i];
                    return;
                }
                T v = taps[(K - 1) * C3 + j] * dq[i];
                for (long long q = 0; q < K - 1; ++q) {
                    const long long at = t + K - 1 - q;
                    if (at < N) v += taps[q * C3 + j] * dq[(r - t + at) * C3 + j];
                }
                du[i] = v;
            });
        }
        std::vector<Mat> dtail_out;
        if (given) dtail_out = d_out->conv_tail;
        if (given && conv && K1 > 0) {
            cx.synchronize();
            for (int s = 0; s < B; ++s) {
                for (long long i = 0; i < K1; ++i) {
                    const long long t = N + i - K1;
                    if (t >= 0) {
                        Mat row = download_mat(du + (s * N + t) * C3, 1, C3);
                        row += dtail_out[static_cast<std::size_t>(s)].row(i);
                        upload_to(du + (s * N + t) * C3, row);
                    }
                }
            }
        }
        if (gated) {
            const T* dLG = dLGb.data();
            T* dl = dlgb.data();
            cuda::each(sm, M * G3, [=] __device__(unsigned i) {
                const long long r = i / cuda::u32(G3), c = i % cuda::u32(G3), s = r / N, t = r % N,
                                w = c / H, h = c % H;
                dl[i] = dLG[((s * H + h) * N + t) * 3 + w];
            });
        }
        mm(cx, false, true, M, d, C3, T(1), du, C3, 0, prm.w_qkv.data(), C3, 0, T(0), dxv.data,
           dxv.stride, 0, 1);
        if (gated) {
            mm(cx, false, true, M, d, G3, T(1), dlgb.data(), G3, 0, prm.w_gates.data(), G3, 0,
               T(1), dxv.data, dxv.stride, 0, 1);
        }
        // Parameter gradients.
        Buf gq(static_cast<std::size_t>(d * C3)), gg(static_cast<std::size_t>(d * G3)),
            go(static_cast<std::size_t>(D * d)), gt(static_cast<std::size_t>(K * C3)),
            gb(static_cast<std::size_t>(G3));
        mm(cx, true, false, d, C3, M, T(1), x, d, 0, du, C3, 0, T(0), gq.data(), C3, 0, 1);
        mm(cx, true, false, D, d, M, T(1), yhb.data(), D, 0, dyv.data, dyv.stride, 0, T(0),
           go.data(), d, 0, 1);
        if (gated) {
            mm(cx, true, false, d, G3, M, T(1), x, d, 0, dlgb.data(), G3, 0, T(0), gg.data(), G3, 0, 1);
            const T* dl = dlgb.data();
            T* gbp = gb.data();
            cuda::each(sm, G3, [=] __device__(unsigned c) {
                T acc = T(0);
                for (long long r = 0; r < M; ++r) acc += dl[r * G3 + c];
                gbp[c] = acc;
            });
        }
        if (conv) {
            T* gtp = gt.data();
            const T* dc = dq;
            cuda::each(sm, K * C3, [=] __device__(unsigned i) {
                const long long j = i / cuda::u32(C3), col = i % cuda::u32(C3), lag = K - 1 - j;
                T acc = T(0);
                for (long long s = 0; s < B; ++s) {
                    for (long long t = lag; t < N; ++t) acc += dc[(s * N + t) * C3 + col] * u[(s * N + t - lag) * C3 + col];
                    for (long long t = 0; t < (lag < N ? lag : N); ++t)
                        acc += dc[(s * N + t) * C3 + col] * tail[(s * K1 + t + j) * C3 + col];
                }
                gtp[i] = acc;
            });
        }
        // The tails' adjoint (d_in): through the conv, and passed through.
        Buf dtb = zeros(static_cast<std::size_t>(B * K1 * C3));
        if (d_in != nullptr && conv && K1 > 0) {
            T* dt = dtb.data();
            const T* dc = dq;
            cuda::each(sm, B * K1 * C3, [=] __device__(unsigned i) {
                const long long s = i / cuda::u32(K1 * C3), r = (i / cuda::u32(C3)) % cuda::u32(K1),
                                col = i % cuda::u32(C3);
                T acc = T(0);
                for (long long j = 0; j < K1; ++j) {
                    const long long at = r - j;
                    if (at >= 0 && at < N) acc += taps[j * C3 + col] * dc[(s * N + at) * C3 + col];
                }
                dt[i] = acc;
            });
        }
        cx.synchronize();
        // Downloads, added to g in the CPU's order.
        const Mat Gq = download_mat(gq.data(), d, C3);
        g.w_q += Gq.leftCols(D);
        g.w_k += Gq.middleCols(D, D);
        g.w_v += Gq.rightCols(D);
        if (N > 0) g.w_o += download_mat(go.data(), D, d);
        if (conv) {
            const Mat Gt = download_mat(gt.data(), K, C3);
            g.conv_q += Gt.leftCols(D);
            g.conv_k += Gt.middleCols(D, D);
            g.conv_v += Gt.rightCols(D);
        }
        if (gated) {
            const Mat Gg = download_mat(gg.data(), d, G3), Gb = download_mat(gb.data(), 1, G3);
            g.w_theta += Gg.leftCols(H);
            g.w_eta += Gg.middleCols(H, H);
            g.w_alpha += Gg.rightCols(H);
            g.b_theta += Gb.leftCols(H);
            g.b_eta += Gb.middleCols(H, H);
            g.b_alpha += Gb.rightCols(H);
        }
        std::vector<std::vector<Mat>> dw0(static_cast<std::size_t>(P)), ds0(dw0.size());
        for (long long p = 0; p < P; ++p) {
            for (std::size_t l = 0; l < Ls; ++l) {
                dw0[static_cast<std::size_t>(p)].push_back(download_mat(dWn[l].data() + p * lio[l], lin[l], lout[l]));
                ds0[static_cast<std::size_t>(p)].push_back(download_mat(dSn[l].data() + p * lio[l], lin[l], lout[l]));
            }
        }
        if (tr.start == 0 && N > 0) {
            for (long long p = 0; p < P; ++p) {
                auto& w0 = g.memory_init[static_cast<std::size_t>(p % H)];
                for (std::size_t l = 0; l < Ls; ++l) w0[l] += dw0[static_cast<std::size_t>(p)][l];
            }
        }
        if (d_in != nullptr) {
            d_in->weights = std::move(dw0);
            d_in->momentum = std::move(ds0);
            d_in->conv_tail.clear();
            const long long rows = K1;
            for (int s = 0; s < B; ++s) {
                Mat m = Mat::Zero(rows, C3);
                if (conv && K1 > 0) m = download_mat(dtb.data() + s * K1 * C3, K1, C3);
                if (!dtail_out.empty() && rows > 0) {
                    for (long long i = 0; i + N < rows; ++i) m.row(N + i) += dtail_out[static_cast<std::size_t>(s)].row(i);
                }
                d_in->conv_tail.push_back(std::move(m));
            }
        }
    }
};

}  // namespace titans::backend
