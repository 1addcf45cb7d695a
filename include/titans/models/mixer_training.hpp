#pragma once
// titans/models/mixer_training.hpp: the training forward and backward of a block's mixer
// (math §9, "Blocks and the model") on views in the backend's memory, by kind:
//     LMM  o = M(u)
//     MAG  o = RMSNorm_y(SWA*(P ‖ u)) ⊙ σ(RMSNorm_m(M(P ‖ u)))
//     MAL  o = SWA(M(P ‖ u))
//     SWA  o = SWA*(P ‖ u)
//     MAC  o = y ⊙ σ(M(y)), y the segment attention over P ‖ h ‖ u (mac_training.hpp)
// From a fresh state each sequence's memory input (and MAL's window) is [P; u]: the rows are
// assembled, taken apart and their adjoints summed into P's gradient by glue kernels
// (copy_rows, add_rows). The gradients are added to views of the block's flat gradient
// (block_gradient.hpp), in the backend's memory.

#include <utility>

#include "../backend/edge.hpp"
#include "../layers/glue.hpp"
#include "block.hpp"
#include "block_gradient.hpp"
#include "block_trace.hpp"
#include "mac_training.hpp"

namespace titans::detail {

/// The mixer's training pass (a friend of Block and BlockState). Every view is in the
/// backend's memory and checked by BlockTraining.
template <class T, class Backend>
struct MixerTraining {
    using Blk = Block<T, Backend>;
    using State = BlockState<T, Backend>;
    using Trace = BlockTrace<T, Backend>;
    using Transfer = backend::Transfer<Backend, T>;
    using Buffer = typename Transfer::Buffer;
    using Glue = backend::GlueKernels<Backend, T>;
    using Grads = BlockGradientViews<T>;
    static constexpr bool mac_trains = backend::MemoryTraining<Backend, T>::staged;

    /// The rows P enter with from a fresh state: N_p for MAG and MAL, none otherwise.
    static Eigen::Index prefix_rows(const BlockConfig& cfg) {
        return cfg.kind == BlockKind::MAG || cfg.kind == BlockKind::MAL ? cfg.n_persistent : 0;
    }

    /// o = Mixer(u) ((B*N) x d each), the trace's sub-layer parts filled. From a fresh state,
    /// next's memory (and MAL's attention) restart from fresh states that take P first; else
    /// they continue.
    static void forward(const Blk& blk, State& next, View<const T> u, View<T> o, Trace& t) {
        const BlockConfig& cfg = blk.cfg_;
        if constexpr (mac_trains) {
            if (cfg.kind == BlockKind::MAC) {
                t.u = Transfer::allocate(u.rows, u.cols);
                Glue::copy(u, view(t.u));
                MacTraining<T, Backend>::forward(blk, next, u, o, t.memory, t.segments);
                return;
            }
        }
        if (cfg.kind == BlockKind::SWA) {  // o = SWA*(P ‖ u): MAG's attention branch alone
            prefix_attention(blk, next, u, o, t);
            return;
        }
        const int B = next.batch_;
        const bool fresh = next.position_ == 0;
        const Eigen::Index p = fresh ? prefix_rows(cfg) : 0, full = u.rows + B * p;
        if (fresh) {
            next.memory_ = blk.memory_->make_state(B);
        }
        if (cfg.kind == BlockKind::LMM) {
            blk.memory_->forward(next.memory_, u, o, t.memory);
            return;
        }
        Buffer m = Transfer::allocate(full, u.cols);
        memory_forward(blk, next, u, p, view(m), t);
        if (cfg.kind == BlockKind::MAL) {
            if (fresh) {
                next.attention_ = blk.attention_->make_state(B);
            }
            if (p == 0) {
                blk.attention_->forward(next.attention_, cview(m), o, t.attention);
                return;
            }
            Buffer y = Transfer::allocate(full, u.cols);
            blk.attention_->forward(next.attention_, cview(m), view(y), t.attention);
            Glue::copy_rows(cview(y), o, strip(B, u.rows / B, p));
            return;
        }
        // MAG: a = RMSNorm_y(SWA*(P ‖ u)), o = a ⊙ σ(RMSNorm_m(m)); the trace keeps a and the
        // gate's argument.
        prefix_attention(blk, next, u, o, t);
        t.a = Transfer::allocate(u.rows, u.cols);
        t.gate = Transfer::allocate(u.rows, u.cols);
        blk.norm_y_->forward(View<const T>(o), view(t.a), t.norm_y);
        if (p == 0) {
            blk.norm_m_->forward(cview(m), view(t.gate), t.norm_m);
        } else {
            Buffer mu = Transfer::allocate(u.rows, u.cols);
            Glue::copy_rows(cview(m), view(mu), strip(B, u.rows / B, p));
            blk.norm_m_->forward(cview(mu), view(t.gate), t.norm_m);
        }
        Glue::gate(cview(t.a), cview(t.gate), o);
    }

    /// The mixer's backward: dout -> du ((B*N) x d each); parameter gradients added to g; the
    /// state's adjoint through the memory and the attention (d_out in, d_in out, either may
    /// be null).
    static void backward(const Blk& blk, const Trace& tr, View<const T> dout, View<T> du,
                         const Grads& g, const BlockStateGradient<T>* d_out,
                         BlockStateGradient<T>* d_in) {
        const BlockConfig& cfg = blk.cfg_;
        if constexpr (mac_trains) {
            if (cfg.kind == BlockKind::MAC) {
                mac_backward(blk, tr, dout, du, g, d_out, d_in);
                return;
            }
        }
        switch (cfg.kind) {
            case BlockKind::LMM: memory_backward(blk, tr, dout, 0, du, g, d_out, d_in); return;
            case BlockKind::SWA: prefix_attention_backward(blk, tr, dout, du, g, d_out, d_in); return;
            case BlockKind::MAL: mal_backward(blk, tr, dout, du, g, d_out, d_in); return;
            default: mag_backward(blk, tr, dout, du, g, d_out, d_in); return;
        }
    }

private:
    static View<T> view(Buffer& b) { return Transfer::view(b); }
    static View<const T> cview(const Buffer& b) { return Transfer::view(b); }

    /// MAC's backward (mac_training.hpp), on views.
    static void mac_backward(const Blk& blk, const Trace& tr, View<const T> dout, View<T> du,
                             const Grads& g, const BlockStateGradient<T>* d_out,
                             BlockStateGradient<T>* d_in) {
        MacTraining<T, Backend>::backward(blk, tr.memory, tr.segments, cview(tr.u), tr.batch,
                                          tr.start, dout, du, g, d_out, d_in);
    }

    /// Each sequence's N rows after its p prefix rows of a (B*(p+N))-row matrix, as B*N rows.
    static backend::RowBlocks strip(int B, Eigen::Index N, Eigen::Index p) {
        return {B, N, p + N, p, N, 0};
    }
    /// The inverse: B*N rows into each sequence's rows after its p prefix rows.
    static backend::RowBlocks after_prefix(int B, Eigen::Index N, Eigen::Index p) {
        return {B, N, N, 0, p + N, p};
    }

    /// m = M(u), or M([P; u]) per sequence with p > 0 (m then (B*(p+N)) x d).
    static void memory_forward(const Blk& blk, State& next, View<const T> u, Eigen::Index p,
                               View<T> m, Trace& t) {
        if (p == 0) {
            blk.memory_->forward(next.memory_, u, m, t.memory);
            return;
        }
        const int B = next.batch_;
        Buffer pu = Transfer::allocate(m.rows, m.cols);
        Glue::copy_rows(cview(*blk.persistent_), view(pu), {B, p, 0, 0, p + u.rows / B, 0});
        Glue::copy_rows(u, view(pu), after_prefix(B, u.rows / B, p));
        blk.memory_->forward(next.memory_, cview(pu), m, t.memory);
    }

    /// The memory's backward from dm over its input's rows ([P; u] per sequence when p > 0):
    /// dfull gets dL/d(the input), and the adjoint of P's rows is summed into g.persistent.
    static void memory_backward(const Blk& blk, const Trace& tr, View<const T> dm,
                                Eigen::Index p, View<T> dfull, const Grads& g,
                                const BlockStateGradient<T>* d_out, BlockStateGradient<T>* d_in) {
        blk.memory_->backward(tr.memory, dm, dfull, g.memory,
                              d_in != nullptr ? &d_in->memory : nullptr,
                              d_out != nullptr ? &d_out->memory : nullptr);
        if (p > 0) {
            Glue::add_rows(View<const T>(dfull), g.persistent,
                           {tr.batch, p, dfull.rows / tr.batch, 0, 0, 0});
        }
    }

    /// d (B*N x d) with p zero rows before each sequence's: the adjoint of strip.
    static Buffer with_zero_prefix(View<const T> d, int B, Eigen::Index p) {
        Buffer z = Transfer::allocate(d.rows + B * p, d.cols);
        Glue::fill(view(z), T(0));
        Glue::copy_rows(d, view(z), after_prefix(B, d.rows / B, p));
        return z;
    }

    /// SWA*(P ‖ u) into o, MAG's attention and SWA's mixer: every position sees all of P
    /// (none when N_p = 0) and its window of u; the trace keeps P for the prefix gradient.
    static void prefix_attention(const Blk& blk, State& next, View<const T> u, View<T> o,
                                 Trace& t) {
        blk.attention_->forward(next.attention_, u, o, t.attention,
                                blk.cfg_.n_persistent > 0 ? cview(*blk.persistent_)
                                                          : View<const T>{});
    }

    /// prefix_attention's backward: dy -> du, the attention's gradients and P's added to g,
    /// the window's state adjoint through d_out / d_in.
    static void prefix_attention_backward(const Blk& blk, const Trace& tr, View<const T> dy,
                                          View<T> du, const Grads& g,
                                          const BlockStateGradient<T>* d_out,
                                          BlockStateGradient<T>* d_in) {
        blk.attention_->backward(tr.attention, dy, du, g.attention, g.persistent,
                                 d_in != nullptr ? &d_in->attention : nullptr,
                                 d_out != nullptr ? &d_out->attention : nullptr);
    }

    /// MAL: o = SWA(M(P ‖ u)) reversed: the window's adjoint over [P; u] (P's rows zero),
    /// then the memory's.
    static void mal_backward(const Blk& blk, const Trace& tr, View<const T> dout, View<T> du,
                             const Grads& g, const BlockStateGradient<T>* d_out,
                             BlockStateGradient<T>* d_in) {
        const int B = tr.batch;
        const Eigen::Index p = tr.start == 0 ? prefix_rows(blk.cfg_) : 0, N = dout.rows / B;
        const Buffer dz = p > 0 ? with_zero_prefix(dout, B, p) : Buffer{};
        const View<const T> dy = p > 0 ? cview(dz) : dout;
        Buffer dm = Transfer::allocate(dy.rows, dy.cols);
        blk.attention_->backward(tr.attention, dy, view(dm), g.attention, View<T>{},
                                 d_in != nullptr ? &d_in->attention : nullptr,
                                 d_out != nullptr ? &d_out->attention : nullptr);
        if (p == 0) {
            memory_backward(blk, tr, cview(dm), 0, du, g, d_out, d_in);
            return;
        }
        Buffer dfull = Transfer::allocate(dy.rows, dy.cols);
        memory_backward(blk, tr, cview(dm), p, view(dfull), g, d_out, d_in);
        Glue::copy_rows(cview(dfull), du, strip(B, N, p));
    }

    /// MAG: o = a ⊙ σ(gate) reversed: the gate, both norms, the attention, then the memory
    /// (its input's adjoint added to du, P's rows to g.persistent).
    static void mag_backward(const Blk& blk, const Trace& tr, View<const T> dout, View<T> du,
                             const Grads& g, const BlockStateGradient<T>* d_out,
                             BlockStateGradient<T>* d_in) {
        const int B = tr.batch;
        const Eigen::Index p = tr.start == 0 ? prefix_rows(blk.cfg_) : 0, N = dout.rows / B;
        Buffer da = Transfer::allocate(dout.rows, dout.cols);
        Buffer dgate = Transfer::allocate(dout.rows, dout.cols);
        Glue::gate_backward(dout, cview(tr.a), cview(tr.gate), view(da), view(dgate));
        Buffer dya = Transfer::allocate(dout.rows, dout.cols);
        Buffer dm = Transfer::allocate(dout.rows, dout.cols);
        blk.norm_y_->backward(tr.norm_y, cview(da), view(dya), g.norm_y);
        blk.norm_m_->backward(tr.norm_m, cview(dgate), view(dm), g.norm_m);
        prefix_attention_backward(blk, tr, cview(dya), du, g, d_out, d_in);
        const Buffer dz = p > 0 ? with_zero_prefix(cview(dm), B, p) : Buffer{};
        Buffer dfull = Transfer::allocate(dout.rows + B * p, dout.cols);
        memory_backward(blk, tr, p > 0 ? cview(dz) : cview(dm), p, view(dfull), g, d_out, d_in);
        Glue::add_rows(cview(dfull), du, strip(B, N, p));
    }
};

}  // namespace titans::detail
