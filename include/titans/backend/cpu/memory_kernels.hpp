#pragma once
// titans/backend/cpu/memory_kernels.hpp: the neural memory on the CPU (SPEC §1-5).
//
// Per forward call: one GEMM per projection over the whole piece, the causal conv and gates,
// then, independently per (sequence, head) and in parallel, the memory scan: chunks at
// absolute positions, each chunk (or the part of it in this piece) processed with batched
// products (SPEC §4) and read in lagged or in-chunk (dual) form (SPEC §5), and finally the
// output projection. The per-token recurrence (SPEC §3) is a separate, plain loop.

#include <algorithm>
#include <cmath>
#include <vector>

#include "../../detail/activation.hpp"
#include "../../detail/eigen_math.hpp"
#include "../../detail/float_env.hpp"
#include "../../error.hpp"
#include "../../memory/chunk_coefficients.hpp"
#include "../../memory/config.hpp"
#include "../../memory/diagnostics.hpp"
#include "../../memory/params.hpp"
#include "memory_state.hpp"

namespace titans::backend {

struct Cpu;

template <class T>
struct MemoryKernels<Cpu, T> {
    using State = MemoryState<T>;
    using Head = typename State::Head;
    using Mat = Matrix<T>;

    static State make_state(const MemoryConfig& cfg, const MemoryParams<T>& p, int batch) {
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

    /// SPEC §1-5 over a piece: x (B*N) x d, y (B*N) x d (resized), diag optional.
    static void forward(const MemoryConfig& cfg, const MemoryParams<T>& p, State& st,
                        const Mat& x, Mat& y, Diagnostics<T>* diag) {
        const int B = st.batch_, H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        const Eigen::Index N = x.rows() / B;
        y.resize(x.rows(), cfg.d_model);
        if (diag != nullptr) {
            diag->loss.setZero(x.rows(), H);
            diag->grad_norm.setZero(x.rows(), H);
        }
        if (N == 0) {
            return;
        }
        // SPEC §1: projections, conv, phi, L2 norm; gate logits.
        Mat qkv(x.rows(), 3 * D);
        qkv.leftCols(D).noalias() = x * p.w_q;
        qkv.middleCols(D, D).noalias() = x * p.w_k;
        qkv.rightCols(D).noalias() = x * p.w_v;
        if (cfg.use_conv) {
            causal_conv(cfg, p, st, qkv, N);
        }
        if (cfg.qkv_activation == Activation::SiLU) {
            detail::activate_in_place(Activation::SiLU, qkv);
        }
        if (cfg.normalize_qk) {
            detail::l2_normalize_heads(qkv.leftCols(2 * D), 2 * H, dh);  // q and k heads
        }
        Mat logits;
        if (cfg.gates != GateMode::Constant) {
            logits.resize(x.rows(), 3 * H);
            logits.leftCols(H).noalias() = x * p.w_theta;
            logits.middleCols(H, H).noalias() = x * p.w_eta;
            logits.rightCols(H).noalias() = x * p.w_alpha;
            logits.leftCols(H).rowwise() += p.b_theta;
            logits.middleCols(H, H).rowwise() += p.b_eta;
            logits.rightCols(H).rowwise() += p.b_alpha;
        }
        // SPEC §3-5: the memory, per (sequence, head), in parallel.
        Mat yh(x.rows(), D);
        const int pairs = B * H;
        const std::int64_t pos0 = st.position_;
        // Threads only when the piece carries enough work: waking a team for a token or two
        // costs more than it saves (and far more on an oversubscribed machine).
        double work = 0;
        for (int l = 1; l <= cfg.depth; ++l) {
            work += static_cast<double>(cfg.layer_in(l)) * cfg.layer_out(l);
        }
        work *= static_cast<double>(N) * pairs;
        [[maybe_unused]] const bool parallel = pairs > 1 && work >= 1.0e6;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
#endif
        for (int bh = 0; bh < pairs; ++bh) {
            // OpenMP workers have their own floating-point environment.
            const detail::DenormalFlushScope flush(cfg.flush_denormals);
            const int s = bh / H, h = bh % H;
            Head& hd = st.heads_[st.index(s, h)];
            const Eigen::Index r0 = static_cast<Eigen::Index>(s) * N;
            Inputs in{qkv, logits, r0, h, dh, D, H};
            if (cfg.update == UpdateMode::PerToken) {
                scan_per_token(cfg, hd, in, N, yh, diag);
            } else {
                scan_chunked(cfg, hd, in, N, pos0, yh, diag);
            }
        }
        st.position_ += N;
        y.noalias() = yh * p.w_o;
    }

    /// Read-only retrieval: q path of SPEC §1 for x (conv continuing the stream, tails not
    /// updated), y = M_{W_t}(q) per head with the memory after the last token, then W_O.
    static void read(const MemoryConfig& cfg, const MemoryParams<T>& p, const State& st,
                     const Mat& x, Mat& y) {
        const int B = st.batch_, H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        const Eigen::Index N = x.rows() / B;
        y.resize(x.rows(), cfg.d_model);
        if (N == 0) {
            return;
        }
        Mat q = x * p.w_q;
        if (cfg.use_conv) {
            for (int s = 0; s < B; ++s) {
                detail::causal_conv_in_place(
                    p.conv_q, st.conv_tail_[static_cast<std::size_t>(s)].leftCols(D),
                    q.middleRows(static_cast<Eigen::Index>(s) * N, N));
            }
        }
        if (cfg.qkv_activation == Activation::SiLU) {
            detail::activate_in_place(Activation::SiLU, q);
        }
        if (cfg.normalize_qk) {
            detail::l2_normalize_heads(q, H, dh);
        }
        Mat yh(x.rows(), D);
        for (int s = 0; s < B; ++s) {
            for (int h = 0; h < H; ++h) {
                const std::vector<Mat> W = materialise(cfg, st, s, h, true);
                Mat a = q.block(static_cast<Eigen::Index>(s) * N, h * dh, N, dh);
                const Mat q0 = a;
                for (std::size_t l = 0; l < W.size(); ++l) {
                    Mat z = a * W[l];
                    if (l + 1 < W.size()) {
                        detail::activate_in_place(cfg.activation, z);
                    }
                    a = std::move(z);
                }
                if (cfg.residual) {
                    a += q0;
                }
                yh.block(static_cast<Eigen::Index>(s) * N, h * dh, N, dh) = a;
            }
        }
        y.noalias() = yh * p.w_o;
    }

    static std::vector<Mat> current_weights(const MemoryConfig& cfg, const State& st, int b,
                                            int h) {
        return materialise(cfg, st, b, h, true);
    }
    static std::vector<Mat> current_momentum(const MemoryConfig& cfg, const State& st, int b,
                                             int h) {
        return materialise(cfg, st, b, h, false);
    }

private:
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

    /// SPEC §1 conv of each sequence's pre-conv q|k|v, in place, continuing from the state's
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
        auto th = coef.row(0), et = coef.row(1), al = coef.row(2);
        if (cfg.gates == GateMode::Constant) {
            th.head(n).setConstant(static_cast<T>(cfg.constant_theta));
            et.head(n).setConstant(static_cast<T>(cfg.constant_eta));
            al.head(n).setConstant(static_cast<T>(cfg.constant_alpha));
            return;
        }
        const T tmax = static_cast<T>(cfg.theta_max);
        if (cfg.gates == GateMode::PerChunk) {
            const T lt = hd.gates.col(0).head(n).mean(), le = hd.gates.col(1).head(n).mean(),
                    la = hd.gates.col(2).head(n).mean();
            th.head(n).setConstant(tmax * detail::sigmoid(lt));
            et.head(n).setConstant(detail::sigmoid(le));
            al.head(n).setConstant(detail::sigmoid(la));
            return;
        }
        for (int i = 0; i < n; ++i) {
            th(i) = tmax * detail::sigmoid(hd.gates(i, 0));
            et(i) = detail::sigmoid(hd.gates(i, 1));
            al(i) = detail::sigmoid(hd.gates(i, 2));
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

    /// SPEC §4 over tokens [t, t+m) of one (sequence, head), which sit at rows [o, o+m) of the
    /// chunk in progress: keys forward and backward at W^s (batched), retrieval, and the
    /// closed-form chunk end when the chunk completes.
    static void chunk_segment(const MemoryConfig& cfg, Head& hd, const Inputs& in, Eigen::Index t,
                              int o, int m, int b, Mat& yh, Diagnostics<T>* diag) {
        const int L = cfg.depth;
        const Activation act = cfg.activation;
        // Forward the keys through W^s, keeping A_{l-1} (pending rows) and act'(Z_l).
        hd.a[0].middleRows(o, m) = in.k(t, m);
        for (int l = 0; l < L; ++l) {
            auto z = hd.z[static_cast<std::size_t>(l)].topRows(m);
            z.noalias() = hd.a[static_cast<std::size_t>(l)].middleRows(o, m) * hd.w[static_cast<std::size_t>(l)];
            if (l + 1 < L) {
                detail::activate_and_grad(act, z, hd.a[static_cast<std::size_t>(l + 1)].middleRows(o, m),
                                  hd.t1.topLeftCorner(m, z.cols()));
            }
        }
        // Delta_L = M(k) - v, then back-propagate: Delta_l = (Delta_{l+1} W_{l+1}^T) . act'(Z_l).
        {
            auto dL = hd.delta[static_cast<std::size_t>(L - 1)].middleRows(o, m);
            dL = hd.z[static_cast<std::size_t>(L - 1)].topRows(m) - in.v(t, m);
            if (cfg.residual) {
                dL += in.k(t, m);
            }
        }
        for (int l = L - 1; l >= 1; --l) {
            auto dl = hd.delta[static_cast<std::size_t>(l - 1)].middleRows(o, m);
            dl.noalias() = hd.delta[static_cast<std::size_t>(l)].middleRows(o, m) *
                           hd.w[static_cast<std::size_t>(l)].transpose();
            dl.array() *= hd.z[static_cast<std::size_t>(l - 1)].topRows(m).array();
        }
        store_logits(cfg, hd, in, t, o, m);
        if (diag != nullptr) {
            for (int i = 0; i < m; ++i) {
                const Eigen::Index r = in.r0 + t + i;
                const T dn = hd.delta[static_cast<std::size_t>(L - 1)].row(o + i).squaredNorm();
                diag->loss(r, in.h) = T(0.5) * dn;
                T g2 = T(0);
                for (int l = 0; l < L; ++l) {
                    g2 += hd.a[static_cast<std::size_t>(l)].row(o + i).squaredNorm() *
                          hd.delta[static_cast<std::size_t>(l)].row(o + i).squaredNorm();
                }
                diag->grad_norm(r, in.h) = std::sqrt(g2);
            }
        }
        // SPEC §5: retrieval.
        auto y = yh.block(in.r0 + t, in.h * in.dh, m, in.dh);
        if (cfg.retrieval == Retrieval::Lagged) {
            read_lagged(cfg, hd, in.q(t, m), m, y);
        } else {
            read_in_chunk(cfg, hd, in.q(t, m), o, m, y);
        }
        // SPEC §4: chunk end.
        if (o + m == b) {
            apply_chunk_end(cfg, hd, b, hd.coef, hd.t1, hd.w, hd.s);
        }
    }

    /// y = M_{W^s}(q) for m query rows.
    template <class Q, class Y>
    static void read_lagged(const MemoryConfig& cfg, Head& hd, const Q& q, int m, Y& y) {
        const int L = cfg.depth;
        for (int l = 0; l < L; ++l) {
            auto out = hd.hid[static_cast<std::size_t>(l)].topRows(m);
            if (l == 0) {
                out.noalias() = q * hd.w[0];
            } else {
                out.noalias() = hd.hid[static_cast<std::size_t>(l - 1)].topRows(m) * hd.w[static_cast<std::size_t>(l)];
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

    /// SPEC §5 dual form for query rows [o, o+m) of the chunk prefix n = o + m:
    /// Z_l = diag(beta) H W^s + diag(c) H S^s - (G . (H A_{l-1}^T)) Delta_l, H_l = act(Z_l).
    template <class Q, class Y>
    static void read_in_chunk(const MemoryConfig& cfg, Head& hd, const Q& q, int o, int m, Y& y) {
        const int L = cfg.depth, n = o + m;
        gate_values(cfg, hd, n, hd.coef);
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
        gate_values(cfg, hd, n, coef);
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

    static void scan_chunked(const MemoryConfig& cfg, Head& hd, const Inputs& in, Eigen::Index N,
                             std::int64_t pos0, Mat& yh, Diagnostics<T>* diag) {
        const int b = cfg.chunk;
        Eigen::Index t = 0;
        while (t < N) {
            const int o = static_cast<int>((pos0 + t) % b);
            const int m = static_cast<int>(std::min<Eigen::Index>(b - o, N - t));
            chunk_segment(cfg, hd, in, t, o, m, b, yh, diag);
            t += m;
        }
    }

    /// SPEC §3, token by token with true gradients at M_{t-1}: the reference path and b = 1.
    static void scan_per_token(const MemoryConfig& cfg, Head& hd, const Inputs& in, Eigen::Index N,
                               Mat& yh, Diagnostics<T>* diag) {
        const int L = cfg.depth;
        const Activation act = cfg.activation;
        for (Eigen::Index t = 0; t < N; ++t) {
            store_logits(cfg, hd, in, t, 0, 1);
            gate_values(cfg, hd, 1, hd.coef);
            const T theta = hd.coef(0, 0), eta = hd.coef(1, 0), alpha = hd.coef(2, 0);
            auto y = yh.block(in.r0 + t, in.h * in.dh, 1, in.dh);
            if (cfg.retrieval == Retrieval::Lagged) {
                read_lagged(cfg, hd, in.q(t, 1), 1, y);
            }
            // Forward and backward of the key at M_{t-1} (row 0 of the workspaces).
            hd.a[0].row(0) = in.k(t, 1);
            for (int l = 0; l < L; ++l) {
                const auto li = static_cast<std::size_t>(l);
                auto z = hd.z[li].row(0);
                z.noalias() = hd.a[li].row(0) * hd.w[li];
                if (l + 1 < L) {
                    detail::activate_and_grad(act, z, hd.a[li + 1].row(0), hd.t1.row(0).head(z.cols()));
                }
            }
            auto dL = hd.delta[static_cast<std::size_t>(L - 1)].row(0);
            dL = hd.z[static_cast<std::size_t>(L - 1)].row(0) - in.v(t, 1);
            if (cfg.residual) {
                dL += in.k(t, 1);
            }
            for (int l = L - 1; l >= 1; --l) {
                const auto li = static_cast<std::size_t>(l);
                auto dl = hd.delta[li - 1].row(0);
                dl.noalias() = hd.delta[li].row(0) * hd.w[li].transpose();
                dl.array() *= hd.z[li - 1].row(0).array();
            }
            if (diag != nullptr) {
                const Eigen::Index r = in.r0 + t;
                diag->loss(r, in.h) = T(0.5) * dL.squaredNorm();
                T g2 = T(0);
                for (int l = 0; l < L; ++l) {
                    g2 += hd.a[static_cast<std::size_t>(l)].row(0).squaredNorm() *
                          hd.delta[static_cast<std::size_t>(l)].row(0).squaredNorm();
                }
                diag->grad_norm(r, in.h) = std::sqrt(g2);
            }
            // S_t = eta S_{t-1} - theta a^T delta;  M_t = (1 - alpha) M_{t-1} + S_t.
            for (int l = 0; l < L; ++l) {
                const auto li = static_cast<std::size_t>(l);
                hd.s[li] *= eta;
                hd.s[li].noalias() -= (theta * hd.a[li].row(0).transpose()) * hd.delta[li].row(0);
                hd.w[li] *= (T(1) - alpha);
                hd.w[li] += hd.s[li];
            }
            if (cfg.retrieval == Retrieval::InChunk) {
                read_lagged(cfg, hd, in.q(t, 1), 1, y);
            }
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
