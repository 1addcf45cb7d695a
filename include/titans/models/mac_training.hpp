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
#include <string>
#include <utility>
#include <vector>

#include "../attention/segment.hpp"
#include "../attention/segment_backward.hpp"
#include "../detail/activation.hpp"
#include "../detail/float_env.hpp"
#include "../detail/rows.hpp"
#include "../detail/trace.hpp"
#include "block.hpp"
#include "mac_trace.hpp"

namespace titans {

namespace detail {

/// MAC's training forward and backward (a friend of Block and BlockState; the memory's part
/// through NeuralMemory's public staged API: begin_trace, forward_part, Reverse,
/// read_weights_backward).
template <class T, class Backend>
struct MacTraining {
    using Blk = Block<T, Backend>;
    using State = BlockState<T, Backend>;
    using MemoryTrace = typename NeuralMemory<T, Backend>::Trace;
    using Layers = std::vector<Matrix<T>>;
    using Segments = std::vector<MacSegmentTrace<T>>;

    /// The mixer on u ((B*N) x d) from next (fresh, or any state the memory trains from), as
    /// MacMixer::mix computes it, segment part by segment part; fills mem (one trace over all
    /// y) and segs.
    static Matrix<T> forward(const Blk& blk, State& next, const Matrix<T>& u, MemoryTrace& mem,
                             Segments& segs) {
        const BlockConfig& cfg = blk.cfg_;
        const int B = next.batch_, C = cfg.segment;
        const Eigen::Index N = u.rows() / B;
        const DenormalFlushScope flush(cfg.memory.flush_denormals);
        if (next.position_ == 0) {
            next.memory_ = blk.memory_->make_state(B);
        }
        blk.memory_->begin_trace(next.memory_, N, mem);
        Matrix<T> out(u.rows(), cfg.d_model);
        using Transfer = backend::Transfer<Backend, T>;
        Matrix<T> seg_k = to_host(Transfer::view(std::as_const(next.seg_k_))),
                  seg_v = to_host(Transfer::view(std::as_const(next.seg_v_)));
        for (Eigen::Index t = 0; t < N;) {
            const std::int64_t pos = next.position_ + t;
            MacSegmentTrace<T> sg;
            sg.t0 = t;
            sg.offset = static_cast<int>(pos % C);
            const int m = static_cast<int>(std::min<Eigen::Index>(C - sg.offset, N - t));
            begin_part(blk, next, seg_k, seg_v, sg);
            const Matrix<T> U = segment_rows(u, B, t, m);
            sg.h = blk.memory_->read_weights(sg.weights, U, B);
            sg.y = segment_attention<T>(cfg.attention, blk.params_->attention, U, sg.h,
                                        blk.k_prefix_, blk.v_prefix_, seg_k, seg_v, B, C,
                                        sg.offset, pos);
            blk.memory_->forward_part(next.memory_, sg.y, sg.r, mem);
            const Matrix<T> o = (sg.y.array() * sg.r.unaryExpr([](T v) { return sigmoid(v); })
                                                     .array())
                                    .matrix();
            for (int b = 0; b < B; ++b) {
                out.middleRows(b * N + t, m) = o.middleRows(b * m, m);
            }
            segs.push_back(std::move(sg));
            t += m;
        }
        if (!segs.empty()) {  // the state keeps the last segment's start weights and rows
            next.snapshot_ = blk.memory_->make_snapshot(segs.back().weights, B);
            to_backend(seg_k, Transfer::view(next.seg_k_));
            to_backend(seg_v, Transfer::view(next.seg_v_));
        }
        return out;
    }

    /// The mixer's backward: dout (B*N x d) -> du; parameter gradients added to g. The trace
    /// began at position `start`; d_out (checked by check_state_gradient, or null) is the
    /// adjoint of the state after it and d_in, if given, gets the adjoint of the state before
    /// it (memory and segment parts).
    static Matrix<T> backward(const Blk& blk, const MemoryTrace& mem, const Segments& segs,
                              const Matrix<T>& u, int B, std::int64_t start, const Matrix<T>& dout,
                              BlockParams<T>& g, const BlockStateGradient<T>* d_out,
                              BlockStateGradient<T>* d_in) {
        const BlockConfig& cfg = blk.cfg_;
        const Eigen::Index N = u.rows() / B;
        const bool given = d_out != nullptr && !d_out->empty();
        if (N == 0) {  // an empty piece: no rows, no gradient; the state passes through
            if (d_in != nullptr) {
                *d_in = given ? *d_out : BlockStateGradient<T>{};
            }
            return Matrix<T>(0, cfg.d_model);
        }
        const DenormalFlushScope flush(cfg.memory.flush_denormals);
        Matrix<T> dr, dy_gate;
        gate_backward(segs, B, N, dout, dr, dy_gate);
        const auto* dm_out = given && !d_out->memory.empty() ? &d_out->memory : nullptr;
        const auto* dseg_out = given && !d_out->mac.empty() ? &d_out->mac : nullptr;
        typename NeuralMemory<T, Backend>::Reverse rev(*blk.memory_, mem, dr, dm_out);
        // The incoming segment state's adjoint, built only when asked for (d_in).
        MacStateGradient<T> dseg = d_in != nullptr ? zero_segment_state(blk, B, start % cfg.segment)
                                                   : MacStateGradient<T>{};
        Matrix<T> du = Matrix<T>::Zero(u.rows(), cfg.d_model);
        for (std::size_t k = segs.size(); k-- > 0;) {
            const MacSegmentTrace<T>& sg = segs[k];
            const Eigen::Index m = sg.y.rows() / B;
            const auto* dlast = k + 1 == segs.size() ? dseg_out : nullptr;
            Matrix<T> dy;
            rev.down_to(sg.t0, dy);
            dy += segment_rows(dy_gate, B, sg.t0, m);
            const Matrix<T> U = segment_rows(u, B, sg.t0, m);
            Matrix<T> dU, dh, dU_read;
            attend_backward(blk, sg, U, B, start + sg.t0, dy, dlast, dU, dh, dseg, g);
            std::vector<Layers> dW;
            blk.memory_->read_weights_backward(sg.weights, U, B, dh, dU_read, dW, g.memory);
            if (dlast != nullptr) {  // the state after the call keeps this segment's snapshot
                add_layers(dlast->snapshot, dW);
            }
            if (sg.offset == 0) {
                rev.tap(dW);  // the weights after t0 tokens
            } else {
                dseg.snapshot = std::move(dW);  // the snapshot the call started with
            }
            dU += dU_read;
            add_segment_rows(dU, B, sg.t0, du);
        }
        rev.finish(g.memory, d_in != nullptr ? &d_in->memory : nullptr);
        if (d_in != nullptr) {
            if (!d_in->memory.finite() || !segment_finite(dseg)) {
                throw NonFiniteError("Block::backward: the state's gradient overflows, expected "
                                     "finite values; grads are unchanged");
            }
            d_in->mac = std::move(dseg);
        }
        return du;
    }

    /// d (a MAC block's d_state_out for a trace of B streams from `start` over N tokens): the
    /// memory part as NeuralMemory::backward checks it, no attention part, and a segment part
    /// that is empty or has, per stream, keys and values of 2 * (end % segment) rows x D_att
    /// and, per (stream, head), the memory's weight shapes; all finite. Throws ConfigError,
    /// ShapeError, NonFiniteError naming the part.
    static void check_state_gradient(const Blk& blk, const MemoryTrace& mem, int B,
                                     std::int64_t end, const BlockStateGradient<T>& d) {
        constexpr const char* where = "Block::backward";
        if (!d.attention.empty()) {
            throw ConfigError(concat(where, ": d_state_out.attention given to a MAC block, "
                                            "expected none (MAC's keys are in d_state_out.mac)"));
        }
        if (!d.memory.empty()) {
            blk.memory_->validate_state_gradient(d.memory, mem);
        }
        if (d.mac.empty()) {
            return;
        }
        check_sequence_adjoints(d.mac.keys, d.mac.values, static_cast<std::size_t>(B),
                                2 * (end % blk.cfg_.segment), blk.cfg_.attention.inner_dim(),
                                where, "d_state_out.mac",
                                "2 (position % segment) x n_heads * d_head");
        blk.memory_->validate_weights(d.mac.snapshot, B, "Block::backward (d_state_out.mac.snapshot)");
        if (!all_finite_each(d.mac.snapshot)) {  // keys and values: checked above
            throw NonFiniteError(concat(where, ": d_state_out.mac has a NaN or infinite entry"));
        }
    }

    /// The segment parts a training forward leaves for B streams of N tokens from `start`:
    /// consecutive parts from row 0 to N, each at its position's offset into its segment and
    /// as long as the segment's rest (or the call's), with (B*m) x d reads h, outputs y and
    /// memory outputs r, B * n_heads weight sets of the memory's layer shapes and, at an
    /// offset o > 0, B kept keys and values of 2 o x D_att. ShapeError naming the part.
    static void check_segments(const Blk& blk, const Segments& segs, int B, std::int64_t start,
                               Eigen::Index N, const char* where) {
        const BlockConfig& cfg = blk.cfg_;
        const int C = cfg.segment;
        Eigen::Index t = 0;
        for (std::size_t k = 0; k < segs.size(); ++k) {
            const MacSegmentTrace<T>& sg = segs[k];
            const auto offset = static_cast<int>((start + t) % C);
            const Eigen::Index m = std::min<Eigen::Index>(C - offset, N - t);
            const std::string part = concat("segments[", k, "]");
            check_trace_part(sg.t0 == t && sg.offset == offset && m > 0, where,
                             part + ".t0, offset", concat(sg.t0, ", ", sg.offset),
                             concat(t, ", ", offset, " (the parts cover rows 0 to ", N, ")"));
            for (const Matrix<T>* x : {&sg.h, &sg.y, &sg.r}) {
                check_trace_shape(*x, B * m, cfg.d_model, where, part + ".h, y, r");
            }
            blk.memory_->validate_weights(sg.weights, B, concat(where, " (trace.", part,
                                                            ".weights)").c_str());
            const std::size_t kept = offset > 0 ? static_cast<std::size_t>(B) : 0;
            for (const std::vector<Matrix<T>>* kv : {&sg.kept_k, &sg.kept_v}) {
                check_trace_part(kv->size() == kept, where, part + ".kept_k, kept_v size",
                                 kv->size(), concat(kept));
                for (const Matrix<T>& x : *kv) {
                    check_trace_shape(x, 2 * offset, cfg.attention.inner_dim(), where,
                                      part + ".kept_k, kept_v");
                }
            }
            t += m;
        }
        check_trace_part(t == N, where, "segments", concat(segs.size(), " parts over ", t, " rows"),
                         concat("parts over the ", N, " rows of each stream"));
    }

    /// Rows of the backend's memory on the host, and host rows into a view there (MAC's
    /// training pass runs on the host).
    static Matrix<T> to_host(View<const T> v) {
        Matrix<T> h(v.rows, v.cols);
        backend::Transfer<Backend, T>::download(v, view_of(h));
        return h;
    }
    static void to_backend(const Matrix<T>& h, View<T> to) {
        using Transfer = backend::Transfer<Backend, T>;
        const typename Transfer::Buffer up = Transfer::upload(view_of(h));
        backend::GlueKernels<Backend, T>::copy(Transfer::view(up), to);
    }

private:
    /// A part's segment-start weights and, mid-segment (a call's first part continuing an
    /// earlier call's segment), the state's snapshot and the first 2 offset rows of its buffers
    /// (seg_k, seg_v: their host copies, (B*2C) x D).
    static void begin_part(const Blk& blk, const State& st, const Matrix<T>& seg_k,
                           const Matrix<T>& seg_v, MacSegmentTrace<T>& sg) {
        const int B = st.batch_;
        if (sg.offset > 0) {
            sg.weights = blk.memory_->snapshot_weights(st.snapshot_);
            const Eigen::Index rows = 2 * static_cast<Eigen::Index>(blk.cfg_.segment);
            for (int b = 0; b < B; ++b) {
                sg.kept_k.push_back(seg_k.middleRows(b * rows, 2 * sg.offset));
                sg.kept_v.push_back(seg_v.middleRows(b * rows, 2 * sg.offset));
            }
            return;
        }
        sg.weights = blk.memory_->current_weights(st.memory_);
    }

    /// o = y ⊙ σ(r): dr = dout ⊙ y ⊙ σ'(r) for the memory, dy_gate = dout ⊙ σ(r), y's direct
    /// part (both B*N x d, the call's rows).
    static void gate_backward(const Segments& segs, int B, Eigen::Index N, const Matrix<T>& dout,
                              Matrix<T>& dr, Matrix<T>& dy_gate) {
        dr.resize(dout.rows(), dout.cols());
        dy_gate.resize(dout.rows(), dout.cols());
        for (const MacSegmentTrace<T>& sg : segs) {
            const Eigen::Index m = sg.y.rows() / B;
            const Matrix<T> s = sg.r.unaryExpr([](T v) { return sigmoid(v); });
            for (int b = 0; b < B; ++b) {
                const auto d = dout.middleRows(b * N + sg.t0, m).array();
                const auto y = sg.y.middleRows(b * m, m).array();
                const auto sb = s.middleRows(b * m, m).array();
                dr.middleRows(b * N + sg.t0, m) = (d * y * sb * (T(1) - sb)).matrix();
                dy_gate.middleRows(b * N + sg.t0, m) = (d * sb).matrix();
            }
        }
    }

    /// The segment part of a state gradient at `offset` tokens into a segment, all zeros.
    static MacStateGradient<T> zero_segment_state(const Blk& blk, int B, std::int64_t offset) {
        const Eigen::Index D = blk.cfg_.attention.inner_dim();
        MacStateGradient<T> d;
        d.keys.assign(static_cast<std::size_t>(B), Matrix<T>::Zero(2 * offset, D));
        d.values = d.keys;
        for (int b = 0; b < B; ++b) {
            for (int h = 0; h < blk.cfg_.memory.n_heads; ++h) {
                Layers zero;
                for (const Matrix<T>& w : blk.memory_->params().memory_init[static_cast<std::size_t>(h)]) {
                    zero.push_back(Matrix<T>::Zero(w.rows(), w.cols()));
                }
                d.snapshot.push_back(std::move(zero));
            }
        }
        return d;
    }

    static bool segment_finite(const MacStateGradient<T>& d) {
        return all_finite_each(d.keys) && all_finite_each(d.values) &&
               all_finite_each(d.snapshot);
    }

    static void add_layers(const std::vector<Layers>& from, std::vector<Layers>& to) {
        for (std::size_t i = 0; i < to.size(); ++i) {
            for (std::size_t l = 0; l < to[i].size(); ++l) {
                to[i][l] += from[i][l];
            }
        }
    }

    /// The reverse of MacMixer::attend for one part at absolute position pos
    /// (detail::segment_attention_backward): dy -> dU, dh and the attention's and P's
    /// gradients (added to g). dlast (the part that ends the call, or null) adds the adjoint of
    /// the keys and values the state keeps after the call; a part continuing an earlier call's
    /// segment writes its kept rows' adjoint into dseg.
    static void attend_backward(const Blk& blk, const MacSegmentTrace<T>& sg, const Matrix<T>& U,
                                int B, std::int64_t pos, const Matrix<T>& dy,
                                const MacStateGradient<T>* dlast, Matrix<T>& dU, Matrix<T>& dh,
                                MacStateGradient<T>& dseg, BlockParams<T>& g) {
        const Eigen::Index m = U.rows() / B, n = 2 * (sg.offset + m);
        const bool after = dlast != nullptr && dlast->keys[0].rows() == n;  // ends mid-segment
        const Matrix<T> kept_k = stack_rows(sg.kept_k), kept_v = stack_rows(sg.kept_v);
        const Matrix<T> after_k = after ? stack_rows(dlast->keys) : Matrix<T>(),
                        after_v = after ? stack_rows(dlast->values) : Matrix<T>();
        const SegmentBackwardOperands<T> a{U,      sg.h,           dy,
                                           kept_k, kept_v,         after_k,
                                           after_v, blk.k_prefix_, blk.v_prefix_,
                                           blk.params_->persistent, B, blk.cfg_.segment,
                                           sg.offset, pos};
        AttentionParams<T>& ga = g.attention;
        SegmentGradientSink<Matrix<T>&> sink{ga.w_q, ga.w_k, ga.w_v, ga.w_o, g.persistent};
        Matrix<T> dkept_k, dkept_v;
        segment_attention_backward<T>(blk.cfg_.attention, blk.params_->attention, a, dU, dh,
                                      dkept_k, dkept_v, sink);
        if (sg.offset > 0 && !dseg.keys.empty()) {
            const Eigen::Index rows = 2 * sg.offset;
            for (int b = 0; b < B; ++b) {
                dseg.keys[static_cast<std::size_t>(b)] = dkept_k.middleRows(b * rows, rows);
                dseg.values[static_cast<std::size_t>(b)] = dkept_v.middleRows(b * rows, rows);
            }
        }
    }

    /// Per-stream matrices of equal shape stacked (0 x 0 for none).
    static Matrix<T> stack_rows(const std::vector<Matrix<T>>& parts) {
        if (parts.empty()) {
            return Matrix<T>();
        }
        Matrix<T> out(static_cast<Eigen::Index>(parts.size()) * parts[0].rows(), parts[0].cols());
        for (std::size_t i = 0; i < parts.size(); ++i) {
            out.middleRows(static_cast<Eigen::Index>(i) * parts[0].rows(), parts[0].rows()) =
                parts[i];
        }
        return out;
    }
};

}  // namespace detail

}  // namespace titans
