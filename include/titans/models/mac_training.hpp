#pragma once
// titans/models/mac_training.hpp: the training pass of MAC's mixer (math §9, "MAC"), on views
// in the backend's memory. Per segment S of C tokens (u's rows [t0, t0 + m) of every stream):
//     h = M*_{W(t0)}(S)       the memory as it was after t0 tokens, read through W_Q (no conv)
//     y = Attn(q_S; P ‖ h ‖ S) W_O   (keys and values of h_i and s_i interleaved, causal)
//     r = M(y)                the memory written with y (in-chunk read), one stream over all y
//     o = y ⊙ σ(r)
// The forward keeps per segment the memory's snapshot read, h, y and r (MacSegmentTrace), and
// grows one memory trace over the whole stream of y. The backward runs the memory's reverse
// sweep in stages (NeuralMemory::Reverse on views): last segment first, it reverses the memory
// rows of the segment (their dL/dy final, since every later use of y is already reversed),
// then the gate, the segment attention (Attention::segment_backward) and the read of h
// (read_snapshot_backward), whose snapshot's adjoint it taps into the sweep at t0, the memory
// after t0 tokens, before going below t0. Only the state's adjoints (host structs) cross to the
// host, when asked for.

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "../attention/segment.hpp"
#include "../attention/segment_backward.hpp"
#include "../backend/backend.hpp"
#include "../detail/float_env.hpp"
#include "../detail/trace.hpp"
#include "../layers/glue.hpp"
#include "block.hpp"
#include "block_gradient.hpp"
#include "mac_trace.hpp"

namespace titans {

namespace detail {

/// MAC's training forward and backward on views (a friend of Block and BlockState; the memory's
/// part through NeuralMemory's public staged API on views: begin_trace, forward_part, Reverse,
/// read_snapshot_backward; the attention's through Attention::segment and segment_backward).
template <class T, class Backend>
struct MacTraining {
    using Blk = Block<T, Backend>;
    using State = BlockState<T, Backend>;
    using Memory = NeuralMemory<T, Backend>;
    using MemoryTrace = typename Memory::Trace;
    using Snapshot = typename Memory::Snapshot;
    using Layers = std::vector<Matrix<T>>;
    using Part = MacSegmentTrace<T, Backend>;
    using Segments = std::vector<Part>;
    using Transfer = backend::Transfer<Backend, T>;
    using Buffer = typename Transfer::Buffer;
    using Glue = backend::GlueKernels<Backend, T>;
    using Grads = BlockGradientViews<T>;

    /// o = the mixer of u ((B*N) x d views), as MacMixer::mix computes it, segment part by
    /// segment part from next (fresh, or any state the memory trains from); fills mem (one
    /// trace over all y) and segs.
    static void forward(const Blk& blk, State& next, View<const T> u, View<T> o, MemoryTrace& mem,
                        Segments& segs) {
        const BlockConfig& cfg = blk.cfg_;
        const int B = next.batch_, C = cfg.segment;
        const Eigen::Index N = u.rows / B, d = cfg.d_model;
        const DenormalFlushScope flush(cfg.memory.flush_denormals);
        if (next.position_ == 0) {
            next.memory_ = blk.memory_->make_state(B);
        }
        blk.memory_->begin_trace(next.memory_, N, mem);
        for (Eigen::Index t = 0; t < N;) {
            const std::int64_t pos = next.position_ + t;
            Part sg;
            sg.t0 = t;
            sg.offset = static_cast<int>(pos % C);
            const int m = static_cast<int>(std::min<Eigen::Index>(C - sg.offset, N - t));
            begin_part(blk, next, sg);
            const Buffer U = rows_of(u, B, t, m);
            sg.h = Transfer::allocate(B * m, d);
            sg.y = Transfer::allocate(B * m, d);
            sg.r = Transfer::allocate(B * m, d);
            blk.memory_->read_snapshot(sg.weights, cv(U), B, Transfer::view(sg.h));
            attend(blk, next, U, sg, m, pos);
            blk.memory_->forward_part(next.memory_, cv(sg.y), Transfer::view(sg.r), mem);
            Buffer op = Transfer::allocate(B * m, d);
            Glue::gate(cv(sg.y), cv(sg.r), Transfer::view(op));
            Glue::copy_rows(cv(op), o, backend::RowBlocks{B, m, m, 0, N, t});
            segs.push_back(std::move(sg));
            t += m;
        }
        if (!segs.empty()) {  // the state keeps the last segment's start weights
            next.snapshot_ = segs.back().weights;
        }
    }

    /// The mixer's backward: dout ((B*N) x d) -> du (written); the parameters' gradients added
    /// to g's parts. The trace began at position `start`; d_out (checked by
    /// check_state_gradient, or null) is the adjoint of the state after it and d_in, if
    /// given, gets the adjoint of the state before it (memory and segment parts).
    static void backward(const Blk& blk, const MemoryTrace& mem, const Segments& segs,
                         View<const T> u, int B, std::int64_t start, View<const T> dout,
                         View<T> du, const Grads& g, const BlockStateGradient<T>* d_out,
                         BlockStateGradient<T>* d_in) {
        const BlockConfig& cfg = blk.cfg_;
        const Eigen::Index N = u.rows / B;
        const bool given = d_out != nullptr && !d_out->empty();
        if (N == 0) {  // an empty piece: no rows, no gradient; the state passes through
            if (d_in != nullptr) {
                *d_in = given ? *d_out : BlockStateGradient<T>{};
            }
            return;
        }
        const DenormalFlushScope flush(cfg.memory.flush_denormals);
        Buffer dr = Transfer::allocate(u.rows, cfg.d_model);
        std::vector<Buffer> dy_gate = gate_backward(segs, B, N, dout, dr);
        const auto* dm_out = given && !d_out->memory.empty() ? &d_out->memory : nullptr;
        const auto* dseg_out = given && !d_out->mac.empty() ? &d_out->mac : nullptr;
        typename Memory::Reverse rev(*blk.memory_, mem, cv(dr), dm_out);
        // The incoming segment state's adjoint, built only when asked for (d_in).
        MacStateGradient<T> dseg = d_in != nullptr ? zero_segment_state(blk, B, start % cfg.segment)
                                                   : MacStateGradient<T>{};
        for (std::size_t k = segs.size(); k-- > 0;) {
            part_backward(blk, segs[k], rev, u, B, start, cv(dy_gate[k]),
                          k + 1 == segs.size() ? dseg_out : nullptr, du, g, dseg);
        }
        rev.finish(g.memory, d_in != nullptr ? &d_in->memory : nullptr);
        if (d_in != nullptr) {
            if (!d_in->memory.finite() || !segment_finite(dseg)) {
                throw NonFiniteError("Block::backward: the state's gradient overflows, expected "
                                     "finite values; grads are unchanged");
            }
            d_in->mac = std::move(dseg);
        }
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
            const Part& sg = segs[k];
            const auto offset = static_cast<int>((start + t) % C);
            const Eigen::Index m = std::min<Eigen::Index>(C - offset, N - t);
            const std::string part = concat("segments[", k, "]");
            check_trace_part(sg.t0 == t && sg.offset == offset && m > 0, where,
                             part + ".t0, offset", concat(sg.t0, ", ", sg.offset),
                             concat(t, ", ", offset, " (the parts cover rows 0 to ", N, ")"));
            for (const Buffer* x : {&sg.h, &sg.y, &sg.r}) {
                check_trace_shape(cv(*x), B * m, cfg.d_model, where, part + ".h, y, r");
            }
            const std::size_t pairs = static_cast<std::size_t>(B) *
                                      static_cast<std::size_t>(cfg.memory.n_heads);
            check_trace_part(sg.weights.pairs() == pairs, where, part + ".weights.pairs()",
                             sg.weights.pairs(), concat("batch * n_heads = ", pairs));
            for (const Buffer* kv : {&sg.kept_k, &sg.kept_v}) {
                check_trace_shape(cv(*kv), B * 2 * offset, cfg.attention.inner_dim(), where,
                                  part + ".kept_k, kept_v");
            }
            t += m;
        }
        check_trace_part(t == N, where, "segments", concat(segs.size(), " parts over ", t, " rows"),
                         concat("parts over the ", N, " rows of each stream"));
    }

    /// A segment trace's buffer as a view (its shape for the checks).
    static View<const T> cv(const Buffer& b) { return Transfer::view(b); }

private:
    /// Rows [t, t + m) of each of the B streams of x ((B*N) x cols), stacked stream-major.
    static Buffer rows_of(View<const T> x, int B, Eigen::Index t, int m) {
        Buffer out = Transfer::allocate(static_cast<Eigen::Index>(B) * m, x.cols);
        Glue::copy_rows(x, Transfer::view(out), backend::RowBlocks{B, m, x.rows / B, t, m, 0});
        return out;
    }

    /// A part's segment-start weights (mid-segment, a call's first part continuing an earlier
    /// call's segment: the state's snapshot; else the memory now) and the state's first
    /// 2 offset rows of each stream's segment buffers (none at offset 0).
    static void begin_part(const Blk& blk, const State& st, Part& sg) {
        const int B = st.batch_, C = blk.cfg_.segment, kept = 2 * sg.offset;
        const Eigen::Index D = blk.cfg_.attention.inner_dim();
        sg.kept_k = Transfer::allocate(static_cast<Eigen::Index>(B) * kept, D);
        sg.kept_v = Transfer::allocate(static_cast<Eigen::Index>(B) * kept, D);
        if (sg.offset == 0) {
            blk.memory_->snapshot(st.memory_, sg.weights);
            return;
        }
        sg.weights = st.snapshot_;
        const backend::RowBlocks rows{B, kept, 2 * C, 0, kept, 0};
        Glue::copy_rows(cv(st.seg_k_), Transfer::view(sg.kept_k), rows);
        Glue::copy_rows(cv(st.seg_v_), Transfer::view(sg.kept_v), rows);
    }

    /// y = the segment attention of the part's rows U (with sg.h), its keys and values written
    /// into the state's segment buffers (MacMixer::attend's call).
    static void attend(const Blk& blk, State& st, const Buffer& U, Part& sg, int m,
                       std::int64_t pos) {
        SegmentCall<T> c;
        c.u = cv(U);
        c.h = cv(sg.h);
        c.seg_k = Transfer::view(st.seg_k_);
        c.seg_v = Transfer::view(st.seg_v_);
        c.prefix = PrefixView<T>{cv(blk.mac_prefix_->k), cv(blk.mac_prefix_->v)};
        c.y = Transfer::view(sg.y);
        c.batch = st.batch_;
        c.segment = blk.cfg_.segment;
        c.offset = sg.offset;
        c.rows = m;
        c.position = pos;
        blk.attention_->segment(c);
    }

    /// o = y ⊙ σ(r) reversed per part: dr (the memory's output adjoint, the call's rows
    /// (B*N) x d) written, and per part dy_gate = dout ⊙ σ(r), y's direct adjoint ((B*m) x d).
    static std::vector<Buffer> gate_backward(const Segments& segs, int B, Eigen::Index N,
                                             View<const T> dout, Buffer& dr) {
        std::vector<Buffer> dy_gate;
        for (const Part& sg : segs) {
            const int m = static_cast<int>(cv(sg.y).rows / B);
            const Buffer dp = rows_of(dout, B, sg.t0, m);
            Buffer drp = Transfer::allocate(cv(dp).rows, cv(dp).cols);
            dy_gate.push_back(Transfer::allocate(cv(dp).rows, cv(dp).cols));
            Glue::gate_backward(cv(dp), cv(sg.y), cv(sg.r), Transfer::view(dy_gate.back()),
                                Transfer::view(drp));
            Glue::copy_rows(cv(drp), Transfer::view(dr), backend::RowBlocks{B, m, m, 0, N, sg.t0});
        }
        return dy_gate;
    }

    /// One part reversed: the memory's rows of the part (their dL/dy final), y's two adjoints
    /// summed, the segment attention and the read of h reversed; the read's snapshot adjoint
    /// tapped into the sweep (offset 0) or kept as the incoming snapshot's (dseg); du's rows
    /// of the part written.
    static void part_backward(const Blk& blk, const Part& sg, typename Memory::Reverse& rev,
                              View<const T> u, int B, std::int64_t start, View<const T> dy_gate,
                              const MacStateGradient<T>* dlast, View<T> du, const Grads& g,
                              MacStateGradient<T>& dseg) {
        const Eigen::Index N = u.rows / B, d = u.cols;
        const int m = static_cast<int>(dy_gate.rows / B);
        Buffer dy = Transfer::allocate(dy_gate.rows, d), dU = Transfer::allocate(dy_gate.rows, d),
               dh = Transfer::allocate(dy_gate.rows, d), dU_read = Transfer::allocate(dy_gate.rows, d);
        rev.down_to(sg.t0, Transfer::view(dy));
        Glue::add(cv(dy), dy_gate, Transfer::view(dy));
        const Buffer U = rows_of(u, B, sg.t0, m);
        attend_backward(blk, sg, U, B, start + sg.t0, dy, dlast, dU, dh, dseg, g);
        Snapshot dW;
        blk.memory_->read_snapshot_backward(sg.weights, cv(U), B, cv(dh), Transfer::view(dU_read),
                                            dW, g.memory);
        if (dlast != nullptr) {  // the state after the call keeps this segment's snapshot
            std::vector<Layers> w = blk.memory_->snapshot_weights(dW);
            add_layers(dlast->snapshot, w);
            dW = blk.memory_->make_snapshot(std::move(w), B);
        }
        if (sg.offset == 0) {
            rev.tap(dW);  // the weights after t0 tokens
        } else if (!dseg.keys.empty()) {
            dseg.snapshot = blk.memory_->snapshot_weights(dW);  // the snapshot the call started with
        }
        Glue::add(cv(dU), cv(dU_read), Transfer::view(dU));
        Glue::copy_rows(cv(dU), du, backend::RowBlocks{B, m, m, 0, N, sg.t0});
    }

    /// The reverse of attend (Attention::segment_backward) at absolute position pos: dy -> dU,
    /// dh, the attention's and P's gradients added to g. dlast (the part that ends the call,
    /// or null) adds the adjoint of the keys and values the state keeps after the call; a part
    /// continuing an earlier call's segment writes its kept rows' adjoint into dseg (if asked).
    static void attend_backward(const Blk& blk, const Part& sg, const Buffer& U, int B,
                                std::int64_t pos, const Buffer& dy, const MacStateGradient<T>* dlast,
                                Buffer& dU, Buffer& dh, MacStateGradient<T>& dseg, const Grads& g) {
        const int m = static_cast<int>(cv(U).rows / B), o = sg.offset;
        const Eigen::Index D = blk.cfg_.attention.inner_dim(), n = 2 * (o + m);
        const bool after = dlast != nullptr && dlast->keys[0].rows() == n;  // ends mid-segment
        const Buffer ak = after ? upload_rows(dlast->keys) : Buffer{},
                     av = after ? upload_rows(dlast->values) : Buffer{};
        const bool kept = o > 0 && !dseg.keys.empty();
        Buffer dk = kept ? Transfer::allocate(static_cast<Eigen::Index>(B) * 2 * o, D) : Buffer{},
               dv = kept ? Transfer::allocate(static_cast<Eigen::Index>(B) * 2 * o, D) : Buffer{};
        SegmentBackwardCall<T> c;
        c.u = cv(U);
        c.h = cv(sg.h);
        c.dy = cv(dy);
        c.kept_k = cv(sg.kept_k);
        c.kept_v = cv(sg.kept_v);
        if (after) {
            c.after_k = cv(ak);
            c.after_v = cv(av);
        }
        c.prefix = PrefixView<T>{cv(blk.mac_prefix_->k), cv(blk.mac_prefix_->v)};
        if (blk.cfg_.n_persistent > 0) {
            c.persistent = cv(*blk.persistent_);
        }
        c.du = Transfer::view(dU);
        c.dh = Transfer::view(dh);
        if (kept) {
            c.dkept_k = Transfer::view(dk);
            c.dkept_v = Transfer::view(dv);
        }
        c.grads = g.attention;
        c.dpersistent = g.persistent;
        c.batch = B;
        c.segment = blk.cfg_.segment;
        c.offset = o;
        c.rows = m;
        c.position = pos;
        blk.attention_->segment_backward(c);
        if (kept) {
            split_rows(cv(dk), B, dseg.keys);
            split_rows(cv(dv), B, dseg.values);
        }
    }

    /// Per-stream host matrices of equal shape stacked into one buffer in the backend's memory.
    static Buffer upload_rows(const std::vector<Matrix<T>>& parts) {
        Matrix<T> all(static_cast<Eigen::Index>(parts.size()) * parts[0].rows(), parts[0].cols());
        for (std::size_t i = 0; i < parts.size(); ++i) {
            all.middleRows(static_cast<Eigen::Index>(i) * parts[0].rows(), parts[0].rows()) =
                parts[i];
        }
        return Transfer::upload(view_of(std::as_const(all)));
    }

    /// A buffer of B streams' rows stacked, brought to the host, one matrix per stream.
    static void split_rows(View<const T> from, int B, std::vector<Matrix<T>>& to) {
        Matrix<T> all(from.rows, from.cols);
        Transfer::download(from, view_of(all));
        const Eigen::Index rows = from.rows / B;
        for (int b = 0; b < B; ++b) {
            to[static_cast<std::size_t>(b)] = all.middleRows(b * rows, rows);
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
};

}  // namespace detail

}  // namespace titans
