#pragma once
// titans/backend/cuda/memory_training.cuh: the neural memory's training pass on CUDA (math §9),
// giving the CPU's results (cpu/memory_training.hpp), every update, retrieval and gate mode.
//
// forward runs Kernels::forward a chunk at a time (from a chunk boundary; one transaction over
// the call, so an error leaves the state as it was; the pieces' finiteness checks deferred to
// one wait at the call's end, and run again strictly only if one failed), or, where the
// one-block fused kernel runs the chunks (memory_fused.cuh), every full chunk of a piece in one
// forward whose kernel copies each chunk's start memory into the trace as it loads it, keeping in device
// memory what the CPU's Trace keeps: the input, the incoming conv tails, the pre-conv products u = x [W_Q | W_K |
// W_V], the gate logits (bias added) and the memory (W, S) at every chunk start, laid out as
// the state's (per layer, pairs contiguous) so that it feeds batched GEMMs as is.
//
// backward, all pairs at once, chunks last first (deterministic, no atomics):
//   1. the projections' stages recomputed from u and the tails (conv, phi, norms), q, k, v and
//      the logits pair-major; dyh = dy W_O^T.
//   2. per chunk, from its start memory: the key pass with its intermediates (batched GEMMs),
//      gates with clipping, the read recomputed and reversed (lagged, or the dual form with G
//      from chunk_row_coefficients), the chunk end reversed, the coefficients by the shared
//      TITANS_HOST_DEVICE chunk_coefficients_backward (a thread per pair on its vector in
//      shared memory, cuda::pair_local), clipping (a warp per row), the key
//      pass's second-order terms (detail::KeyTape::backward as batched GEMMs), the gates; the
//      start memory's adjoint carried to the chunk before.
//   3. the projections reversed (norm, phi, conv transposed, tails), dx and the gradients.
// Each stage is a function of MemoryTraining<Cuda, T>::Sweep (memory_sweep.cuh), which also
// runs in stages at any rows with taps of mid-stream reads (Reverse, the CPU's contract);
// forward_part fills a trace piece by piece and read_weights_backward reverses a read through
// given weights (memory_read_backward.cuh): the staged API MAC's training drives.

#include <cstdint>
#include <utility>
#include <vector>

#include "../../detail/activation.hpp"
#include "../../detail/norm_scale.hpp"
#include "../../detail/trace.hpp"
#include "../../error.hpp"
#include "../../memory/chunk_coefficients.hpp"
#include "../../memory/chunk_coefficients_backward.hpp"
#include "../../memory/state_gradient.hpp"
#include "../backend.hpp"
#include "blas.cuh"
#include "call_scope.cuh"
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
    /// The staged reverse MAC's training drives: Reverse, start, forward_part and
    /// read_weights_backward (host matrices in and out where the caller's glue is).
    static constexpr bool staged = true;
    /// A training trace may start mid-chunk (its pending rows kept), as the CPU's.
    static constexpr bool mid_chunk = true;
    using Kernels = MemoryKernels<Cuda, T>;
    using Buf = cuda::DeviceBuffer<T>;
    using Mat = Matrix<T>;
    using Index = Eigen::Index;

    using DeviceMatrix = cuda::DeviceMatrix<T>;

    /// What backward needs, in device memory (the CPU Trace's members, same meaning):
    /// x (B*N) x d; tail_in B x (K-1) x 3D; u (B*N) x 3D; logits (B*N) x 3H (Constant gates:
    /// none); memory[ch * 2L + l] the weights W_{l+1} and memory[ch * 2L + L + l] the momentum
    /// S_{l+1} at chunk ch's start (P x layer_in x layer_out, pair p = s H + h), chunks =
    /// ceil((offset + N) / b); a trace starting offset = start mod b tokens into a chunk keeps
    /// the state's pending arrays (per layer pend_a P x b x layer_in, pend_delta P x b x
    /// layer_out, pend_gates P x b x 3; rows [0, offset) of each pair used) and that chunk's
    /// start memory as chunk 0's.
    struct Trace {
        MemoryConfig cfg;
        DeviceMatrix x;
        int batch = 0;
        std::int64_t start = 0;
        int offset = 0;
        Buf tail_in, u, logits, pend_gates;
        std::vector<Buf> pend_a, pend_delta;
        std::vector<Buf> memory;
        long long chunks = 0;
        Index recorded = 0;          // rows per stream forward_part has recorded
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
        check_trace_part(tr.offset == tr.start % b, where, "start", tr.start,
                         detail::concat("a position ", tr.offset, " tokens into a chunk of ", b,
                                        " (the trace's offset)"));
        const long long P = B * H, pend = tr.offset > 0 ? P * b : 0;
        check_trace_part(static_cast<long long>(tr.pend_a.size()) == (pend > 0 ? L : 0) &&
                             tr.pend_delta.size() == tr.pend_a.size(),
                         where, "pend_a.size()", tr.pend_a.size(), "depth when offset > 0");
        for (std::size_t l = 0; l < tr.pend_a.size(); ++l) {
            const int li = static_cast<int>(l) + 1;
            size(tr.pend_a[l], pend * cfg.layer_in(li), "pend_a[l].size()");
            size(tr.pend_delta[l], pend * cfg.layer_out(li), "pend_delta[l].size()");
        }
        size(tr.pend_gates, gated * pend * 3, "pend_gates.size()");
        const long long chunks = (tr.offset + N + b - 1) / b;
        check_trace_part(tr.chunks == chunks, where, "chunks", tr.chunks,
                         detail::concat("ceil((offset + N) / chunk) = ", chunks));
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
        Trace t;
        start(cfg, st, x.rows / st.batch(), x.cols, t);
        forward_part(cfg, pp, st, x, y, t, diag);
        trace = std::move(t);
    }

    /// The next piece of a trace from start(): x, y (B*m) x d device views, sequence-major,
    /// run from st (the state start() saw, fed the trace's earlier pieces), recorded at the
    /// rows after them, split at chunk boundaries (the memory kept at each chunk's start).
    /// The trace is filled once its N rows are in. diag (optional, host): this piece's rows.
    /// On an error the state is as before and the trace's recorded rows are unchanged.
    static void forward_part(const MemoryConfig& cfg, const typename Kernels::Prepared& pp,
                             typename Kernels::State& st, View<const T> x, View<T> y, Trace& t,
                             Diagnostics<T>* diag = nullptr) {
        const int B = t.batch;
        const long long m = x.rows / B, t0 = st.position() - t.start;
        if (diag != nullptr) {
            diag->loss.setZero(x.rows, cfg.n_heads);
            diag->grad_norm.setZero(x.rows, cfg.n_heads);
        }
        const bool own = Kernels::begin(st);
        try {
            // Outside a call scope each chunk's forward would wait for its checks: with a
            // transaction of its own, the pieces run in one deferring scope instead (one wait
            // at its end); if its flag is raised they run again strictly from the state as it
            // was, where the first failing check throws at its place.
            bool strict = !own || cuda::deferring() || diag != nullptr;
            if (!strict) {
                strict = deferred_pieces(cfg, pp, st, x, y, t);
                if (strict) {
                    Kernels::rollback(st);
                    Kernels::begin(st);
                }
            }
            if (strict) {
                record_pieces(cfg, pp, st, x, y, t, diag);
            }
            cuda::idle(Kernels::ctx(st));
        } catch (...) {
            Kernels::rollback(st);
            throw;
        }
        if (own) {
            Kernels::commit(st);
        }
        t.recorded = t0 + m;
        t.filled = t0 + m == t.rows() / B;
    }

    /// record_pieces in a deferring CallScope: whether a check found a NaN or an infinity
    /// (the scope's flag, or a NonFiniteError). The scope's stream is idle on return.
    static bool deferred_pieces(const MemoryConfig& cfg, const typename Kernels::Prepared& pp,
                                typename Kernels::State& st, View<const T> x, View<T> y,
                                Trace& t) {
        const cuda::CallScope scope;
        bool raised = false;
        try {
            record_pieces(cfg, pp, st, x, y, t, nullptr);
        } catch (const NonFiniteError&) {
            raised = true;
        } catch (...) {
            try {
                cuda::settle_recorded();
            } catch (...) {  // the first error is the one to throw
            }
            (void)cudaStreamSynchronize(cuda::thread_context().stream());  // then the rollback
            throw;
        }
        return scope.flagged() || raised;  // flagged() waits for the scope's stream
    }

    /// forward_part's pieces: Kernels::forward_piece a chunk segment at a time, x's rows
    /// gathered, y's scattered, the trace's rows recorded (chunk starts, products). Where a
    /// fused kernel runs the chunks (one block a pair or clusters: Kernels::training_fusable;
    /// no diagnostics), a piece from a chunk start takes every full chunk left, and the kernel
    /// keeps their start memory as it loads it (Kernels::KeepChunks); a piece that is the
    /// whole part reads x and writes y in place.
    static void record_pieces(const MemoryConfig& cfg, const typename Kernels::Prepared& pp,
                              typename Kernels::State& st, View<const T> x, View<T> y, Trace& t,
                              Diagnostics<T>* diag) {
        const int B = t.batch;
        const long long N = t.rows() / B, m = x.rows / B, t0 = st.position() - t.start,
                        d = cfg.d_model, b = cfg.effective_chunk();
        const bool fusable = diag == nullptr && Kernels::training_fusable(cfg, st);
        const auto piece_rows = [&](long long q) {  // the piece from row q of the part
            const long long at = t.offset + q, left = t0 + m - q;
            return fusable && at % b == 0 && left >= b ? left / b * b : std::min(b - at % b, left);
        };
        long long most = 0;  // the longest piece that is not the whole part
        for (long long q = t0; q < t0 + m; q += piece_rows(q)) {
            most = piece_rows(q) < m ? std::max(most, piece_rows(q)) : most;
        }
        Buf xs(static_cast<std::size_t>(B * most * d)), ys(xs.size());
        Diagnostics<T> part;
        const cudaStream_t sm = Kernels::ctx(st).stream();
        for (long long q = t0; q < t0 + m;) {
            const long long at = t.offset + q;  // from the first chunk's start
            const long long len = piece_rows(q);
            const bool whole = len == m;
            typename Kernels::KeepChunks keep;
            if (fusable && at % b == 0 && len >= b) {  // len: whole chunks
                keep = keep_chunks(cfg, st, t, at / b, len / b);
            } else if (at % b == 0) {
                keep_chunk_start(cfg, st, t, at / b);
            }
            const ChunkRows piece{B, m, q - t0, len}, rows{B, N, q, len};
            const View<const T> xv = whole ? x : View<const T>{xs.data(), B * len, d, d};
            const View<T> yv = whole ? y : View<T>{ys.data(), B * len, d, d};
            if (!whole) {
                piece.gather(sm, x.data, x.stride, xs.data(), d);
            }
            rows.scatter(sm, xv.data, xv.stride, t.x.mem.data(), d, d, nullptr);
            if (diag != nullptr) {  // forward_piece writes into a sized one
                part.loss.setZero(B * len, cfg.n_heads);
                part.grad_norm.setZero(B * len, cfg.n_heads);
            }
            Kernels::forward_piece(cfg, *pp, st, xv, yv, diag != nullptr ? &part : nullptr,
                                   keep.at.empty() ? nullptr : &keep);
            if (4 * keep.kept != static_cast<long long>(keep.at.size())) {
                throw Error(detail::concat("MemoryTraining::forward: the fused kernel kept ",
                                           keep.kept, " chunk starts of ", keep.at.size() / 4,
                                           " (an internal error)"));
            }
            if (!whole) {
                piece.scatter(sm, ys.data(), d, y.data, y.stride, d, nullptr);
            }
            keep_products(cfg, pp, st, t, rows);
            if (diag != nullptr) {
                piece.place(part, *diag);
            }
            q += len;
        }
    }

    /// The trace's memory at chunks [ch, ch + n) allocated, for the fused kernel to fill as it
    /// runs them (depth 2: W1, W2, S1, S2 a chunk, the trace's order).
    static typename Kernels::KeepChunks keep_chunks(const MemoryConfig& cfg,
                                                    const typename Kernels::State& st, Trace& t,
                                                    long long ch, long long n) {
        typename Kernels::KeepChunks keep;
        const long long L = cfg.depth;
        for (long long c = ch; c < ch + n; ++c) {
            for (long long i = 0; i < 2 * L; ++i) {
                Buf& to = t.memory[static_cast<std::size_t>(c * 2 * L + i)];
                to = Buf((i < L ? st.w_ : st.s_)[static_cast<std::size_t>(i % L)].size());
                keep.at.push_back(to.data());
            }
        }
        return keep;
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
        /// The chunk's rows of to (row stride ld) <- from (B*m x cols, row stride from_ld),
        /// plus bias[c] per column when bias is given.
        void scatter(cudaStream_t sm, const T* from, long long from_ld, T* to, long long ld,
                     long long cols, const T* bias) const {
            const long long n = N, first = t0, rows = m;
            cuda::each(sm, B * m * cols, [=] __device__(unsigned i) {
                const long long r = i / cuda::u32(cols), c = i % cuda::u32(cols),
                                s = cuda::u32(r) / cuda::u32(rows), tt = cuda::u32(r) % cuda::u32(rows);
                const T x = from[r * from_ld + c];
                to[(s * n + first + tt) * ld + c] = bias != nullptr ? x + bias[c] : x;
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

    /// An empty trace for st's B sequences of N rows of width d from st, for forward_part to
    /// fill: the incoming tails (and, mid-chunk, the pending arrays and the chunk's start
    /// memory) copied, the input, products, logits and chunk-start memories allocated.
    static void start(const MemoryConfig& cfg, const typename Kernels::State& st, Index N,
                      Index d, Trace& t) {
        const int B = st.batch();
        const long long D = cfg.inner_dim(), H = cfg.n_heads, b = cfg.effective_chunk(),
                        K1 = cfg.use_conv ? cfg.conv_kernel - 1 : 0;
        t = Trace{};
        t.cfg = cfg;
        t.batch = B;
        t.start = st.position();
        t.x.r = B * N;
        t.x.c = d;
        t.x.mem = Buf(static_cast<std::size_t>(B * N * d));
        t.tail_in = Buf(static_cast<std::size_t>(B * K1 * 3 * D));
        if (K1 > 0) {
            Kernels::copy_into(t.tail_in, st.tail_, Kernels::ctx(st).stream());
        }
        t.u = Buf(static_cast<std::size_t>(B * N * 3 * D));
        const bool gated = cfg.gates != GateMode::Constant;
        t.logits = Buf(static_cast<std::size_t>(gated ? B * N * 3 * H : 0));
        t.offset = st.pending();
        t.chunks = (t.offset + N + b - 1) / b;
        t.memory.resize(static_cast<std::size_t>(t.chunks * 2 * cfg.depth));
        if (t.offset > 0) {
            const cudaStream_t sm = Kernels::ctx(st).stream();
            for (std::size_t l = 0; l < st.a_.size(); ++l) {
                t.pend_a.push_back(Buf(st.a_[l].size()));
                t.pend_delta.push_back(Buf(st.delta_[l].size()));
                Kernels::copy_into(t.pend_a.back(), st.a_[l], sm);
                Kernels::copy_into(t.pend_delta.back(), st.delta_[l], sm);
            }
            if (gated) {
                t.pend_gates = Buf(st.gates_.size());
                Kernels::copy_into(t.pend_gates, st.gates_, sm);
            }
            keep_chunk_start(cfg, st, t, 0);
        }
        t.filled = N == 0;
    }

    /// The memory (W, S of every layer) at chunk ch's start, from the state, into the trace.
    static void keep_chunk_start(const MemoryConfig& cfg, const typename Kernels::State& st,
                                 Trace& t, long long ch) {
        keep_chunks(cfg, st, t, ch, 1);
        const long long L = cfg.depth;
        const cudaStream_t sm = Kernels::ctx(st).stream();
        for (long long i = 0; i < 2 * L; ++i) {
            const auto li = static_cast<std::size_t>(i % L);
            Kernels::copy_into(t.memory[static_cast<std::size_t>(ch * 2 * L + i)],
                               (i < L ? st.w_ : st.s_)[li], sm);
        }
    }

    /// The chunk's products u and gate logits (bias added), from the state's workspace (where
    /// the projection's one product left them side by side, rows ld_in apart).
    static void keep_products(const MemoryConfig& cfg, const typename Kernels::Prepared& pp,
                              const typename Kernels::State& st, Trace& t, const ChunkRows& rows) {
        const cudaStream_t sm = Kernels::ctx(st).stream();
        const auto& w = *st.work_;
        rows.scatter(sm, w.u.data(), pp->ld_in, t.u.data(), 3 * cfg.inner_dim(),
                     3 * cfg.inner_dim(), nullptr);
        if (cfg.gates != GateMode::Constant) {
            rows.scatter(sm, w.u.data() + pp->gates_at, pp->ld_in, t.logits.data(),
                         3 * cfg.n_heads, 3 * cfg.n_heads, pp->b_gates.data());
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
            cuda::memset_async(b.data(), 0, n * sizeof(T), cuda::thread_context().stream(),
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
        cuda::copy_now(to, m.data(), static_cast<std::size_t>(m.size()) * sizeof(T),
                       cudaMemcpyHostToDevice, "cudaMemcpy (memory backward to device)");
    }
    static Mat download_mat(const T* from, Index rows, Index cols) {
        Mat m(rows, cols);
        cuda::copy_now(m.data(), from, static_cast<std::size_t>(m.size()) * sizeof(T),
                       cudaMemcpyDeviceToHost, "cudaMemcpy (memory backward to host)");
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

    /// dL/dx (written, device) and every parameter's gradient from dy = dL/dy (device) and,
    /// if given, d_out = dL/d(the state after the trace; it ends at a chunk boundary); d_in, if
    /// given, gets dL/d(the state before it). If the gradients and d_in are finite the
    /// gradients are added to `grads` (device, 1 x the parameters' count, MemoryParams::tensors
    /// order) and true returned; else grads is unchanged and false returned. memory_sweep.cuh.
    static bool backward(const MemoryConfig& cfg, const typename Kernels::Prepared& pp,
                         const Trace& tr, View<const T> dyv, View<T> dxv, View<T> grads,
                         const MemoryStateGradient<T>* d_out = nullptr,
                         MemoryStateGradient<T>* d_in = nullptr) {
        Sweep w(cfg, pp, tr);
        return Sweep::run(w, dyv, dxv, grads, d_out, d_in);
    }

    /// The backward's stages and buffers (memory_sweep.cuh).
    struct Sweep;
    /// The backward in stages, for a caller whose later inputs depend on the memory
    /// mid-stream (memory_sweep.cuh).
    class Reverse;

    /// The reverse of Kernels::read_weights (MAC's read of its segment-start memory): from
    /// dy = dL/dy ((B*m) x d, host), dx (written), dweights[s * H + h] (written, the weights'
    /// shapes) and the gradients of W_Q and W_O (added to g). memory_read_backward.cuh.
    static void read_weights_backward(const MemoryConfig& cfg,
                                      const typename Kernels::Prepared& prepared,
                                      const std::vector<std::vector<Mat>>& weights, const Mat& x,
                                      int B, const Mat& dy, Mat& dx,
                                      std::vector<std::vector<Mat>>& dweights,
                                      MemoryParams<T>& g) {
        ReadBackward r(cfg, prepared, x.rows(), B);
        ReadBackward::run(r, weights, x, dy, dx, dweights, g);
    }
    /// The same through a snapshot on device views (x, dy, dx (B*m) x d): dW the snapshot's
    /// adjoint, W_Q's and W_O's gradients added to `grads` (the memory's flat gradient) only
    /// if they, dx and dW are finite, which it returns.
    static bool read_snapshot_backward(const MemoryConfig& cfg,
                                       const typename Kernels::Prepared& prepared,
                                       const CudaMemorySnapshot<T>& s, View<const T> x, int B,
                                       View<const T> dy, View<T> dx, CudaMemorySnapshot<T>& dW,
                                       View<T> grads) {
        ReadBackward r(cfg, prepared, x.rows, B);
        return ReadBackward::run(r, s, x, dy, dx, dW, grads);
    }
    /// Where W_O sits in the memory's flat gradient (MemoryParams::tensors order: W_Q, W_K,
    /// W_V, the conv taps, the gates' weights and biases, memory_init, W_O).
    static long long flat_w_o_offset(const MemoryConfig& cfg) {
        const long long d = cfg.d_model, D = cfg.inner_dim(), H = cfg.n_heads;
        long long at = 3 * d * D;
        if (cfg.use_conv) at += 3LL * cfg.conv_kernel * D;
        if (cfg.gates != GateMode::Constant) at += 3 * d * H + 3 * H;
        for (int l = 1; l <= cfg.depth; ++l) at += H * cfg.layer_in(l) * cfg.layer_out(l);
        return at;
    }
    struct ReadBackward;
};

}  // namespace titans::backend

#include "memory_sweep.cuh"
#include "memory_read_backward.cuh"
