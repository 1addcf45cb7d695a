#pragma once
// titans/models/block_training.hpp: the training pass of a Titans block (math §9, "Blocks and
// the model"): Block::forward(state, x, y, trace) and Block::backward(trace, dy, dx, grads).
//
// The forward is the inference forward, with every sub-layer's training forward keeping its
// trace. From a fresh state, the persistent tokens P, which inference feeds to the memory (and
// for MAL to the attention window) once at make_state(), are fed here in the same call: each
// sequence's rows become [P; u], so their gradients reach P. From a later state (chained
// pieces) the sub-layers continue from the state's, and the state's adjoint passes through
// theirs (MAC: through its memory and segment state, mac_training.hpp). The backward reverses
//     u = RMSNorm(x),  h = x + Mixer(u),  out = h + FFN(RMSNorm(h))
// with the mixer by kind (mixer_training.hpp). Both run on views in the backend's memory (the
// activations and traces stay there); the host-matrix calls upload and download at the edge.

#include <cstdint>
#include <utility>

#include "../detail/activation.hpp"
#include "../detail/check.hpp"
#include "../error.hpp"
#include "../detail/tensor_slots.hpp"
#include "block.hpp"
#include "block_gradient.hpp"
#include "block_trace.hpp"
#include "mixer_training.hpp"

namespace titans {

namespace detail {

/// The body of Block's training calls (a friend of Block and BlockState).
template <class T, class Backend>
struct BlockTraining {
    using Blk = Block<T, Backend>;
    using State = BlockState<T, Backend>;
    using Trace = BlockTrace<T, Backend>;
    using Mixer = MixerTraining<T, Backend>;
    using Transfer = backend::Transfer<Backend, T>;
    using Buffer = typename Transfer::Buffer;
    using Glue = backend::GlueKernels<Backend, T>;
    /// Whether MAC trains here: its training drives the memory's staged reverse.
    static constexpr bool mac_trains = backend::MemoryTraining<Backend, T>::staged;

    static void forward(const Blk& blk, State& state, const MatrixRef<T>& x, Matrix<T>& y,
                        Trace& trace) {
        constexpr const char* where = "Block::forward (training)";
        require_kind_trains(blk.cfg_.kind, where);
        blk.check(state, x, where);
        check_start(blk, state, where);
        Matrix<T> y_new;
        {
            const backend::Upload<Backend, T> in(x);
            backend::Download<Backend, T> out(y_new, x.rows(), x.cols());
            forward_checked(blk, state, in.view(), out.view(), trace);
            out.finish();
        }
        y = std::move(y_new);
    }

    /// Block::forward on views (x, y (B*N) x d, distinct): checks as the host call's but x's
    /// finiteness (the caller's; an output that is not finite still throws).
    static void forward(const Blk& blk, State& state, View<const T> x, View<T> y, Trace& trace) {
        constexpr const char* where = "Block::forward (training)";
        require_kind_trains(blk.cfg_.kind, where);
        blk.check_rows(state, x.rows, x.cols, where);
        check_view_call(where, x, y, blk.cfg_.d_model, false);
        check_start(blk, state, where);
        forward_checked(blk, state, x, y, trace);
    }

    /// Block::backward (host): the gradients into a zeroed flat buffer in the backend's
    /// memory, added to grads (one download off the host) once every check has passed.
    static void backward(const Blk& blk, const Trace& tr, const MatrixRef<T>& dy, Matrix<T>& dx,
                         BlockParams<T>& grads, BlockStateGradient<T>* d_in,
                         const BlockStateGradient<T>* d_out) {
        constexpr const char* where = "Block::backward";
        check_same_tensors(*blk.params_, grads, blk.cfg_, where, "grads");
        check_trace(blk, tr, where);
        check_gradient_rows(dy, tr.rows, blk.cfg_.d_model, where, "dy");
        if (overlaps(dy, dx)) {
            throw ShapeError(concat(where, ": dx shares storage with dy, expected a distinct "
                                           "matrix"));
        }
        Buffer g = zeros(blk.parameter_count());
        Matrix<T> dx_new;
        {
            const backend::Upload<Backend, T> in(dy);
            backend::Download<Backend, T> out(dx_new, dy.rows(), dy.cols());
            accumulate_checked(blk, tr, in.view(), out.view(), view(g), d_in, d_out);
            out.finish();
        }
        backend::add_to_host<Backend>(cview(g), grads, blk.cfg_);
        dx = std::move(dx_new);
    }

    /// Block::backward on views (dy, dx the trace's rows x d, distinct; grads the block's flat
    /// gradient, 1 x parameter_count()): into a zeroed buffer, added to grads once every check
    /// has passed. Checks as the host call's but dy's finiteness (the caller's).
    static void backward(const Blk& blk, const Trace& tr, View<const T> dy, View<T> dx,
                         View<T> grads, BlockStateGradient<T>* d_in,
                         const BlockStateGradient<T>* d_out) {
        check_flat_gradient("Block::backward", grads, blk.parameter_count(),
                            "the block's tensors");
        Buffer g = zeros(grads.cols);
        accumulate(blk, tr, dy, dx, view(g), d_in, d_out);
        Glue::add(View<const T>(grads), cview(g), grads);
    }

    /// backward's work on views with g the block's flat gradient (1 x parameter_count(), in
    /// the backend's memory), taking the gradients (added to what it holds): what
    /// Model::backward calls with its own zeroed buffer's slice. Checks as backward but g's;
    /// if it throws, d_in is unchanged (g is the caller's to discard, dx unspecified).
    static void accumulate(const Blk& blk, const Trace& tr, View<const T> dy, View<T> dx,
                           View<T> g, BlockStateGradient<T>* d_in,
                           const BlockStateGradient<T>* d_out) {
        constexpr const char* where = "Block::backward";
        check_trace(blk, tr, where);
        check_view_gradient(where, dy, dx, blk.cfg_.d_model, tr.rows);
        accumulate_checked(blk, tr, dy, dx, g, d_in, d_out);
    }

    /// Block::validate_trace: filled, this block's configuration, batch, rows and start, and
    /// each sub-layer's trace valid for the sub-layer with the rows the block gives it (the
    /// memory, and MAL's attention, over [P; u] per sequence from a fresh start).
    static void check_trace(const Blk& blk, const Trace& tr, const char* where) {
        const BlockConfig& cfg = blk.cfg_;
        require_kind_trains(cfg.kind, where);
        check_trace_filled(tr.filled, where);
        check_trace_config(tr.cfg, cfg, where, "a block");
        check_trace_stream(tr.batch, tr.rows, tr.start, where);
        const int B = tr.batch;
        const Eigen::Index p = tr.start == 0 ? prefix_rows(cfg) : 0, rows = tr.rows,
                           full = rows + B * p;
        check_sub_trace(blk.norm_mix_, tr.norm_mix, rows, where, "norm_mix");
        if (cfg.use_ffn) {
            check_sub_trace(blk.norm_ffn_, tr.norm_ffn, rows, where, "norm_ffn");
            check_sub_trace(*blk.ffn_, tr.ffn, rows, where, "ffn");
        }
        if (cfg.kind == BlockKind::MAC) {
            check_trace_shape(Transfer::view(tr.u), rows, cfg.d_model, where, "u");
            check_sub_trace(*blk.memory_, tr.memory, rows, where, "memory", B);
            if constexpr (mac_trains) {
                MacTraining<T, Backend>::check_segments(blk, tr.segments, B, tr.start, rows / B,
                                                        where);
            }
            return;
        }
        if (has_memory(cfg.kind)) {
            check_sub_trace(*blk.memory_, tr.memory, full, where, "memory", B);
        }
        if (cfg.kind == BlockKind::MAL) {
            check_sub_trace(*blk.attention_, tr.attention, full, where, "attention", B);
        } else if (cfg.kind == BlockKind::MAG || cfg.kind == BlockKind::SWA) {
            check_sub_trace(*blk.attention_, tr.attention, rows, where, "attention", B);
            check_trace_part(tr.attention.prefix.rows() == cfg.n_persistent &&
                                 tr.attention.sharing == PrefixSharing::Shared,
                             where, "attention.prefix.rows()", tr.attention.prefix.rows(),
                             concat("n_persistent = ", cfg.n_persistent, ", shared"));
        }
        if (cfg.kind == BlockKind::MAG) {
            check_sub_trace(*blk.norm_y_, tr.norm_y, rows, where, "norm_y");
            check_sub_trace(*blk.norm_m_, tr.norm_m, rows, where, "norm_m");
            check_trace_view(cview(tr.a), rows, cfg.d_model, where, "a");
            check_trace_view(cview(tr.gate), rows, cfg.d_model, where, "gate");
        }
    }

private:
    /// A sub-layer's trace (trace.<part>): valid for `layer` (its messages name the part) and
    /// of `rows` rows (and, for a trace of sequences, of `batch` of them).
    template <class Layer, class Sub>
    static void check_sub_trace(const Layer& layer, const Sub& sub, Eigen::Index rows,
                                const char* where, const char* part, int batch = 0) {
        layer.validate_trace(sub, concat(where, " (trace.", part, ")").c_str());
        check_trace_part(sub.rows() == rows, where, concat(part, ".rows()"), sub.rows(),
                         concat(rows, " (the rows the block gives it)"));
        if constexpr (requires { sub.batch; }) {  // the memory's and the attention's
            check_trace_part(sub.batch == batch, where, concat(part, ".batch"), sub.batch,
                             concat("trace.batch = ", batch));
        }
    }

    static Eigen::Index prefix_rows(const BlockConfig& cfg) { return Mixer::prefix_rows(cfg); }

    static View<T> view(Buffer& b) { return Transfer::view(b); }
    static View<const T> cview(const Buffer& b) { return Transfer::view(b); }
    /// A 1 x n buffer of zeros in the backend's memory (a gradient accumulator).
    static Buffer zeros(Eigen::Index n) {
        Buffer b = Transfer::allocate(1, n);
        Glue::fill(view(b), T(0));
        return b;
    }

    /// The training forward on checked views: y = x + Mixer(u), y += FFN(RMSNorm(y)), each
    /// sub-layer's trace kept; state and trace replaced only if every step succeeds.
    static void forward_checked(const Blk& blk, State& state, View<const T> x, View<T> y,
                                Trace& trace) {
        const ThreadScope team(blk.threads_, 3.0 * blk.work_estimate(x.rows));
        State next = state;  // committed only if every step succeeds
        Trace t;
        t.cfg = blk.cfg_;
        t.batch = state.batch_;
        t.start = state.position_;
        t.rows = x.rows;
        Buffer u = Transfer::allocate(x.rows, x.cols);
        blk.norm_mix_.forward(x, view(u), t.norm_mix);
        try {
            Mixer::forward(blk, next, cview(u), y, t);
        } catch (const NonFiniteError& e) {
            blk.rethrow_named(e);
        }
        Glue::add(x, y, y);
        if (blk.cfg_.use_ffn) {  // u's rows are free again: every trace keeps its own input
            blk.require_residual_sum(View<const T>(y), state);
            blk.norm_ffn_.forward(y, view(u), t.norm_ffn);
            Buffer f = Transfer::allocate(x.rows, x.cols);
            blk.ffn_->forward(cview(u), view(f), t.ffn);
            Glue::add(y, cview(f), y);
        }
        blk.require_finite(View<const T>(y), state, "the output");
        next.position_ += x.rows / state.batch_;
        t.filled = true;
        trace = std::move(t);
        state = std::move(next);
    }

    /// The backward on checked views, dx the running dL/dh: dy, plus the FFN branch's, the
    /// mixer's adjoint through the first norm added last.
    static void accumulate_checked(const Blk& blk, const Trace& tr, View<const T> dy, View<T> dx,
                                   View<T> flat, BlockStateGradient<T>* d_in,
                                   const BlockStateGradient<T>* d_out) {
        if (d_out != nullptr && !d_out->empty()) {
            check_state_gradient(blk, tr, *d_out);
        }
        const BlockConfig& cfg = blk.cfg_;
        const auto g = BlockGradientViews<T>::cut(flat, *blk.params_, cfg);
        const ThreadScope team(blk.threads_, 3.0 * blk.work_estimate(tr.rows));
        Glue::copy(dy, dx);
        Buffer a = Transfer::allocate(dy.rows, dy.cols), b = Transfer::allocate(dy.rows, dy.cols);
        if (cfg.use_ffn) {
            blk.ffn_->backward(tr.ffn, dy, view(a), g.ffn);
            blk.norm_ffn_.backward(tr.norm_ffn, cview(a), view(b), g.norm_ffn);
            Glue::add(dx, cview(b), dx);
        }
        BlockStateGradient<T> d_start;  // stays empty for a fresh start: no earlier piece
        Mixer::backward(blk, tr, View<const T>(dx), view(a), g, d_out,
                        d_in != nullptr && tr.start != 0 ? &d_start : nullptr);
        blk.norm_mix_.backward(tr.norm_mix, cview(a), view(b), g.norm_mix);
        Glue::add(dx, cview(b), dx);
        if (Glue::nonfinite_row(View<const T>(dx)) >= 0 ||
            Glue::nonfinite_row(View<const T>(flat)) >= 0) {
            throw NonFiniteError(concat("Block::backward: the gradients overflow, expected "
                                        "finite values; grads are unchanged"));
        }
        if (d_in != nullptr) {
            *d_in = std::move(d_start);
        }
    }

    /// ConfigError unless blocks of this kind train on this backend (Blk::trains).
    static void require_kind_trains(BlockKind kind, const char* where) {
        if (!Blk::trains(kind)) {
            throw ConfigError(concat(
                where, ": a ", to_string(kind), " block does not train on this backend (MAC's "
                "training drives the memory's staged reverse, which this backend lacks), "
                "expected an LMM, MAG, MAL or SWA block here, or the CPU backend for MAC"));
        }
    }

    /// A training forward starts from a fresh state or, unless the memory trains from mid-chunk
    /// on this backend (the CPU's), one whose memory is at a chunk boundary.
    static void check_start(const Blk& blk, const State& state, const char* where) {
        if (backend::MemoryTraining<Backend, T>::mid_chunk || state.position_ == 0 ||
            !has_memory(blk.cfg_.kind)) {
            return;
        }
        if (state.memory_.pending() != 0) {
            throw ConfigError(concat(
                where, ": the memory is ", state.memory_.pending(), " tokens into a chunk, "
                "expected a chunk boundary (a continuing training forward needs the memory's "
                "position, persistent tokens included, a multiple of chunk = ",
                blk.cfg_.memory.chunk, ")"));
        }
    }

    /// d_out's parts the block's kind does not have must be empty (ConfigError); MAC's own are
    /// checked by MacTraining, the others' by the sub-layers' backward.
    static void check_state_gradient(const Blk& blk, const Trace& tr,
                                     const BlockStateGradient<T>& d) {
        const BlockKind kind = blk.cfg_.kind;
        if (kind == BlockKind::MAC) {
            if constexpr (mac_trains) {
                MacTraining<T, Backend>::check_state_gradient(blk, tr.memory, tr.batch,
                                                              tr.start + tr.rows / tr.batch, d);
            }
            return;
        }
        const char* part = kind == BlockKind::LMM && !d.attention.empty() ? "attention"
                           : !has_memory(kind) && !d.memory.empty()      ? "memory"
                           : !d.mac.empty()                              ? "mac"
                                                                         : nullptr;
        if (part != nullptr) {
            throw ConfigError(concat("Block::backward: d_state_out.", part, " given to a ",
                                     to_string(kind), " block, expected none (it has no ",
                                     part, " state)"));
        }
    }
};

}  // namespace detail

}  // namespace titans
