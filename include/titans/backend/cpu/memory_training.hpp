#pragma once
// titans/backend/cpu/memory_training.hpp: the neural memory's training pass on the CPU
// (math §9).
//
// forward: the inference forward, keeping the memory (W, S) at every chunk start (N/b copies
// per sequence and head, not N), the input products and the gate logits. backward: the conv,
// phi and norm recomputed from the kept products (elementwise); then per (sequence,
// head), in parallel, a reverse sweep over the chunks. Each chunk's key pass, gates and
// coefficients are recomputed from its start memory, and reversed in turn: the read (lagged or
// dual form), the chunk end W' = beta W + c S - A^T diag(g) Delta, S' = P S - A^T diag(s) Delta,
// the coefficient recurrences, the gradient clipping and the key pass with its second-order
// terms; the adjoint of the start memory is carried to the previous chunk. Last, the
// projections are reversed. The per-token update (math §3) is the chunk size 1 of the same.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "../../detail/activation.hpp"
#include "../../detail/float_env.hpp"
#include "../../detail/norm_scale.hpp"
#include "../../detail/tensor_slots.hpp"
#include "../../detail/trace.hpp"
#include "../../memory/chunk_coefficients.hpp"
#include "../../memory/chunk_coefficients_backward.hpp"
#include "../../memory/key_tape.hpp"
#include "../../memory/state_gradient.hpp"
#include "memory_kernels.hpp"
#include "memory_projections.hpp"
#include "../../memory/kernels_decl.hpp"

namespace titans::backend {

template <class T>
struct MemoryTraining<Cpu, T> {
    static constexpr bool available = true;
    static constexpr bool staged = true;  // Reverse, start, forward_part (MAC's training)
    using Kernels = MemoryKernels<Cpu, T>;
    using Mat = Matrix<T>;
    using Layers = std::vector<Mat>;

    /// Trains from a state any number of tokens into a chunk (its pending rows are kept).
    static constexpr bool mid_chunk = true;

    /// What backward needs: the input, the memory at every chunk start, the input products
    /// and gate logits (Kernels::Recording), the incoming position and conv tails, and for a
    /// trace that starts `offset` tokens into a chunk that chunk's pending rows (whose start
    /// memory, the state's W^s and S^s, is then the first one kept).
    struct Trace {
        MemoryConfig cfg;
        Mat x;
        int batch = 0;
        std::int64_t start = 0;       // the state's position at the trace's first row
        int offset = 0;               // start mod the chunk: the pending rows before row 0
        std::vector<Mat> tail_in;     // its conv tails (B of (K-1) x 3D)
        std::vector<Layers> pend_a, pend_delta;  // per pair: those rows' A_{l-1}, Delta_l
        std::vector<Mat> pend_gates;             // per pair: their gate logits (offset x 3)
        typename Kernels::Recording kept;
        Eigen::Index recorded = 0;   // rows per stream forward_part has recorded
        detail::TraceFilled filled;  // a moved-from trace is empty
        [[nodiscard]] bool empty() const { return !filled; }
        [[nodiscard]] Eigen::Index rows() const { return x.rows(); }
    };

    /// The sizes forward leaves in a trace of B sequences of N rows for cfg, past the checks
    /// of batch, rows and start (NeuralMemory::validate_trace): B conv tails of (K-1) x 3D
    /// (K-1 = 0 without a conv), the products (B*N) x 3D, the gate logits (B*N) x 3H (not kept
    /// for constant gates) and per (sequence, head) the L weights then the L momenta at each
    /// of the ceil((offset + N) / b) chunk starts; offset = start mod b, and with offset > 0
    /// per pair the pending rows (offset x layer_in(l), offset x layer_out(l), offset x 3
    /// unless the gates are constant). ShapeError naming the part otherwise.
    static void check_trace(const MemoryConfig& cfg, const Trace& tr, const char* where) {
        using detail::check_trace_part;
        using detail::check_trace_shape;
        const std::size_t B = static_cast<std::size_t>(tr.batch);
        const Eigen::Index rows = tr.x.rows(), D = cfg.inner_dim(), N = rows / tr.batch;
        check_trace_part(tr.tail_in.size() == B, where, "tail_in.size()", tr.tail_in.size(),
                         "trace.batch");
        for (const Mat& tail : tr.tail_in) {
            check_trace_shape(tail, cfg.use_conv ? cfg.conv_kernel - 1 : 0, 3 * D, where,
                              "tail_in");
        }
        check_trace_shape(tr.kept.u, rows, 3 * D, where, "kept.u");
        if (cfg.gates != GateMode::Constant) {
            check_trace_shape(tr.kept.logits, rows, 3 * cfg.n_heads, where, "kept.logits");
        }
        const auto& memory = tr.kept.memory;
        check_trace_part(memory.size() == B * static_cast<std::size_t>(cfg.n_heads), where,
                         "kept.memory.size()", memory.size(), "trace.batch * n_heads");
        const int b = cfg.effective_chunk(), L = cfg.depth;
        check_trace_part(tr.offset == tr.start % b, where, "start", tr.start,
                         detail::concat("a position ", tr.offset, " tokens into a chunk of ", b,
                                        " (the trace's offset)"));
        check_pending(cfg, tr, where);
        const auto per_pair = static_cast<std::size_t>((tr.offset + N + b - 1) / b * 2 * L);
        for (const std::vector<Mat>& pair : memory) {
            check_trace_part(pair.size() == per_pair, where, "kept.memory[i].size()", pair.size(),
                             detail::concat(per_pair, " (2 depth per chunk start)"));
            for (std::size_t i = 0; i < per_pair; ++i) {
                const int l = static_cast<int>(i % static_cast<std::size_t>(L)) + 1;
                check_trace_shape(pair[i], cfg.layer_in(l), cfg.layer_out(l), where,
                                  "kept.memory[i][j]");
            }
        }
    }

    /// The forward of Kernels::forward, recording the trace; diag (optional) as
    /// Kernels::forward fills it.
    static void forward(const MemoryConfig& cfg, const typename Kernels::Prepared& p,
                        typename Kernels::State& st, View<const T> x, View<T> y, Trace& trace,
                        Diagnostics<T>* diag = nullptr) {
        Trace t;
        start(cfg, st, x.rows / st.batch(), x.cols, t);
        forward_part(cfg, p, st, x, y, t, diag);
        trace = std::move(t);
    }

    /// An empty trace for st's B sequences of N rows of width d from st, filled by
    /// forward_part piece by piece (MAC feeds its memory a segment at a time).
    static void start(const MemoryConfig& cfg, const typename Kernels::State& st, Eigen::Index N,
                      Eigen::Index d, Trace& t) {
        const int B = st.batch();
        t = Trace{};
        t.cfg = cfg;
        t.batch = B;
        t.start = st.position();
        t.offset = st.pending();
        t.tail_in = st.conv_tail_;
        t.x.resize(B * N, d);
        t.kept.u.resize(B * N, 3 * cfg.inner_dim());
        if (cfg.gates != GateMode::Constant) {
            t.kept.logits.resize(B * N, 3 * cfg.n_heads);
        }
        t.kept.memory.resize(static_cast<std::size_t>(B) * static_cast<std::size_t>(cfg.n_heads));
        if (t.offset > 0) {
            keep_pending(cfg, st, t);
        }
        t.filled = N == 0;
    }

    /// The next piece of a trace from start(): x, y (B*m) x d, sequence-major, run from st
    /// (the state start() saw, fed the trace's earlier pieces), recorded at the rows after
    /// them. The trace is filled once its N rows are in. diag (optional): this part's rows.
    static void forward_part(const MemoryConfig& cfg, const typename Kernels::Prepared& p,
                             typename Kernels::State& st, View<const T> x, View<T> y, Trace& t,
                             Diagnostics<T>* diag = nullptr) {
        const int B = t.batch;
        const Eigen::Index N = t.x.rows() / B, m = x.rows / B, t0 = st.position() - t.start;
        typename Kernels::Recording rec;
        std::vector<std::size_t> kept;  // each pair's chunk starts before this part
        for (const std::vector<Mat>& pair : t.kept.memory) kept.push_back(pair.size());
        rec.memory = std::move(t.kept.memory);
        try {
            Kernels::run(cfg, p, st, x, y, diag, &rec);
        } catch (...) {  // the trace as it was (the state is rolled back by run)
            for (std::size_t i = 0; i < kept.size(); ++i) rec.memory[i].resize(kept[i]);
            t.kept.memory = std::move(rec.memory);
            throw;
        }
        t.kept.memory = std::move(rec.memory);
        const auto xs = cpu::as_eigen(x);
        for (int s = 0; s < B && m > 0; ++s) {
            t.x.middleRows(s * N + t0, m) = xs.middleRows(s * m, m);
            t.kept.u.middleRows(s * N + t0, m) = rec.u.middleRows(s * m, m);
            if (cfg.gates != GateMode::Constant) {
                t.kept.logits.middleRows(s * N + t0, m) = rec.logits.middleRows(s * m, m);
            }
        }
        t.recorded = t0 + m;
        t.filled = t0 + m == N;
    }

    /// dL/dx (written, rows x d) and every parameter's gradient from dy = dL/dy and, if
    /// given, d_out = dL/d(the state after the trace, its pending rows' included). d_in, if
    /// given, gets dL/d(the state before it). The gradients gather in zeros; if they and d_in
    /// are finite they are added to `grads` (1 x the parameters' count, MemoryParams::tensors
    /// order, row-major) and true returned, else grads is unchanged and false returned.
    static bool backward(const MemoryConfig& cfg, const typename Kernels::Prepared& prepared,
                         const Trace& tr, View<const T> dyv, View<T> dxv, View<T> grads,
                         const MemoryStateGradient<T>* d_out = nullptr,
                         MemoryStateGradient<T>* d_in = nullptr) {
        MemoryParams<T> local = MemoryParams<T>::zeros(cfg);
        Reverse rev(cfg, prepared, tr, dyv, d_out);
        Mat dx;
        rev.down_to(0, dx);
        rev.finish(local, d_in);
        cpu::as_eigen(dxv) = dx;
        if (!detail::tensors_finite(local, cfg) || (d_in != nullptr && !d_in->finite())) {
            return false;
        }
        detail::add_flat_host(std::as_const(local), cfg, grads.data);
        return true;
    }

    class Reverse;

private:
    /// The incoming chunk's pending rows and its start memory (the state's W^s, S^s, kept
    /// first), per pair, into a trace from a state t.offset tokens into a chunk.
    static void keep_pending(const MemoryConfig& cfg, const typename Kernels::State& st,
                             Trace& t) {
        const int p = t.offset;
        for (int s = 0; s < st.batch(); ++s) {
            for (int h = 0; h < cfg.n_heads; ++h) {
                const auto& hd = st.heads_[st.index(s, h)];
                Layers a, delta;
                for (std::size_t l = 0; l < hd.a.size(); ++l) {
                    a.push_back(hd.a[l].topRows(p));
                    delta.push_back(hd.delta[l].topRows(p));
                }
                t.pend_a.push_back(std::move(a));
                t.pend_delta.push_back(std::move(delta));
                t.pend_gates.push_back(cfg.gates != GateMode::Constant ? Mat(hd.gates.topRows(p))
                                                                        : Mat(p, 0));
                auto& snap = t.kept.memory[st.index(s, h)];
                snap.insert(snap.end(), hd.w.begin(), hd.w.end());
                snap.insert(snap.end(), hd.s.begin(), hd.s.end());
            }
        }
    }

    /// check_trace's part for the pending rows before row 0.
    static void check_pending(const MemoryConfig& cfg, const Trace& tr, const char* where) {
        using detail::check_trace_part;
        using detail::check_trace_shape;
        const std::size_t pairs = tr.offset > 0 ? tr.kept.memory.size() : 0;
        check_trace_part(tr.pend_a.size() == pairs && tr.pend_delta.size() == pairs &&
                             tr.pend_gates.size() == pairs,
                         where, "pend_a.size()", tr.pend_a.size(), "the pairs when offset > 0");
        for (std::size_t i = 0; i < pairs; ++i) {
            check_trace_part(tr.pend_a[i].size() == static_cast<std::size_t>(cfg.depth) &&
                                 tr.pend_delta[i].size() == tr.pend_a[i].size(),
                             where, "pend_a[i].size()", tr.pend_a[i].size(), "depth");
            for (int l = 1; l <= cfg.depth; ++l) {
                const auto u = static_cast<std::size_t>(l - 1);
                check_trace_shape(tr.pend_a[i][u], tr.offset, cfg.layer_in(l), where, "pend_a");
                check_trace_shape(tr.pend_delta[i][u], tr.offset, cfg.layer_out(l), where,
                                  "pend_delta");
            }
            check_trace_shape(tr.pend_gates[i], tr.offset,
                              cfg.gates != GateMode::Constant ? 3 : 0, where, "pend_gates");
        }
    }

    /// One (sequence, head)'s rows and columns in the piece's matrices. Rows t are counted from
    /// the chunk start before the trace's row 0, `off` rows (the incoming pending ones) earlier.
    struct Slice {
        const cpu::MemoryProjections<T>& pr;
        const Mat& dyh;
        Eigen::Index r0;
        int h, dh, D, H;
        Eigen::Index off;
        [[nodiscard]] Eigen::Index row(Eigen::Index t) const { return r0 + t - off; }
        template <class M>
        auto q(M& m, Eigen::Index t, Eigen::Index n) const {
            return m.block(row(t), h * dh, n, dh);
        }
        template <class M>
        auto k(M& m, Eigen::Index t, Eigen::Index n) const {
            return m.block(row(t), D + h * dh, n, dh);
        }
        template <class M>
        auto v(M& m, Eigen::Index t, Eigen::Index n) const {
            return m.block(row(t), 2 * D + h * dh, n, dh);
        }
    };

    /// Workspaces and position of one pair's reverse sweep.
    struct Pair {
        detail::KeyTape<T> tape;
        Layers W, S, dW, dS, dWn, dSn;  // chunk-start memory; adjoints at its start and end
        Layers tapW;                    // a tap's adjoint waiting for the stage below it
        Layers hin, z, p1, p2, sc;      // the read, per layer
        Mat dq, dk, dv, dH, tmp, G, dG, dM;
        std::vector<T> theta0, theta, eta, alpha, g2, beta, c, g, s;
        std::vector<T> dtheta, deta, dalpha, dbeta, dc, dg, ds, scratch;
        Eigen::Index cur = 0;  // rows >= cur are reversed (counted as Slice's)
        bool has_tap = false;
        bool final_end = false;  // the last chunk's end has an adjoint (the state after the call)
        // A trace ending mid-chunk: the state after keeps that chunk's start memory and rows.
        bool end_mid = false;     // d_out given there: its W^s, S^s adjoint in dW_end, dS_end
        bool add_out = false;     // the stage about to run adds d_out's pending rows
        Layers dW_end, dS_end;
        const Layers *pa_out = nullptr, *pd_out = nullptr;  // d_out's pending rows (or none)
        const Mat* pg_out = nullptr;
        // A trace starting mid-chunk: the incoming pending rows and their adjoints.
        const Layers *pa_in = nullptr, *pd_in = nullptr;
        const Mat* pg_in = nullptr;
        Layers da_in, dd_in;
        Mat dg_in;
    };

    /// Starts a pair's sweep at the end of its N rows, with the adjoint of the state's
    /// memory after them (dW, dS; null: none): at a chunk end the final memory's, mid-chunk
    /// (w.end_mid) that chunk's start memory's. Shapes from the layer sizes.
    static void sweep_start(const MemoryConfig& cfg, Eigen::Index N, const Layers* dW,
                            const Layers* dS, Pair& w) {
        const auto L = static_cast<std::size_t>(cfg.depth);
        for (Layers* v : {&w.W, &w.S, &w.dW, &w.dS, &w.dWn, &w.dSn, &w.tapW}) v->resize(L);
        w.end_mid = dW != nullptr && N % cfg.effective_chunk() != 0;
        for (std::size_t l = 0; l < L; ++l) {
            const int in = cfg.layer_in(static_cast<int>(l) + 1), out = cfg.layer_out(static_cast<int>(l) + 1);
            w.dWn[l] = dW != nullptr && !w.end_mid ? (*dW)[l] : Mat::Zero(in, out);
            w.dSn[l] = dS != nullptr && !w.end_mid ? (*dS)[l] : Mat::Zero(in, out);
        }
        if (w.end_mid) {
            w.dW_end = *dW;
            w.dS_end = *dS;
        }
        w.cur = N;
        w.has_tap = false;
        w.final_end = dW != nullptr && !w.end_mid;
    }

    /// The adjoint of the weights after w.cur tokens (the memory a MAC segment starting there
    /// reads): at a chunk start it is the start memory's (carried in dWn); after the last row
    /// it is the final memory's (dWn too, the last stage then ends there); otherwise it waits
    /// for the stage that ends there.
    static void sweep_tap(const MemoryConfig& cfg, Eigen::Index N, const Layers& dW, Pair& w) {
        const int b = cfg.effective_chunk();
        const bool last = w.cur == N;
        const bool boundary = last || w.cur % b == 0;
        for (std::size_t l = 0; l < dW.size(); ++l) {
            if (boundary) {
                w.dWn[l] += dW[l];
            } else {
                w.tapW[l] = w.has_tap ? (w.tapW[l] + dW[l]).eval() : dW[l];
            }
        }
        w.has_tap = w.has_tap || !boundary;
        w.final_end = w.final_end || last;
    }

    /// The reverse sweep over one pair's rows [p, w.cur), chunk by chunk, last first; a chunk
    /// with taps inside runs in stages split at them, each stage the reads of its rows and the
    /// chunk end (or the tap's partial end) of its prefix. When a chunk's first row is done
    /// its start memory's adjoint is carried (w.dWn, w.dSn) to the chunk before it; after
    /// row 0 that is W^0's.
    static void sweep_down(const MemoryConfig& cfg, const std::vector<Mat>& snap, const Slice& sl,
                           Eigen::Index N, Eigen::Index p, Pair& w, Mat& yh, Mat& dqkv,
                           Mat& dlogits) {
        const int b = cfg.effective_chunk();
        const auto Ls = w.W.size();
        while (w.cur > p) {
            const Eigen::Index ch = (w.cur - 1) / b, c0 = ch * b, c1 = std::min<Eigen::Index>(c0 + b, N);
            w.add_out = w.cur == N && w.end_mid;
            if (w.cur == c1) {  // a new chunk from its top: its start memory
                const auto at = static_cast<std::size_t>(ch) * 2 * Ls;
                for (std::size_t l = 0; l < Ls; ++l) {
                    w.W[l] = snap[at + l];
                    w.S[l] = snap[at + Ls + l];
                    if (w.add_out) {  // the state after keeps this start memory
                        w.dW[l] = w.dW_end[l];
                        w.dS[l] = w.dS_end[l];
                    } else {
                        w.dW[l].setZero(w.W[l].rows(), w.W[l].cols());
                        w.dS[l].setZero(w.W[l].rows(), w.W[l].cols());
                    }
                }
            }
            // The chunk end, adjoint carried in dWn, dSn (the last chunk's: the state after).
            bool end = w.cur == c1 && (c1 < N || w.final_end);
            if (!end && w.has_tap) {           // a tap's partial end
                for (std::size_t l = 0; l < Ls; ++l) {
                    w.dWn[l] = w.tapW[l];
                    w.dSn[l].setZero();
                }
                end = true;
            }
            w.has_tap = false;
            const Eigen::Index lo = std::max(c0, p);
            const Eigen::Index reads = std::max(lo, c0 == 0 ? sl.off : Eigen::Index(0));
            chunk_backward(cfg, sl, c0, static_cast<int>(w.cur - c0), static_cast<int>(reads - c0),
                           end, w, yh, dqkv, dlogits);
            w.add_out = false;
            w.cur = lo;
            if (lo == c0) {
                std::swap(w.dW, w.dWn);
                std::swap(w.dS, w.dSn);
            }
        }
    }

    /// One stage of a chunk at t0: the prefix of n rows, the reads of rows [o, n). Recompute,
    /// then reverse the reads, the end of the prefix (if `end`: W' = f(W, S, rows < n), the
    /// adjoint in dWn, dSn), the coefficients, clipping, key pass and gates. Adds to dqkv and
    /// dlogits. In the first chunk of a trace that starts mid-chunk the first sl.off rows are
    /// the incoming pending ones: taken from the trace, their adjoints added to w.da_in,
    /// w.dd_in, w.dg_in.
    static void chunk_backward(const MemoryConfig& cfg, const Slice& sl, Eigen::Index t0, int n,
                               int o, bool end, Pair& w, Mat& yh, Mat& dqkv, Mat& dlogits) {
        const Mat& qkv = sl.pr.qkv;
        const int pre = t0 == 0 ? static_cast<int>(sl.off) : 0;
        w.tape.forward(w.W, sl.k(qkv, t0 + pre, n - pre), sl.v(qkv, t0 + pre, n - pre),
                       cfg.activation, cfg.residual);
        if (pre > 0) {
            w.tape.prepend(*w.pa_in, *w.pd_in);
        }
        if (w.add_out) {
            pending_out(cfg, sl, t0, pre, w, dlogits);
        }
        gates(cfg, sl, t0, n, pre, w);
        for (auto* v : {&w.dtheta, &w.deta, &w.dalpha, &w.dbeta, &w.dc, &w.dg, &w.ds}) {
            v->assign(static_cast<std::size_t>(n), T(0));
        }
        w.scratch.resize(6 * static_cast<std::size_t>(n));
        auto y = yh.block(sl.row(t0 + o), sl.h * sl.dh, n - o, sl.dh);
        const auto dy = sl.dyh.block(sl.row(t0 + o), sl.h * sl.dh, n - o, sl.dh);
        T dp_end = T(0);
        if (cfg.retrieval == Retrieval::Lagged) {
            lagged_backward(cfg, sl.q(qkv, t0 + o, n - o), dy, w, y);
        } else {
            dual_backward(cfg, sl.q(qkv, t0 + o, n - o), dy, n, o, w, y);
        }
        if (end) {
            dp_end = end_backward(n, w);
        }
        chunk_coefficients_backward<T>(
            n, w.theta.data(), w.eta.data(), w.alpha.data(), w.dbeta.data(), w.dc.data(),
            cfg.retrieval == Retrieval::InChunk ? w.dG.data() : nullptr,
            end ? w.dg.data() : nullptr, end ? w.ds.data() : nullptr, dp_end, w.dtheta.data(),
            w.deta.data(), w.dalpha.data(), w.scratch.data());
        clip_backward(cfg, n, w);
        for (std::size_t l = 0; l < w.da_in.size() && pre > 0; ++l) {
            w.da_in[l] += w.tape.abar[l].topRows(pre);
            w.dd_in[l] += w.tape.dbar[l].topRows(pre);
        }
        w.tape.backward(w.W, cfg.activation, cfg.residual, w.dW, w.dk, w.dv);
        sl.q(dqkv, t0 + o, n - o) += w.dq;
        sl.k(dqkv, t0 + pre, n - pre) += w.dk;
        sl.v(dqkv, t0 + pre, n - pre) += w.dv;
        gates_backward(cfg, sl, t0, n, pre, w, dlogits);
    }

    /// d_out's adjoints of the pending rows the state after the trace keeps (rows [0, n) of
    /// the last chunk) into the tape's abar, dbar and the gate logits' adjoints (the incoming
    /// rows' into w.dg_in).
    static void pending_out(const MemoryConfig& cfg, const Slice& sl, Eigen::Index t0, int pre,
                            Pair& w, Mat& dlogits) {
        for (std::size_t l = 0; l < w.tape.a.size(); ++l) {
            if (w.pa_out != nullptr) w.tape.abar[l] += (*w.pa_out)[l];
            if (w.pd_out != nullptr) w.tape.dbar[l] += (*w.pd_out)[l];
        }
        if (w.pg_out == nullptr || cfg.gates == GateMode::Constant) {
            return;
        }
        for (Eigen::Index i = 0; i < w.pg_out->rows(); ++i) {
            for (int which = 0; which < 3; ++which) {
                if (i < pre) {
                    w.dg_in(i, which) += (*w.pg_out)(i, which);
                } else {
                    dlogits(sl.row(t0 + i), which * sl.H + sl.h) += (*w.pg_out)(i, which);
                }
            }
        }
    }

    /// The gates of rows [t0, t0+n) (theta0 before clipping, theta after, eta, alpha), as
    /// Kernels::gates_clipped computes them for a whole chunk.
    static void gates(const MemoryConfig& cfg, const Slice& sl, Eigen::Index t0, int n, int pre,
                      Pair& w) {
        for (auto* v : {&w.theta0, &w.theta, &w.eta, &w.alpha, &w.g2}) {
            v->resize(static_cast<std::size_t>(n));
        }
        const T sc[3] = {static_cast<T>(cfg.gate_scale(0)), static_cast<T>(cfg.gate_scale(1)),
                         static_cast<T>(cfg.gate_scale(2))};
        const Mat& lg = sl.pr.logits;
        const auto logit = [&](int i, int which) {
            return i < pre ? (*w.pg_in)(i, which) : lg(sl.row(t0 + i), which * sl.H + sl.h);
        };
        const auto mean = [&](int which) {
            T m = T(0);
            for (int i = 0; i < n; ++i) m += logit(i, which);
            return m / static_cast<T>(n);
        };
        for (int i = 0; i < n; ++i) {
            const auto u = static_cast<std::size_t>(i);
            if (cfg.gates == GateMode::Constant) {
                w.theta0[u] = static_cast<T>(cfg.gate_constant(0));
                w.eta[u] = static_cast<T>(cfg.gate_constant(1));
                w.alpha[u] = static_cast<T>(cfg.gate_constant(2));
            } else {
                const bool chunk = cfg.gates == GateMode::PerChunk;
                w.theta0[u] = sc[0] * detail::sigmoid(chunk ? mean(0) : logit(i, 0));
                w.eta[u] = sc[1] * detail::sigmoid(chunk ? mean(1) : logit(i, 1));
                w.alpha[u] = sc[2] * detail::sigmoid(chunk ? mean(2) : logit(i, 2));
            }
            T g2 = T(0);
            for (std::size_t l = 0; l < w.tape.a.size(); ++l) {
                g2 += w.tape.a[l].row(i).squaredNorm() * w.tape.delta[l].row(i).squaredNorm();
            }
            w.g2[u] = g2;
            const T c = static_cast<T>(cfg.max_grad_norm);
            const bool clipped = cfg.max_grad_norm > 0 && g2 > c * c;
            const T f = !clipped ? T(1)
                        : g2 <= detail::largest_finite<T>()
                            ? c / std::sqrt(g2)
                            : detail::scaled_grad_norm_row(w.tape.a, w.tape.delta, i).clip_factor(c);
            w.theta[u] = clipped ? w.theta0[u] * f : w.theta0[u];
        }
    }

    /// The adjoints of the gate values (dtheta of theta0 after clip_backward) into the logits
    /// (the first `pre` rows' into w.dg_in).
    static void gates_backward(const MemoryConfig& cfg, const Slice& sl, Eigen::Index t0, int n,
                               int pre, Pair& w, Mat& dlogits) {
        if (cfg.gates == GateMode::Constant) {
            return;
        }
        const Mat& lg = sl.pr.logits;
        const std::vector<T>* adj[3] = {&w.dtheta, &w.deta, &w.dalpha};
        for (int which = 0; which < 3; ++which) {
            const Eigen::Index col = which * sl.H + sl.h;
            const auto logit = [&](int i) -> T {
                return i < pre ? (*w.pg_in)(i, which) : lg(sl.row(t0 + i), col);
            };
            const auto add = [&](int i, T v) {
                (i < pre ? w.dg_in(i, which) : dlogits(sl.row(t0 + i), col)) += v;
            };
            const T scale = static_cast<T>(cfg.gate_scale(which));
            const auto dsig = [](T z) { const T s = detail::sigmoid(z); return s * (T(1) - s); };
            if (cfg.gates == GateMode::PerChunk) {
                T m = T(0), d = T(0);
                for (int i = 0; i < n; ++i) {
                    m += logit(i);
                    d += (*adj[which])[static_cast<std::size_t>(i)];
                }
                m /= static_cast<T>(n);
                const T dl = d * scale * dsig(m) / static_cast<T>(n);
                for (int i = 0; i < n; ++i) add(i, dl);
            } else {
                for (int i = 0; i < n; ++i) {
                    add(i, (*adj[which])[static_cast<std::size_t>(i)] * scale * dsig(logit(i)));
                }
            }
        }
    }

    /// theta_i = theta0_i min(1, c / sqrt(g2_i)), g2_i = sum_l ||a_l,i||^2 ||delta_l,i||^2:
    /// dtheta becomes the adjoint of theta0; g2's adjoint goes into the tape's abar and dbar.
    static void clip_backward(const MemoryConfig& cfg, int n, Pair& w) {
        const T c = static_cast<T>(cfg.max_grad_norm);
        for (int i = 0; i < n; ++i) {
            const auto u = static_cast<std::size_t>(i);
            if (!(cfg.max_grad_norm > 0 && w.g2[u] > c * c)) {
                continue;
            }
            if (!(w.g2[u] <= detail::largest_finite<T>())) {
                clip_backward_scaled(cfg, i, w);
                continue;
            }
            const T f = c / std::sqrt(w.g2[u]);
            const T dg2 = T(-0.5) * w.dtheta[u] * w.theta0[u] * f / w.g2[u];
            w.dtheta[u] *= f;
            for (std::size_t l = 0; l < w.tape.a.size(); ++l) {
                const T na = w.tape.a[l].row(i).squaredNorm();
                const T nd = w.tape.delta[l].row(i).squaredNorm();
                w.tape.abar[l].row(i) += (T(2) * dg2 * nd) * w.tape.a[l].row(i);
                w.tape.dbar[l].row(i) += (T(2) * dg2 * na) * w.tape.delta[l].row(i);
            }
        }
    }

    /// clip_backward of a row whose g2 overflowed T, with g = s 2^k (detail::GradNorm): the
    /// same adjoints, 2 dg2 ||delta_l||^2 = -dtheta theta0 f (||delta_l|| / g)^2, each ratio
    /// taken scaled.
    static void clip_backward_scaled(const MemoryConfig& cfg, int i, Pair& w) {
        const auto u = static_cast<std::size_t>(i);
        const detail::GradNorm<T> g = detail::scaled_grad_norm_row(w.tape.a, w.tape.delta, i);
        const T f = g.clip_factor(static_cast<T>(cfg.max_grad_norm));
        const T scale = -w.dtheta[u] * w.theta0[u] * f;
        w.dtheta[u] *= f;
        for (std::size_t l = 0; l < w.tape.a.size(); ++l) {
            const auto a = w.tape.a[l].row(i);
            const auto d = w.tape.delta[l].row(i);
            const T ra = g.ratio(a.data(), a.size()), rd = g.ratio(d.data(), d.size());
            w.tape.abar[l].row(i) += (scale * rd) * (rd * a);
            w.tape.dbar[l].row(i) += (scale * ra) * (ra * d);
        }
    }

    /// Lagged read y = M_W(q) (W the chunk-start memory) recomputed into y, and reversed:
    /// dq written, dW added.
    template <class Q, class DY, class Y>
    static void lagged_backward(const MemoryConfig& cfg, const Q& q, const DY& dy, Pair& w, Y& y) {
        const std::size_t L = w.W.size();
        w.hin.resize(L);
        w.z.resize(L);
        w.hin[0] = q;
        for (std::size_t l = 0; l < L; ++l) {
            w.z[l].noalias() = w.hin[l] * w.W[l];
            if (l + 1 < L) {
                detail::activate_into(cfg.activation, w.z[l], w.hin[l + 1]);
            }
        }
        y = w.z[L - 1];
        if (cfg.residual) y += q;
        w.tmp = dy;  // the adjoint of z_l, l = L-1 first
        for (std::size_t l = L; l-- > 0;) {
            w.dW[l].noalias() += w.hin[l].transpose() * w.tmp;
            w.dH.noalias() = w.tmp * w.W[l].transpose();
            if (l > 0) {
                detail::activate_grad_into(cfg.activation, w.z[l - 1], w.tmp);
                w.tmp.array() *= w.dH.array();
            }
        }
        w.dq = w.dH;
        if (cfg.residual) w.dq += dy;
    }

    /// Dual-form read (math §5) of rows [o, n) of a chunk prefix of n rows, recomputed into y,
    /// and reversed: per layer Z = diag(beta) H W + diag(c) H S - (G . (H A^T)) Delta, G
    /// (n - o) x n. dq written; dW, dS, the tape's abar / dbar, dbeta, dc added; dG (n x n)
    /// written.
    template <class Q, class DY, class Y>
    static void dual_backward(const MemoryConfig& cfg, const Q& q, const DY& dy, int n, int o,
                              Pair& w, Y& y) {
        const std::size_t L = w.W.size();
        const int m = n - o;
        for (auto* v : {&w.beta, &w.c}) v->resize(static_cast<std::size_t>(m));
        w.G.resize(m, n);
        chunk_row_coefficients<T>(n, o, w.theta.data(), w.eta.data(), w.alpha.data(),
                                  w.beta.data(), w.c.data(), w.G.data());
        const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> beta(w.beta.data(), m), c(w.c.data(), m);
        for (auto* v : {&w.hin, &w.z, &w.p1, &w.p2, &w.sc}) v->resize(L);
        w.hin[0] = q;
        for (std::size_t l = 0; l < L; ++l) {
            w.p1[l].noalias() = w.hin[l] * w.W[l];
            w.p2[l].noalias() = w.hin[l] * w.S[l];
            w.sc[l].noalias() = w.hin[l] * w.tape.a[l].transpose();
            w.dM = w.G.cwiseProduct(w.sc[l]);
            w.z[l] = beta.asDiagonal() * w.p1[l] + c.asDiagonal() * w.p2[l];
            w.z[l].noalias() -= w.dM * w.tape.delta[l];
            if (l + 1 < L) {
                detail::activate_into(cfg.activation, w.z[l], w.hin[l + 1]);
            }
        }
        y = w.z[L - 1];
        if (cfg.residual) y += q;
        w.dG.setZero(n, n);
        w.tmp = dy;
        for (std::size_t l = L; l-- > 0;) {
            dual_layer_backward(l, o, beta, c, w);
            if (l > 0) {
                detail::activate_grad_into(cfg.activation, w.z[l - 1], w.tmp);
                w.tmp.array() *= w.dH.array();
            }
        }
        w.dq = w.dH;
        if (cfg.residual) w.dq += dy;
    }

    /// One layer of dual_backward (query rows [o, n)): w.tmp = dZ_l in, w.dH = the adjoint of
    /// H_l's input out.
    template <class Vec>
    static void dual_layer_backward(std::size_t l, int o, const Vec& beta, const Vec& c, Pair& w) {
        const Mat& dZ = w.tmp;
        const Mat& hin = w.hin[l];
        for (Eigen::Index i = 0; i < dZ.rows(); ++i) {
            w.dbeta[static_cast<std::size_t>(o + i)] += dZ.row(i).dot(w.p1[l].row(i));
            w.dc[static_cast<std::size_t>(o + i)] += dZ.row(i).dot(w.p2[l].row(i));
        }
        Mat scaled = beta.asDiagonal() * dZ;
        w.dW[l].noalias() += hin.transpose() * scaled;
        w.dH.noalias() = scaled * w.W[l].transpose();
        scaled = c.asDiagonal() * dZ;
        w.dS[l].noalias() += hin.transpose() * scaled;
        w.dH.noalias() += scaled * w.S[l].transpose();
        // - (G . sc) Delta: Delta's adjoint -(G . sc)^T dZ; dM = -dZ Delta^T into G and sc.
        const Mat M = w.G.cwiseProduct(w.sc[l]);
        w.tape.dbar[l].noalias() -= M.transpose() * dZ;
        w.dM.noalias() = -dZ * w.tape.delta[l].transpose();
        w.dG.bottomRows(dZ.rows()) += w.dM.cwiseProduct(w.sc[l]);
        const Mat dsc = w.dM.cwiseProduct(w.G);
        w.dH.noalias() += dsc * w.tape.a[l];
        w.tape.abar[l].noalias() += dsc.transpose() * hin;
    }

    /// The chunk end W' = beta W + c S - A^T diag(g) Delta, S' = P S - A^T diag(s) Delta,
    /// reversed from dWn, dSn: dW, dS, abar, dbar, dg, ds, dbeta[n-1], dc[n-1] added; returns
    /// dP_end.
    static T end_backward(int n, Pair& w) {
        std::vector<T>& gk = w.g;
        std::vector<T>& sk = w.s;
        gk.resize(static_cast<std::size_t>(n));
        sk.resize(static_cast<std::size_t>(n));
        T be, ce, pe;
        chunk_end_coefficients<T>(n, w.theta.data(), w.eta.data(), w.alpha.data(), gk.data(),
                                  sk.data(), &be, &ce, &pe);
        const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> g(gk.data(), n), s(sk.data(), n);
        T dbe = T(0), dce = T(0), dpe = T(0);
        for (std::size_t l = 0; l < w.W.size(); ++l) {
            const Mat& A = w.tape.a[l];
            const Mat& Dl = w.tape.delta[l];
            w.dW[l] += be * w.dWn[l];
            w.dS[l] += ce * w.dWn[l] + pe * w.dSn[l];
            dbe += w.dWn[l].cwiseProduct(w.W[l]).sum();
            dce += w.dWn[l].cwiseProduct(w.S[l]).sum();
            dpe += w.dSn[l].cwiseProduct(w.S[l]).sum();
            const Mat AW = A * w.dWn[l], AS = A * w.dSn[l];
            for (int i = 0; i < n; ++i) {
                w.dg[static_cast<std::size_t>(i)] -= AW.row(i).dot(Dl.row(i));
                w.ds[static_cast<std::size_t>(i)] -= AS.row(i).dot(Dl.row(i));
            }
            w.tape.dbar[l].noalias() -= g.asDiagonal() * AW;
            w.tape.dbar[l].noalias() -= s.asDiagonal() * AS;
            const Mat DW = Dl * w.dWn[l].transpose(), DS = Dl * w.dSn[l].transpose();
            w.tape.abar[l].noalias() -= g.asDiagonal() * DW;
            w.tape.abar[l].noalias() -= s.asDiagonal() * DS;
        }
        w.dbeta[static_cast<std::size_t>(n - 1)] += dbe;
        w.dc[static_cast<std::size_t>(n - 1)] += dce;
        return dpe;
    }

public:
    /// The backward in stages (math §9), for callers whose later inputs depend on the memory
    /// mid-stream (MAC reads it at every segment start): rows are reversed from the last down,
    /// and at a position the caller may add the adjoint of the weights after that many tokens
    /// (current_weights there; per pair s * H + h, layer l at index l-1).
    ///
    ///     Reverse rev(cfg, prepared, trace, dy);
    ///     rev.down_to(p, dx);   // dx: rows [p, previous position) of every sequence, final
    ///     rev.tap(dW);          // the adjoint of the weights after p tokens
    ///     rev.down_to(0, dx); rev.finish(grads);
    class Reverse {
    public:
        /// d_out: the adjoint of the state after the trace (null: none).
        Reverse(const MemoryConfig& cfg, const typename Kernels::Prepared& prepared,
                const Trace& tr, View<const T> dyv, const MemoryStateGradient<T>* d_out = nullptr)
            : cfg_(cfg), p_(*prepared), tr_(tr), N_(tr.x.rows() / tr.batch), cur_(N_),
              off_(tr.offset) {
            const int B = tr.batch, D = cfg.inner_dim();
            const auto pairs = static_cast<std::size_t>(B) * static_cast<std::size_t>(cfg.n_heads);
            pr_.compute(cfg, p_, tr.kept.u, tr.kept.logits, B, tr.tail_in);
            dy_ = cpu::as_eigen(dyv);
            dyh_.noalias() = dy_ * p_.w_o.transpose();
            yh_.resize(tr.x.rows(), D);
            dqkv_.setZero(tr.x.rows(), 3 * D);
            du_.resize(tr.x.rows(), 3 * D);
            dlogits_.setZero(pr_.logits.rows(), pr_.logits.cols());
            work_.resize(pairs);
            const bool given = d_out != nullptr && !d_out->empty();
            for (std::size_t i = 0; i < pairs; ++i) {
                sweep_start(cfg, off_ + N_, given ? &d_out->weights[i] : nullptr,
                            given ? &d_out->momentum[i] : nullptr, work_[i]);
                connect_pending(i, given ? d_out : nullptr, work_[i]);
            }
            if (given) {
                dtail_out_ = d_out->conv_tail;
            }
        }

        /// Rows >= position() of every sequence are reversed.
        [[nodiscard]] Eigen::Index position() const { return cur_; }

        /// Reverses rows [p, position()) of every pair, then their projections: dx (resized)
        /// gets dL/dx of those rows, (B * (position() - p)) x d, sequence-major.
        void down_to(Eigen::Index p, Mat& dx) {
            const int B = tr_.batch, H = cfg_.n_heads;
            const int pairs = B * H;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) if (pairs > 1)
#endif
            for (int bh = 0; bh < pairs; ++bh) {
                const detail::DenormalFlushScope flush(cfg_.flush_denormals);
                sweep_down(cfg_, tr_.kept.memory[static_cast<std::size_t>(bh)], slice(bh),
                           off_ + N_, p == 0 ? 0 : off_ + p, work_[static_cast<std::size_t>(bh)],
                           yh_, dqkv_, dlogits_);
            }
            pr_.to_conv_adjoint(cfg_, dqkv_, B, p, cur_);
            pr_.input_adjoint(cfg_, p_, B, dqkv_, du_, p, cur_);
            add_tail_out(p);
            dx.resize(B * (cur_ - p), tr_.x.cols());
            pr_.input_rows(cfg_, p_, B, du_, dlogits_, p, cur_, dx);
            cur_ = p;
        }

        /// Adds dW[s * H + h] (L matrices each) to the adjoint of the weights after position()
        /// tokens.
        void tap(const std::vector<Layers>& dW) {
            for (std::size_t i = 0; i < work_.size(); ++i) {
                if (work_[i].cur == 0 && off_ > 0) {
                    tap_before(i, dW[i]);
                } else {
                    sweep_tap(cfg_, off_ + N_, dW[i], work_[i]);
                }
            }
        }

        /// After down_to(0): every parameter's gradient added to g (W_O, the projections, the
        /// gates and, for a trace from position 0 that holds tokens, W^0 from the carried
        /// adjoint: an empty one at position 0 precedes the piece that adds it, so it only
        /// passes the adjoint on); d_in, if given, gets the adjoint of the state before the
        /// trace.
        void finish(MemoryParams<T>& g, MemoryStateGradient<T>* d_in = nullptr) const {
            if (N_ > 0) {
                g.w_o.noalias() += yh_.transpose() * dy_;
            }
            const int H = cfg_.n_heads;
            for (std::size_t bh = 0; bh < work_.size() && tr_.start == 0 && N_ > 0; ++bh) {
                auto& dw0 = g.memory_init[bh % static_cast<std::size_t>(H)];
                for (std::size_t l = 0; l < dw0.size(); ++l) {
                    dw0[l] += work_[bh].dWn[l];
                }
            }
            pr_.parameter_gradients(cfg_, tr_.x, tr_.batch, dqkv_, du_, dlogits_, tr_.tail_in, g);
            if (d_in != nullptr) {
                state_in(*d_in);
            }
        }

        // The same on views in host memory (what a block on views drives, math §9 "MAC").

        /// down_to into dx ((B * (position() - p)) x d, written).
        void down_to(Eigen::Index p, View<T> dx) {
            Mat out;
            down_to(p, out);
            cpu::as_eigen(dx) = out;
        }
        /// tap with a snapshot's weights.
        void tap(const MemorySnapshot<T>& dW) { tap(dW.weights); }
        /// finish into the memory's flat gradient (1 x its parameter count, added to) only if
        /// every gradient and d_in are finite, which it returns.
        bool finish_flat(View<T> grads, MemoryStateGradient<T>* d_in = nullptr) const {
            MemoryParams<T> local = MemoryParams<T>::zeros(cfg_);
            finish(local, d_in);
            if (!detail::tensors_finite(local, cfg_) || (d_in != nullptr && !d_in->finite())) {
                return false;
            }
            detail::add_flat_host(std::as_const(local), cfg_, grads.data);
            return true;
        }

    private:
        [[nodiscard]] Slice slice(int bh) const {
            const int H = cfg_.n_heads;
            return Slice{pr_, dyh_, bh / H * N_, bh % H, cfg_.head_dim(), cfg_.inner_dim(), H,
                         off_};
        }

        /// Pair i's pending rows: the trace's incoming ones (their adjoints zeroed) and d_out's.
        void connect_pending(std::size_t i, const MemoryStateGradient<T>* d_out, Pair& w) const {
            if (off_ > 0) {
                w.pa_in = &tr_.pend_a[i];
                w.pd_in = &tr_.pend_delta[i];
                w.pg_in = &tr_.pend_gates[i];
                w.da_in.clear();
                w.dd_in.clear();
                for (std::size_t l = 0; l < w.pa_in->size(); ++l) {
                    w.da_in.push_back(Mat::Zero(off_, (*w.pa_in)[l].cols()));
                    w.dd_in.push_back(Mat::Zero(off_, (*w.pd_in)[l].cols()));
                }
                w.dg_in.setZero(off_, w.pg_in->cols());
            }
            if (d_out != nullptr && w.end_mid) {
                w.pa_out = d_out->pending_a.empty() ? nullptr : &d_out->pending_a[i];
                w.pd_out = d_out->pending_delta.empty() ? nullptr : &d_out->pending_delta[i];
                w.pg_out = d_out->pending_gates.empty() ? nullptr : &d_out->pending_gates[i];
            }
        }

        /// A tap at the trace's row 0 when it starts mid-chunk: the weights there are the
        /// incoming chunk's partial end f(W^s, S^s, pending rows), reversed as a stage of
        /// those rows alone into the start memory's adjoint (carried in dWn, dSn once the
        /// sweep is down) and the pending rows'.
        void tap_before(std::size_t i, const Layers& dW) {
            Pair& w = work_[i];
            const std::vector<Mat>& snap = tr_.kept.memory[i];
            const std::size_t Ls = w.W.size();
            for (std::size_t l = 0; l < Ls; ++l) {
                w.W[l] = snap[l];
                w.S[l] = snap[Ls + l];
            }
            std::swap(w.dW, w.dWn);
            std::swap(w.dS, w.dSn);
            for (std::size_t l = 0; l < Ls; ++l) {
                w.dWn[l] = dW[l];
                w.dSn[l].setZero(w.W[l].rows(), w.W[l].cols());
            }
            // No row of the trace is in the stage: yh_, dqkv_ and dlogits_ stay as they are.
            chunk_backward(cfg_, slice(static_cast<int>(i)), 0, off_, off_, true, w, yh_, dqkv_,
                           dlogits_);
            std::swap(w.dW, w.dWn);
            std::swap(w.dS, w.dSn);
        }

        /// The state after the trace keeps the last K-1 rows of [tail_in; u] per sequence:
        /// dtail_out row i is row N + i of that, u's row N + i - (K-1) when in [p, cur).
        void add_tail_out(Eigen::Index p) {
            const Eigen::Index K1 = static_cast<Eigen::Index>(dtail_out_.empty() ? 0 : dtail_out_[0].rows());
            for (int s = 0; s < tr_.batch; ++s) {
                for (Eigen::Index i = 0; i < K1; ++i) {
                    const Eigen::Index t = N_ + i - K1;
                    if (t >= p && t < cur_) {
                        du_.row(s * N_ + t) += dtail_out_[static_cast<std::size_t>(s)].row(i);
                    }
                }
            }
        }

        /// d_in: the start memory's adjoint carried out of the sweep, and the incoming tails'
        /// (through the conv, and passed through when the trace is shorter than the tail).
        void state_in(MemoryStateGradient<T>& d) const {
            d.weights.resize(work_.size());
            d.momentum.resize(work_.size());
            d.pending_a.clear();
            d.pending_delta.clear();
            d.pending_gates.clear();
            for (std::size_t i = 0; i < work_.size(); ++i) {
                d.weights[i] = work_[i].dWn;
                d.momentum[i] = work_[i].dSn;
                if (off_ > 0) {
                    d.pending_a.push_back(work_[i].da_in);
                    d.pending_delta.push_back(work_[i].dd_in);
                    if (cfg_.gates != GateMode::Constant) {
                        d.pending_gates.push_back(work_[i].dg_in);
                    }
                }
            }
            d.conv_tail.clear();
            for (const Mat& tail : tr_.tail_in) {
                d.conv_tail.push_back(Mat::Zero(tail.rows(), tail.cols()));
            }
            if (d.conv_tail.empty() || d.conv_tail[0].rows() == 0) {
                return;
            }
            pr_.tail_adjoint(cfg_, p_, tr_.batch, dqkv_, d.conv_tail);
            const Eigen::Index K1 = d.conv_tail[0].rows();
            for (std::size_t s = 0; s < dtail_out_.size(); ++s) {
                for (Eigen::Index i = 0; i + N_ < K1; ++i) {
                    d.conv_tail[s].row(N_ + i) += dtail_out_[s].row(i);
                }
            }
        }

        const MemoryConfig& cfg_;
        const MemoryParams<T>& p_;
        const Trace& tr_;
        cpu::MemoryProjections<T> pr_;
        Mat dy_, dyh_, yh_, dqkv_, du_, dlogits_;
        std::vector<Mat> dtail_out_;
        std::vector<Pair> work_;
        Eigen::Index N_, cur_;
        int off_;  // the trace's start mod the chunk: the incoming pending rows
    };

    /// The reverse of Kernels::read_weights (MAC's read of its segment-start memory): from
    /// dy = dL/dy ((B*m) x d), dx (written), dweights[s * H + h] (written, the weights' shapes)
    /// and the gradients of W_Q and W_O (added to g).
    static void read_weights_backward(const MemoryConfig& cfg,
                                      const typename Kernels::Prepared& prepared,
                                      const std::vector<Layers>& weights, const Mat& x, int B,
                                      const Mat& dy, Mat& dx, std::vector<Layers>& dweights,
                                      MemoryParams<T>& g) {
        const MemoryParams<T>& p = *prepared;
        const int H = cfg.n_heads, dh = cfg.head_dim();
        const Eigen::Index m = x.rows() / B;
        cpu::MemoryProjections<T> pr;
        pr.compute_queries(cfg, p, x);
        const Mat dyh = dy * p.w_o.transpose();
        Mat yh(x.rows(), cfg.inner_dim()), dq(x.rows(), cfg.inner_dim());
        dweights.resize(weights.size());
        Pair w;
        for (int bh = 0; bh < B * H; ++bh) {
            const Eigen::Index r0 = bh / H * m;
            const int c0 = bh % H * dh;
            w.W = weights[static_cast<std::size_t>(bh)];
            w.dW.resize(w.W.size());
            for (std::size_t l = 0; l < w.W.size(); ++l) {
                w.dW[l].setZero(w.W[l].rows(), w.W[l].cols());
            }
            auto y = yh.block(r0, c0, m, dh);
            lagged_backward(cfg, pr.qkv.block(r0, c0, m, dh), dyh.block(r0, c0, m, dh), w, y);
            dq.block(r0, c0, m, dh) = w.dq;
            dweights[static_cast<std::size_t>(bh)] = w.dW;
        }
        g.w_o.noalias() += yh.transpose() * dy;
        pr.queries_backward(cfg, p, x, dq, dx, g);
    }

    /// read_weights_backward through a snapshot on views (host memory): dx written, dW the
    /// snapshot's adjoint, W_Q's and W_O's gradients added to the memory's flat gradient grads
    /// only if they, dx and dW are finite, which it returns.
    static bool read_snapshot_backward(const MemoryConfig& cfg,
                                       const typename Kernels::Prepared& prepared,
                                       const MemorySnapshot<T>& s, View<const T> x, int B,
                                       View<const T> dy, View<T> dx, MemorySnapshot<T>& dW,
                                       View<T> grads) {
        MemoryParams<T> local = MemoryParams<T>::zeros(cfg);
        Mat dx_new;
        std::vector<Layers> dw_new;
        read_weights_backward(cfg, prepared, s.weights, Mat(cpu::as_eigen(x)), B,
                              Mat(cpu::as_eigen(dy)), dx_new, dw_new, local);
        cpu::as_eigen(dx) = dx_new;
        dW = MemorySnapshot<T>{std::move(dw_new), cfg.n_heads};
        if (!detail::all_finite(dx_new) || !detail::tensors_finite(local, cfg) ||
            !detail::all_finite_each(dW.weights)) {
            return false;
        }
        detail::add_flat_host(std::as_const(local), cfg, grads.data);
        return true;
    }
};

}  // namespace titans::backend
