#pragma once
// titans/backend/cpu/memory_kernels.hpp: the neural memory on the CPU (math §1-5).
//
// Per forward call: one GEMM per projection over the whole piece, the causal conv and gates,
// then, independently per (sequence, head) and in parallel, the memory scan: chunks at
// absolute positions, each chunk (or the part of it in this piece) processed with batched
// products (math §4) and read in lagged or in-chunk (dual) form (math §5), and finally the
// output projection. The per-token recurrence (math §3) is a separate, plain loop.

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "../../detail/tensor_slots.hpp"
#include "../../detail/activation.hpp"
#include "../../detail/eigen_math.hpp"
#include "../../detail/float_env.hpp"
#include "../../detail/norm_scale.hpp"
#include "../../detail/product.hpp"
#include "../../error.hpp"
#include "../../memory/chunk_coefficients.hpp"
#include "../../memory/config.hpp"
#include "../../memory/diagnostics.hpp"
#include "../../memory/params.hpp"
#include "../../memory/snapshot.hpp"
#include "memory_projections.hpp"
#include "memory_state.hpp"
#include "memory_undo.hpp"
#include "transfer.hpp"
#include "../../memory/kernels_decl.hpp"

namespace titans::backend {

struct Cpu;

template <class T>
struct MemoryKernels<Cpu, T> {
    using State = MemoryState<T>;
    using Head = typename State::Head;
    using Mat = Matrix<T>;
    using In = MatrixRef<T>;         // inputs, as the kernels read them (a map, not copied)
    using Out = cpu::MutableMap<T>;  // outputs, written in place
    /// The parameters as the kernels use them: on the CPU, the caller's own (shared, not
    /// copied).
    using Prepared = std::shared_ptr<const MemoryParams<T>>;

    static Prepared prepare(const MemoryConfig&, const std::shared_ptr<const MemoryParams<T>>& p) {
        return p;
    }
    /// The parameters from their flat form (1 x the count, MemoryParams::tensors order; shapes:
    /// parameters of the same shapes): a copy.
    static Prepared prepare_flat(const MemoryConfig& cfg, const MemoryParams<T>& shapes,
                                 View<const T> flat) {
        return detail::from_flat(shapes, cfg, flat.data);
    }

    static State make_state(const MemoryConfig& cfg, const Prepared& prepared, int batch) {
        const MemoryParams<T>& p = *prepared;
        State st;
        st.cfg_ = cfg;
        st.batch_ = batch;
        st.chunk_ = cfg.effective_chunk();
        st.position_ = 0;
        const int b = st.chunk_, L = cfg.depth, H = cfg.n_heads;
        int widest = cfg.head_dim();
        for (int l = 1; l <= L; ++l) {
            widest = std::max(widest, cfg.layer_out(l));
        }
        st.heads_.resize(static_cast<std::size_t>(batch) * static_cast<std::size_t>(H));
        for (int s = 0; s < batch; ++s) {
            for (int h = 0; h < H; ++h) {
                Head& hd = st.heads_[st.index(s, h)];
                for (int l = 1; l <= L; ++l) {
                    const Mat& w0 = p.memory_init[static_cast<std::size_t>(h)][static_cast<std::size_t>(l - 1)];
                    hd.w.push_back(w0);
                    hd.s.push_back(Mat::Zero(w0.rows(), w0.cols()));
                    hd.a.push_back(Mat::Zero(b, cfg.layer_in(l)));
                    hd.delta.push_back(Mat::Zero(b, cfg.layer_out(l)));
                    hd.z.push_back(Mat::Zero(b, cfg.layer_out(l)));
                    hd.hid.push_back(Mat::Zero(b, cfg.layer_out(l)));
                }
                hd.gates = Mat::Zero(b, 3);
                hd.t1 = Mat::Zero(b, widest);
                hd.t2 = Mat::Zero(b, widest);
                hd.scores = Mat::Zero(b, b);
                hd.G = Mat::Zero(b, b);
                hd.coef = Mat::Zero(8, b);
            }
        }
        const int tail = cfg.use_conv ? cfg.conv_kernel - 1 : 0;
        st.conv_tail_.assign(static_cast<std::size_t>(batch), Mat::Zero(tail, 3 * cfg.inner_dim()));
        return st;
    }

    /// math §1-5 over a piece: x (B*N) x d, y (B*N) x d (sized), diag optional. Throws
    /// NonFiniteError (naming the sequence, head and position) if an output or the new state
    /// would hold a NaN or an infinity; the state is then as it was before the call (or, inside
    /// an open transaction, as it was at the transaction's start: MemoryUndo).
    static void forward(const MemoryConfig& cfg, const Prepared& p, State& st,
                        View<const T> xv, View<T> yv, Diagnostics<T>* diag) {
        run(cfg, p, st, xv, yv, diag, nullptr);
    }

    /// What the training forward keeps of a call (math §9): per (sequence, head) pair
    /// s * H + h, the memory at every chunk start (for each chunk the L weights then the L
    /// momenta), and the projections before the conv (x [W_Q | W_K | W_V]) and the gate logits.
    struct Recording {
        std::vector<std::vector<Mat>> memory;
        Mat u, logits;
    };

private:
    template <class, class>
    friend struct MemoryTraining;

    /// forward(), keeping what *rec holds (rec->memory sized B * H) when given.
    static void run(const MemoryConfig& cfg, const Prepared& p, State& st, View<const T> xv,
                    View<T> yv, Diagnostics<T>* diag, Recording* rec) {
        const In x = cpu::as_eigen(xv);
        Out y = cpu::as_eigen(yv);
        if (diag != nullptr) {
            diag->loss.setZero(x.rows(), cfg.n_heads);
            diag->grad_norm.setZero(x.rows(), cfg.n_heads);
        }
        if (x.rows() == 0) {
            return;
        }
        const bool own = MemoryUndo<T>::begin(st);
        try {
            forward_piece(cfg, *p, st, x, y, diag, rec);
        } catch (...) {
            MemoryUndo<T>::rollback(st);
            throw;
        }
        if (own) {
            MemoryUndo<T>::commit(st);
        }
    }

public:

    /// Read-only retrieval: q path of math §1 for x (conv continuing the stream, tails not
    /// updated), y = M_{W_t}(q) per head with the memory after the last token, then W_O.
    static void read(const MemoryConfig& cfg, const Prepared& p, const State& st,
                     View<const T> x, View<T> y) {
        read_through(cfg, *p, cpu::as_eigen(x), st.batch_, &st.conv_tail_, cpu::as_eigen(y),
                     [&](int s, int h) { return materialise(cfg, st, s, h, true); });
    }

    /// Retrieval through given weights, without a state: the q path of math §1 without the
    /// conv, y = M_W(q) per (sequence, head) with W = weights[s * H + h], then W_O. x is
    /// (batch*N) x d. MAC reads its segment-start snapshot this way.
    static void read_weights(const MemoryConfig& cfg, const Prepared& p,
                             const std::vector<std::vector<Mat>>& weights, View<const T> x,
                             int batch, View<T> y) {
        read_through(cfg, *p, cpu::as_eigen(x), batch, nullptr, cpu::as_eigen(y),
                     [&](int s, int h) -> const std::vector<Mat>& {
                         return weights[static_cast<std::size_t>(s * cfg.n_heads + h)];
                     });
    }

    /// The weights of every pair now (MAC's segment start), and reads through them.
    using Snapshot = MemorySnapshot<T>;
    static void snapshot(const MemoryConfig& cfg, const State& st, Snapshot& out) {
        out.weights = all_weights(cfg, st);
        out.heads = cfg.n_heads;
    }
    static void read_snapshot(const MemoryConfig& cfg, const Prepared& p, const Snapshot& s,
                              View<const T> x, int batch, View<T> y) {
        read_weights(cfg, p, s.weights, x, batch, y);
    }
    /// A snapshot to and from host weights (the layout all_weights returns).
    static std::vector<std::vector<Mat>> snapshot_weights(const MemoryConfig&, const Snapshot& s) {
        return s.weights;
    }
    static Snapshot make_snapshot(const MemoryConfig& cfg, std::vector<std::vector<Mat>> w) {
        return Snapshot{std::move(w), cfg.n_heads};
    }

    /// Transactions over several forward calls (MemoryUndo): begin returns true if it opened one.
    static bool begin(State& st) { return MemoryUndo<T>::begin(st); }
    static void commit(State& st) { MemoryUndo<T>::commit(st); }
    static void rollback(State& st) { MemoryUndo<T>::rollback(st); }

    static std::vector<Mat> current_weights(const MemoryConfig& cfg, const State& st, int b,
                                            int h) {
        return materialise(cfg, st, b, h, true);
    }
    static std::vector<Mat> current_momentum(const MemoryConfig& cfg, const State& st, int b,
                                             int h) {
        return materialise(cfg, st, b, h, false);
    }
    static std::vector<std::vector<Mat>> all_weights(const MemoryConfig& cfg, const State& st) {
        std::vector<std::vector<Mat>> out;
        out.reserve(static_cast<std::size_t>(st.batch()) * static_cast<std::size_t>(cfg.n_heads));
        for (int b = 0; b < st.batch(); ++b) {
            for (int h = 0; h < cfg.n_heads; ++h) out.push_back(materialise(cfg, st, b, h, true));
        }
        return out;
    }

private:
    /// math §1's query path for x ((B*N) x d, N rows per sequence) into q ((B*N) x D):
    /// x W_Q, the conv continuing each sequence's tail when `tails` is given (not advanced),
    /// phi, the L2 norm per head.
    static void project_queries(const MemoryConfig& cfg, const MemoryParams<T>& p, const In& x,
                                Eigen::Index N, const std::vector<Mat>* tails, Mat& q) {
        const int D = cfg.inner_dim();
        q.resize(x.rows(), D);
        detail::multiply(q, x, p.w_q);
        if (cfg.use_conv && tails != nullptr) {
            for (std::size_t s = 0; s < tails->size(); ++s) {
                detail::causal_conv_in_place(p.conv_q, (*tails)[s].leftCols(D),
                                             q.middleRows(static_cast<Eigen::Index>(s) * N, N));
            }
        }
        if (cfg.qkv_activation == Activation::SiLU) {
            detail::activate_in_place(Activation::SiLU, q);
        }
        if (cfg.normalize_qk) {
            detail::l2_normalize_heads(q, cfg.n_heads, cfg.head_dim());
        }
    }

    /// read() and read_weights(): queries of x, each (sequence s, head h) read through the
    /// weights weights_of(s, h), then W_O into y ((B*N) x d).
    template <class WeightsOf>
    static void read_through(const MemoryConfig& cfg, const MemoryParams<T>& p, const In& x,
                             int B, const std::vector<Mat>* tails, Out y, WeightsOf&& weights_of) {
        const int H = cfg.n_heads, dh = cfg.head_dim();
        const Eigen::Index N = x.rows() / B;
        if (N == 0) {
            return;
        }
        Mat q;
        project_queries(cfg, p, x, N, tails, q);
        Mat yh(x.rows(), cfg.inner_dim());
        std::vector<Mat> hid;
        for (int l = 1; l <= cfg.depth; ++l) {
            hid.emplace_back(N, cfg.layer_out(l));
        }
        for (int s = 0; s < B; ++s) {
            for (int h = 0; h < H; ++h) {
                const Eigen::Index r0 = static_cast<Eigen::Index>(s) * N;
                auto yb = yh.block(r0, h * dh, N, dh);
                mlp_read(cfg, weights_of(s, h), q.block(r0, h * dh, N, dh),
                         static_cast<int>(N), hid, yb);
            }
        }
        detail::multiply(y, yh, p.w_o);
    }

    /// y = M_W(q) for m query rows (math §2): W[l] in turn, act between layers, + q if
    /// residual. hid holds one workspace per layer with >= m rows; y must not alias q.
    template <class Q, class Y>
    static void mlp_read(const MemoryConfig& cfg, const std::vector<Mat>& W, const Q& q, int m,
                         std::vector<Mat>& hid, Y& y) {
        const int L = cfg.depth;
        for (int l = 0; l < L; ++l) {
            const auto li = static_cast<std::size_t>(l);
            auto out = hid[li].topRows(m);
            if (l == 0) {
                out.noalias() = q * W[0];
            } else {
                out.noalias() = hid[li - 1].topRows(m) * W[li];
            }
            if (l + 1 < L) {
                detail::activate_in_place(cfg.activation, out);
            }
        }
        y = hid[static_cast<std::size_t>(L - 1)].topRows(m);
        if (cfg.residual) {
            y += q;
        }
    }

    /// Where one (sequence, head) finds its inputs in the piece's matrices.
    struct Inputs {
        const Mat& qkv;     // (B*N) x 3D: q | k | v
        const Mat& logits;  // (B*N) x 3H: theta | eta | alpha logits (empty if Constant)
        Eigen::Index r0;    // first row of the sequence
        int h, dh, D, H;
        auto q(Eigen::Index t, Eigen::Index m) const { return qkv.block(r0 + t, h * dh, m, dh); }
        auto k(Eigen::Index t, Eigen::Index m) const { return qkv.block(r0 + t, D + h * dh, m, dh); }
        auto v(Eigen::Index t, Eigen::Index m) const { return qkv.block(r0 + t, 2 * D + h * dh, m, dh); }
    };

    /// Where a forward call first went non-finite: the smallest absolute position over the
    /// (sequence, head) pairs, -1 if nowhere.
    struct Failure {
        std::int64_t position = -1;
        const char* what = "";
    };

    /// The body of forward(): projections, the per-head scans, the output projection, each
    /// checked for non-finite values before the position advances.
    static void forward_piece(const MemoryConfig& cfg, const MemoryParams<T>& p, State& st,
                              const In& x, Out& y, Diagnostics<T>* diag, Recording* rec) {
        const int B = st.batch_, H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        const Eigen::Index N = x.rows() / B;
        const std::int64_t pos0 = st.position_;
        Mat qkv, logits;
        project(cfg, p, st, x, N, qkv, logits, rec != nullptr ? &rec->u : nullptr);
        if (rec != nullptr) {
            rec->logits = logits;
        }
        if (!detail::all_finite(qkv) || !detail::all_finite(logits)) {
            throw_first_bad_row(qkv.cols() > 0 && !detail::all_finite(qkv) ? qkv : logits, N, pos0,
                                "the projections of x (q, k, v or gate logits) overflow");
        }
        // math §3-5: the memory, per (sequence, head), in parallel.
        Mat yh(x.rows(), D);
        const int pairs = B * H;
        std::vector<Failure> failed(static_cast<std::size_t>(pairs));
        // Threads only when the piece carries enough work: waking a team for a token or two
        // costs more than it saves (and far more on an oversubscribed machine).
        double work = 0;
        for (int l = 1; l <= cfg.depth; ++l) {
            work += static_cast<double>(cfg.layer_in(l)) * cfg.layer_out(l);
        }
        work *= static_cast<double>(N) * pairs;
        [[maybe_unused]] const bool parallel = pairs > 1 && work >= 2.5e5;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
#endif
        for (int bh = 0; bh < pairs; ++bh) {
            // OpenMP workers have their own floating-point environment.
            const detail::DenormalFlushScope flush(cfg.flush_denormals);
            const int s = bh / H, h = bh % H;
            const std::size_t i = st.index(s, h);
            const Inputs in{qkv, logits, static_cast<Eigen::Index>(s) * N, h, dh, D, H};
            Failure& f = failed[static_cast<std::size_t>(bh)];
            std::vector<Mat>* snap =
                rec != nullptr ? &rec->memory[static_cast<std::size_t>(bh)] : nullptr;
            if (cfg.update == UpdateMode::PerToken) {
                f = scan_per_token(cfg, st, i, in, N, pos0, yh, diag, snap);
            } else {
                f = scan_chunked(cfg, st, i, in, N, pos0, yh, diag, snap);
            }
        }
        throw_if_failed(failed, H);
        detail::multiply(y, yh, p.w_o);
        if (!detail::all_finite(y)) {
            throw_first_bad_row(y, N, pos0, "the output projection W_O overflows");
        }
        st.position_ += N;
    }

    /// math §1 for a piece: qkv = [q | k | v] after conv, phi and the L2 norm (the conv tails
    /// advance), gate logits (empty for constant gates); *u (if given) keeps x [W_Q|W_K|W_V].
    static void project(const MemoryConfig& cfg, const MemoryParams<T>& p, State& st, const In& x,
                        Eigen::Index N, Mat& qkv, Mat& logits, Mat* u) {
        const int H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        qkv.resize(x.rows(), 3 * D);
        detail::multiply_concat(qkv, x, std::array<const Mat*, 3>{&p.w_q, &p.w_k, &p.w_v});
        if (u != nullptr) {
            *u = qkv;
        }
        if (cfg.use_conv) {
            causal_conv(cfg, p, st, qkv, N);
        }
        if (cfg.qkv_activation == Activation::SiLU) {
            detail::activate_in_place(Activation::SiLU, qkv);
        }
        if (cfg.normalize_qk) {
            detail::l2_normalize_heads(qkv.leftCols(2 * D), 2 * H, dh);  // q and k heads
        }
        cpu::gate_logits(cfg, p, x, logits);
    }

    template <class M>
    [[noreturn]] static void throw_first_bad_row(const M& m, Eigen::Index N, std::int64_t pos0,
                                                 const char* what) {
        const Eigen::Index r = detail::first_nonfinite_row(m);
        throw NonFiniteError(detail::concat(
            "NeuralMemory::forward: ", what, " at sequence ", r / N, ", position ", pos0 + r % N,
            " (all heads), expected finite values; the state is unchanged"));
    }

    static void throw_if_failed(const std::vector<Failure>& failed, int H) {
        std::size_t first = failed.size();
        for (std::size_t i = 0; i < failed.size(); ++i) {
            if (failed[i].position >= 0 &&
                (first == failed.size() || failed[i].position < failed[first].position)) {
                first = i;
            }
        }
        if (first == failed.size()) {
            return;
        }
        const auto s = static_cast<int>(first) / H, h = static_cast<int>(first) % H;
        throw NonFiniteError(detail::concat(
            "NeuralMemory::forward: ", failed[first].what, " at sequence ", s, ", head ", h,
            ", position ", failed[first].position,
            ", expected finite values (the memory diverged; see max_grad_norm and theta_max); "
            "the state is unchanged"));
    }

    /// math §1 conv of each sequence's pre-conv q|k|v, in place, continuing from the state's
    /// tail (the last K-1 pre-conv rows), which is then advanced.
    static void causal_conv(const MemoryConfig& cfg, const MemoryParams<T>& p, State& st, Mat& qkv,
                            Eigen::Index N) {
        const int K = cfg.conv_kernel;
        Mat taps(K, qkv.cols());
        taps << p.conv_q, p.conv_k, p.conv_v;
        Mat new_tail(K - 1, qkv.cols());  // the last K-1 inputs of [old tail | u]
        for (int s = 0; s < st.batch_; ++s) {
            Mat& tail = st.conv_tail_[static_cast<std::size_t>(s)];
            auto u = qkv.middleRows(static_cast<Eigen::Index>(s) * N, N);
            for (int r = 0; r < K - 1; ++r) {
                const Eigen::Index t = N - (K - 1) + r;
                if (t >= 0) {
                    new_tail.row(r) = u.row(t);
                } else {
                    new_tail.row(r) = tail.row(t + K - 1);
                }
            }
            detail::causal_conv_in_place(taps, tail, u);
            tail = new_tail;
        }
    }

    /// Gate values (theta, eta, alpha) of pending rows [0, n) into coef rows 0..2.
    /// PerChunk: every row gets the gates of the mean logit (= gates of the mean input).
    static void gate_values(const MemoryConfig& cfg, const Head& hd, int n, Mat& coef) {
        for (int which = 0; which < 3; ++which) {
            auto g = coef.row(which).head(n);
            if (cfg.gates == GateMode::Constant) {
                g.setConstant(static_cast<T>(cfg.gate_constant(which)));
                continue;
            }
            const T scale = static_cast<T>(cfg.gate_scale(which));
            if (cfg.gates == GateMode::PerChunk) {
                g.setConstant(scale * detail::sigmoid(T(hd.gates.col(which).head(n).mean())));
                continue;
            }
            for (int i = 0; i < n; ++i) g(i) = scale * detail::sigmoid(hd.gates(i, which));
        }
    }

    /// Gate values of rows [0, n) (gate_values), then math §10's clipping: theta_i scaled by
    /// min(1, c / ||grad_i||), ||grad_i||^2 = sum_l ||a_{l-1,i}||^2 ||delta_{l,i}||^2 from the
    /// pending rows (the gradient at the weights it was taken at). Only theta changes, so the
    /// closed form (§4) and the dual form (§5) are unchanged.
    static void gates_clipped(const MemoryConfig& cfg, const Head& hd, int n, Mat& coef) {
        gate_values(cfg, hd, n, coef);
        if (cfg.max_grad_norm <= 0) {
            return;
        }
        const T c = static_cast<T>(cfg.max_grad_norm);
        for (int i = 0; i < n; ++i) {
            T g2 = T(0);
            for (std::size_t l = 0; l < hd.a.size(); ++l) {
                g2 += hd.a[l].row(i).squaredNorm() * hd.delta[l].row(i).squaredNorm();
            }
            if (g2 > c * c) {  // the plain sum where finite, else the scaled norm
                coef(0, i) *= g2 <= detail::largest_finite<T>()
                                  ? c / std::sqrt(g2)
                                  : detail::scaled_grad_norm_row(hd.a, hd.delta, i).clip_factor(c);
            }
        }
    }


    static void store_logits(const MemoryConfig& cfg, Head& hd, const Inputs& in, Eigen::Index t,
                             int row, int m) {
        if (cfg.gates == GateMode::Constant) {
            return;
        }
        for (int i = 0; i < m; ++i) {
            const Eigen::Index r = in.r0 + t + i;
            hd.gates(row + i, 0) = in.logits(r, in.h);
            hd.gates(row + i, 1) = in.logits(r, in.H + in.h);
            hd.gates(row + i, 2) = in.logits(r, 2 * in.H + in.h);
        }
    }

    /// Keys of tokens [t, t+m) forward through the memory's current weights W and backward
    /// through the loss (math §2), into workspace rows [o, o+m): A_{l-1} = a[l-1] (the layer
    /// inputs), Delta_l = delta[l-1] with Delta_L = M(k) - v and
    /// Delta_l = (Delta_{l+1} W_{l+1}^T) . act'(Z_l); z[l] keeps act'(Z_l) (rows [0, m)).
    static void key_pass(const MemoryConfig& cfg, Head& hd, const Inputs& in, Eigen::Index t,
                         int o, int m) {
        const int L = cfg.depth;
        hd.a[0].middleRows(o, m) = in.k(t, m);
        for (int l = 0; l < L; ++l) {
            const auto li = static_cast<std::size_t>(l);
            auto z = hd.z[li].topRows(m);
            z.noalias() = hd.a[li].middleRows(o, m) * hd.w[li];
            if (l + 1 < L) {
                detail::activate_and_grad(cfg.activation, z, hd.a[li + 1].middleRows(o, m),
                                          hd.t1.topLeftCorner(m, z.cols()));
            }
        }
        auto dL = hd.delta[static_cast<std::size_t>(L - 1)].middleRows(o, m);
        dL = hd.z[static_cast<std::size_t>(L - 1)].topRows(m) - in.v(t, m);
        if (cfg.residual) {
            dL += in.k(t, m);
        }
        for (int l = L - 1; l >= 1; --l) {
            const auto li = static_cast<std::size_t>(l);
            auto dl = hd.delta[li - 1].middleRows(o, m);
            dl.noalias() = hd.delta[li].middleRows(o, m) * hd.w[li].transpose();
            dl.array() *= hd.z[li - 1].topRows(m).array();
        }
    }

    /// Diagnostics of tokens [t, t+m) from workspace rows [o, o+m) after key_pass: the loss
    /// 1/2 ||Delta_L||^2 and the gradient norm sqrt(sum_l ||a_{l-1}||^2 ||delta_l||^2).
    static void record_surprise(const MemoryConfig& cfg, const Head& hd, const Inputs& in,
                                Eigen::Index t, int o, int m, Diagnostics<T>* diag) {
        if (diag == nullptr) {
            return;
        }
        const int L = cfg.depth;
        for (int i = 0; i < m; ++i) {
            const Eigen::Index r = in.r0 + t + i;
            diag->loss(r, in.h) =
                T(0.5) * hd.delta[static_cast<std::size_t>(L - 1)].row(o + i).squaredNorm();
            T g2 = T(0);
            for (int l = 0; l < L; ++l) {
                g2 += hd.a[static_cast<std::size_t>(l)].row(o + i).squaredNorm() *
                      hd.delta[static_cast<std::size_t>(l)].row(o + i).squaredNorm();
            }
            diag->grad_norm(r, in.h) = g2 <= detail::largest_finite<T>()
                                           ? std::sqrt(g2)
                                           : detail::scaled_grad_norm_row(hd.a, hd.delta, o + i).value();
        }
    }

    /// math §4 over tokens [t, t+m) of one (sequence, head), which sit at rows [o, o+m) of the
    /// chunk in progress: keys forward and backward at W^s (batched), retrieval, and the
    /// closed-form chunk end when the chunk completes.
    static void chunk_segment(const MemoryConfig& cfg, Head& hd, const Inputs& in, Eigen::Index t,
                              int o, int m, int b, Mat& yh, Diagnostics<T>* diag) {
        key_pass(cfg, hd, in, t, o, m);
        store_logits(cfg, hd, in, t, o, m);
        record_surprise(cfg, hd, in, t, o, m, diag);
        // math §5: retrieval.
        auto y = yh.block(in.r0 + t, in.h * in.dh, m, in.dh);
        if (cfg.retrieval == Retrieval::Lagged) {
            mlp_read(cfg, hd.w, in.q(t, m), m, hd.hid, y);
        } else {
            read_in_chunk(cfg, hd, in.q(t, m), o, m, y);
        }
        // math §4: chunk end.
        if (o + m == b) {
            apply_chunk_end(cfg, hd, b, hd.coef, hd.t1, hd.w, hd.s);
        }
    }

    /// math §5 dual form for query rows [o, o+m) of the chunk prefix n = o + m:
    /// Z_l = diag(beta) H W^s + diag(c) H S^s - (G . (H A_{l-1}^T)) Delta_l, H_l = act(Z_l).
    template <class Q, class Y>
    static void read_in_chunk(const MemoryConfig& cfg, Head& hd, const Q& q, int o, int m, Y& y) {
        const int L = cfg.depth, n = o + m;
        gates_clipped(cfg, hd, n, hd.coef);
        auto beta = hd.coef.row(3).head(m);
        auto c = hd.coef.row(4).head(m);
        chunk_row_coefficients<T>(n, o, hd.coef.row(0).data(), hd.coef.row(1).data(),
                                  hd.coef.row(2).data(), beta.data(), c.data(), hd.G.data());
        // hd.G is b x b row-major; the function wrote an m x n row-major block at its start.
        Eigen::Map<Mat> G(hd.G.data(), m, n);
        for (int l = 0; l < L; ++l) {
            const auto li = static_cast<std::size_t>(l);
            auto out = hd.hid[li].topRows(m);
            const int w_out = static_cast<int>(hd.w[li].cols());
            auto t1 = hd.t1.topLeftCorner(m, w_out);
            auto run = [&](const auto& Hin) {
                out.noalias() = Hin * hd.w[li];
                out = beta.transpose().asDiagonal() * out;
                t1.noalias() = Hin * hd.s[li];
                out.noalias() += c.transpose().asDiagonal() * t1;
                Eigen::Map<Mat> sc(hd.scores.data(), m, n);
                sc.noalias() = Hin * hd.a[li].topRows(n).transpose();
                sc.array() *= G.array();
                out.noalias() -= sc * hd.delta[li].topRows(n);
            };
            if (l == 0) {
                run(q);
            } else {
                // Copy the previous activations: `out` aliases hid[l], Hin must not.
                const int w_in = static_cast<int>(hd.w[li].rows());
                auto t2 = hd.t2.topLeftCorner(m, w_in);
                t2 = hd.hid[li - 1].topRows(m);
                run(t2);
            }
            if (l + 1 < L) {
                detail::activate_in_place(cfg.activation, out);
            }
        }
        y = hd.hid[static_cast<std::size_t>(L - 1)].topRows(m);
        if (cfg.residual) {
            y += q;
        }
    }

    /// Takes (W, S) from the chunk start over the n pending rows:
    /// W <- beta_n W + c_n S - A^T diag(g) Delta,  S <- P_n S - A^T diag(s) Delta.
    /// coef (8 x >= n) and scratch (>= n x widest) are workspaces; hd is only read.
    static void apply_chunk_end(const MemoryConfig& cfg, const Head& hd, int n, Mat& coef,
                                Mat& scratch, std::vector<Mat>& W, std::vector<Mat>& S) {
        gates_clipped(cfg, hd, n, coef);
        T beta_end, c_end, p_end;
        chunk_end_coefficients<T>(n, coef.row(0).data(), coef.row(1).data(), coef.row(2).data(),
                                  coef.row(5).data(), coef.row(6).data(), &beta_end, &c_end,
                                  &p_end);
        const auto g = coef.row(5).head(n);
        const auto s = coef.row(6).head(n);
        for (std::size_t l = 0; l < W.size(); ++l) {
            const auto A = hd.a[l].topRows(n);
            const auto Dl = hd.delta[l].topRows(n);
            auto sd = scratch.topLeftCorner(n, Dl.cols());
            sd = g.transpose().asDiagonal() * Dl;
            W[l] *= beta_end;
            W[l] += c_end * S[l];
            W[l].noalias() -= A.transpose() * sd;
            sd = s.transpose().asDiagonal() * Dl;
            S[l] *= p_end;
            S[l].noalias() -= A.transpose() * sd;
        }
    }

    /// math §4 over the piece for pair i, chunk segment by chunk segment, saving what it
    /// overwrites (MemoryUndo) and stopping at the first non-finite output, pending row or
    /// chunk-end state.
    static Failure scan_chunked(const MemoryConfig& cfg, State& st, std::size_t i,
                                const Inputs& in, Eigen::Index N, std::int64_t pos0, Mat& yh,
                                Diagnostics<T>* diag, std::vector<Mat>* snap) {
        const int b = cfg.chunk;
        Head& hd = st.heads_[i];
        Eigen::Index t = 0;
        while (t < N) {
            const int o = static_cast<int>((pos0 + t) % b);
            const int m = static_cast<int>(std::min<Eigen::Index>(b - o, N - t));
            MemoryUndo<T>::save_rows(st, i, o, m);
            if (snap != nullptr && o == 0) {
                keep_memory(hd, *snap);
            }
            if (o + m == b) {
                MemoryUndo<T>::save_weights(st, i);
            }
            chunk_segment(cfg, hd, in, t, o, m, b, yh, diag);
            const auto bad = detail::first_nonfinite_row(yh.block(in.r0 + t, in.h * in.dh, m, in.dh));
            if (bad < m) {
                return {pos0 + t + bad, "a non-finite memory read"};
            }
            for (std::size_t l = 0; l < hd.a.size(); ++l) {
                if (!detail::all_finite(hd.a[l].middleRows(o, m)) ||
                    !detail::all_finite(hd.delta[l].middleRows(o, m))) {
                    return {pos0 + t + detail::first_nonfinite_row(hd.delta[l].middleRows(o, m)),
                            "a non-finite key activation or error (surprise)"};
                }
            }
            if (o + m == b && !weights_finite(hd)) {
                return {pos0 + t + m - 1, "non-finite memory weights or momentum at a chunk end"};
            }
            t += m;
        }
        return {};
    }

    static void keep_memory(const Head& hd, std::vector<Mat>& snap) {
        snap.insert(snap.end(), hd.w.begin(), hd.w.end());
        snap.insert(snap.end(), hd.s.begin(), hd.s.end());
    }

    static bool weights_finite(const Head& hd) {
        for (std::size_t l = 0; l < hd.w.size(); ++l) {
            if (!detail::all_finite(hd.w[l]) || !detail::all_finite(hd.s[l])) {
                return false;
            }
        }
        return true;
    }

    /// math §3, token by token with true gradients at M_{t-1}: the reference path and b = 1.
    static Failure scan_per_token(const MemoryConfig& cfg, State& st, std::size_t i,
                                  const Inputs& in, Eigen::Index N, std::int64_t pos0, Mat& yh,
                                  Diagnostics<T>* diag, std::vector<Mat>* snap) {
        MemoryUndo<T>::save_weights(st, i);
        Head& hd = st.heads_[i];
        for (Eigen::Index t = 0; t < N; ++t) {
            if (snap != nullptr) {
                keep_memory(hd, *snap);
            }
            per_token_step(cfg, hd, in, t, yh, diag);
        }
        const auto bad = detail::first_nonfinite_row(yh.block(in.r0, in.h * in.dh, N, in.dh));
        if (bad < N) {
            return {pos0 + bad, "a non-finite memory read"};
        }
        if (!weights_finite(hd)) {
            return {pos0 + N - 1, "non-finite memory weights or momentum"};
        }
        return {};
    }

    /// One token of math §3: read (lagged), gradient at M_{t-1}, update, read (in-chunk).
    static void per_token_step(const MemoryConfig& cfg, Head& hd, const Inputs& in, Eigen::Index t,
                               Mat& yh, Diagnostics<T>* diag) {
        const int L = cfg.depth;
        store_logits(cfg, hd, in, t, 0, 1);
        auto y = yh.block(in.r0 + t, in.h * in.dh, 1, in.dh);
        if (cfg.retrieval == Retrieval::Lagged) {
            mlp_read(cfg, hd.w, in.q(t, 1), 1, hd.hid, y);
        }
        // Forward and backward of the key at M_{t-1} (row 0 of the workspaces).
        key_pass(cfg, hd, in, t, 0, 1);
        record_surprise(cfg, hd, in, t, 0, 1, diag);
        // S_t = eta S_{t-1} - theta a^T delta;  M_t = (1 - alpha) M_{t-1} + S_t.
        gates_clipped(cfg, hd, 1, hd.coef);
        const T theta = hd.coef(0, 0), eta = hd.coef(1, 0), alpha = hd.coef(2, 0);
        for (int l = 0; l < L; ++l) {
            const auto li = static_cast<std::size_t>(l);
            hd.s[li] *= eta;
            hd.s[li].noalias() -= (theta * hd.a[li].row(0).transpose()) * hd.delta[li].row(0);
            hd.w[li] *= (T(1) - alpha);
            hd.w[li] += hd.s[li];
        }
        if (cfg.retrieval == Retrieval::InChunk) {
            mlp_read(cfg, hd.w, in.q(t, 1), 1, hd.hid, y);
        }
    }

    static std::vector<Mat> materialise(const MemoryConfig& cfg, const State& st, int b, int h,
                                        bool weights) {
        const Head& src = st.heads_[st.index(b, h)];
        const int n = st.pending();
        if (n == 0) {
            return weights ? src.w : src.s;
        }
        Mat coef(src.coef.rows(), src.coef.cols()), scratch(src.t1.rows(), src.t1.cols());
        std::vector<Mat> W = src.w, S = src.s;
        apply_chunk_end(cfg, src, n, coef, scratch, W, S);
        return weights ? W : S;
    }
};

}  // namespace titans::backend
