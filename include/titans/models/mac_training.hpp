#pragma once
// titans/models/mac_training.hpp: the training pass of MAC's mixer (math §9, "MAC"). Per
// segment S of C tokens (u's rows [t0, t0 + m) of every stream):
//     h = M*_{W(t0)}(S)       the memory as it was after t0 tokens, read through W_Q (no conv)
//     y = Attn(q_S; P ‖ h ‖ S) W_O   (keys and values of h_i and s_i interleaved, causal)
//     r = M(y)                the memory written with y (in-chunk read), one stream over all y
//     o = y ⊙ σ(r)
// The forward keeps per segment the weights read, h, y and r, and grows one memory trace over
// the whole stream of y. The backward runs the memory's reverse sweep in stages
// (MemoryTraining::Reverse): last segment first, it reverses the memory rows of the segment
// (their dL/dy final, since every later use of y is already reversed), then the gate, the
// attention and the read of h, whose weights' adjoint it adds to the sweep at t0, the memory
// after t0 tokens, before going below t0.

#include <cstddef>
#include <utility>
#include <vector>

#include "../attention/kernel_backward.hpp"
#include "../attention/rope.hpp"
#include "../detail/activation.hpp"
#include "../detail/float_env.hpp"
#include "block.hpp"
#include "mac_trace.hpp"

namespace titans {

namespace detail {

/// MAC's training forward and backward (a friend of Block, BlockState and NeuralMemory).
template <class T, class Backend>
struct MacTraining {
    using Blk = Block<T, Backend>;
    using State = BlockState<T, Backend>;
    using MemoryPass = backend::MemoryTraining<Backend, T>;
    using MemoryTrace = typename NeuralMemory<T, Backend>::Trace;
    using Layers = std::vector<Matrix<T>>;

    /// The mixer on u ((B*N) x d) from next's fresh memory, as Block::mix_mac computes it;
    /// fills mem (one trace over all y) and segs.
    static Matrix<T> forward(const Blk& blk, State& next, const Matrix<T>& u, MemoryTrace& mem,
                             std::vector<MacSegmentTrace<T>>& segs) {
        const BlockConfig& cfg = blk.cfg_;
        const int B = next.batch_, C = cfg.segment, H = cfg.memory.n_heads;
        const Eigen::Index N = u.rows() / B;
        const NeuralMemory<T, Backend>& memory = blk.memory_;
        const DenormalFlushScope flush(cfg.memory.flush_denormals);
        next.memory_ = memory.make_state(B);
        MemoryPass::start(cfg.memory, B, N, cfg.d_model, mem);
        Matrix<T> out(u.rows(), cfg.d_model);
        for (Eigen::Index t0 = 0; t0 < N; t0 += C) {
            const Eigen::Index m = std::min<Eigen::Index>(C, N - t0);
            MacSegmentTrace<T> sg;
            for (int b = 0; b < B; ++b) {
                for (int h = 0; h < H; ++h) {
                    sg.weights.push_back(memory.current_weights(next.memory_, b, h));
                }
            }
            const Matrix<T> U = segment_rows(u, B, t0, m);
            sg.h = memory.read_weights(sg.weights, U, B);
            sg.y = blk.mac_attend(next, U, sg.h, 0, static_cast<int>(m), t0);
            sg.r.resize(sg.y.rows(), cfg.d_model);
            MemoryPass::forward_part(cfg.memory, memory.prepared_, next.memory_,
                                     view_of(std::as_const(sg.y)), view_of(sg.r), mem);
            const Matrix<T> o = (sg.y.array() * sg.r.unaryExpr([](T v) { return sigmoid(v); })
                                                     .array())
                                    .matrix();
            for (int b = 0; b < B; ++b) {
                out.middleRows(b * N + t0, m) = o.middleRows(b * m, m);
            }
            segs.push_back(std::move(sg));
        }
        if (!segs.empty()) {  // the state keeps the last segment's start weights
            next.snapshot_ = segs.back().weights;
        }
        return out;
    }

    /// The mixer's backward: dout (B*N x d) -> du; parameter gradients added to g.
    static Matrix<T> backward(const Blk& blk, const MemoryTrace& mem,
                              const std::vector<MacSegmentTrace<T>>& segs, const Matrix<T>& u,
                              int B, const Matrix<T>& dout, BlockParams<T>& g) {
        const BlockConfig& cfg = blk.cfg_;
        const int C = cfg.segment;
        const Eigen::Index N = u.rows() / B;
        const NeuralMemory<T, Backend>& memory = blk.memory_;
        if (N == 0) {
            return Matrix<T>(0, cfg.d_model);  // an empty piece: no rows, no gradient
        }
        const DenormalFlushScope flush(cfg.memory.flush_denormals);
        // o = y ⊙ σ(r): dr = dout ⊙ y ⊙ σ'(r) for the memory, dy's direct part dout ⊙ σ(r).
        Matrix<T> dr(u.rows(), cfg.d_model), dy_gate(u.rows(), cfg.d_model);
        for (std::size_t k = 0; k < segs.size(); ++k) {
            const Eigen::Index t0 = static_cast<Eigen::Index>(k) * C;
            const Matrix<T> d = segment_rows(dout, B, t0, segs[k].y.rows() / B);
            const Matrix<T> s = segs[k].r.unaryExpr([](T v) { return sigmoid(v); });
            const Eigen::Index m = d.rows() / B;
            for (int b = 0; b < B; ++b) {
                const auto rows = [&](const Matrix<T>& a) { return a.middleRows(b * m, m).array(); };
                dr.middleRows(b * N + t0, m) =
                    (rows(d) * rows(segs[k].y) * rows(s) * (T(1) - rows(s))).matrix();
                dy_gate.middleRows(b * N + t0, m) = (rows(d) * rows(s)).matrix();
            }
        }
        typename MemoryPass::Reverse rev(cfg.memory, memory.prepared_, mem, view_of(std::as_const(dr)));
        Matrix<T> du = Matrix<T>::Zero(u.rows(), cfg.d_model);
        for (std::size_t k = segs.size(); k-- > 0;) {
            const MacSegmentTrace<T>& sg = segs[k];
            const Eigen::Index t0 = static_cast<Eigen::Index>(k) * C, m = sg.y.rows() / B;
            Matrix<T> dy;
            rev.down_to(t0, dy);
            dy += segment_rows(dy_gate, B, t0, m);
            const Matrix<T> U = segment_rows(u, B, t0, m);
            Matrix<T> dU, dh, dU_read;
            attend_backward(blk, sg, U, B, t0, dy, dU, dh, g);
            std::vector<Layers> dW;
            MemoryPass::read_weights_backward(cfg.memory, memory.prepared_, sg.weights, U, B, dh,
                                              dU_read, dW, g.memory);
            rev.tap(dW);
            dU += dU_read;
            add_segment_rows(dU, B, t0, du);
        }
        rev.finish(g.memory);
        return du;
    }

private:
    /// The reverse of Block::mac_attend for one segment at t0 (offset 0): dy -> dU, dh and the
    /// attention's and P's gradients (added to g).
    static void attend_backward(const Blk& blk, const MacSegmentTrace<T>& sg, const Matrix<T>& U,
                                int B, Eigen::Index t0, const Matrix<T>& dy, Matrix<T>& dU,
                                Matrix<T>& dh, BlockParams<T>& g) {
        const BlockConfig& cfg = blk.cfg_;
        const int Ha = cfg.attention.n_heads, dha = cfg.attention.head_dim();
        const Eigen::Index D = cfg.attention.inner_dim(), m = U.rows() / B, np = blk.k_prefix_.rows();
        const AttentionParams<T>& ap = blk.params_->attention;
        AttentionParams<T>& ga = g.attention;
        Matrix<T> qs = U * ap.w_q, ks = U * ap.w_k;
        const Matrix<T> vs = U * ap.w_v, kh = sg.h * ap.w_k, vh = sg.h * ap.w_v;
        const RopeTable<T> table(cfg.attention.rope ? m : 0, dha, t0, cfg.attention.rope_base);
        Matrix<T> att(U.rows(), D), dq(U.rows(), D), dks(U.rows(), D), dvs(U.rows(), D),
            dkh(U.rows(), D), dvh(U.rows(), D);
        Matrix<T> dkp = Matrix<T>::Zero(np, D), dvp = Matrix<T>::Zero(np, D);
        const Matrix<T> datt = dy * ap.w_o.transpose();
        for (int b = 0; b < B; ++b) {
            const Eigen::Index r0 = b * m;
            if (cfg.attention.rope) {
                table.apply(qs.middleRows(r0, m), Ha, dha);
                table.apply(ks.middleRows(r0, m), Ha, dha);
            }
            Matrix<T> sk(2 * m, D), sv(2 * m, D);  // [h_0, s_0, h_1, s_1, ...]
            for (Eigen::Index i = 0; i < m; ++i) {
                sk.row(2 * i) = kh.row(r0 + i);
                sk.row(2 * i + 1) = ks.row(r0 + i);
                sv.row(2 * i) = vh.row(r0 + i);
                sv.row(2 * i + 1) = vs.row(r0 + i);
            }
            prefix_window_attention<T>(qs.middleRows(r0, m), blk.k_prefix_, blk.v_prefix_, sk, sv,
                                       Ha, dha, 2 * cfg.segment, 1, att.middleRows(r0, m), 2);
            Matrix<T> dq_b, dkp_b = Matrix<T>::Zero(np, D), dvp_b = Matrix<T>::Zero(np, D);
            Matrix<T> dsk = Matrix<T>::Zero(2 * m, D), dsv = Matrix<T>::Zero(2 * m, D);
            prefix_window_attention_backward<T>(qs.middleRows(r0, m), blk.k_prefix_, blk.v_prefix_,
                                                sk, sv, Ha, dha, 2 * cfg.segment, 1,
                                                datt.middleRows(r0, m), dq_b, dkp_b, dvp_b, dsk,
                                                dsv, 2);
            dq.middleRows(r0, m) = dq_b;
            dkp += dkp_b;
            dvp += dvp_b;
            for (Eigen::Index i = 0; i < m; ++i) {
                dkh.row(r0 + i) = dsk.row(2 * i);
                dks.row(r0 + i) = dsk.row(2 * i + 1);
                dvh.row(r0 + i) = dsv.row(2 * i);
                dvs.row(r0 + i) = dsv.row(2 * i + 1);
            }
            if (cfg.attention.rope) {
                table.apply_transpose(dq.middleRows(r0, m), Ha, dha);
                table.apply_transpose(dks.middleRows(r0, m), Ha, dha);
            }
        }
        ga.w_o.noalias() += att.transpose() * dy;
        ga.w_q.noalias() += U.transpose() * dq;
        ga.w_k.noalias() += U.transpose() * dks + sg.h.transpose() * dkh;
        ga.w_v.noalias() += U.transpose() * dvs + sg.h.transpose() * dvh;
        dU.noalias() = dq * ap.w_q.transpose() + dks * ap.w_k.transpose() + dvs * ap.w_v.transpose();
        dh.noalias() = dkh * ap.w_k.transpose() + dvh * ap.w_v.transpose();
        if (np > 0) {  // k_P = P W_K, v_P = P W_V
            const Matrix<T>& P = blk.params_->persistent;
            ga.w_k.noalias() += P.transpose() * dkp;
            ga.w_v.noalias() += P.transpose() * dvp;
            g.persistent.noalias() += dkp * ap.w_k.transpose() + dvp * ap.w_v.transpose();
        }
    }
};

}  // namespace detail

}  // namespace titans
