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
// with the mixer by kind (LMM, MAG, MAL, SWA here; MAC in mac_training.hpp).

#include <cstdint>
#include <utility>

#include "../detail/activation.hpp"
#include "../detail/check.hpp"
#include "../error.hpp"
#include "../detail/tensor_slots.hpp"
#include "block.hpp"
#include "mac_trace.hpp"
#include "mac_training.hpp"

namespace titans {

/// What Block's training forward keeps for backward (math §9): each sub-layer's trace, for MAG
/// the two factors of the gated output, for MAC u and each segment's reads and outputs.
/// Shapes: rows = B*N of the call.
template <class T, class Backend>
struct BlockTrace {
    BlockConfig cfg;
    int batch = 0;
    std::int64_t start = 0;  // the block's position at the call (0: P went through this call)
    Eigen::Index rows = 0;
    detail::TraceFilled filled;  // a moved-from trace is empty
    typename RMSNorm<T, Backend>::Trace norm_mix, norm_ffn, norm_y, norm_m;
    typename NeuralMemory<T, Backend>::Trace memory;     // over [P; u] per sequence (MAC: y)
    typename Attention<T, Backend>::Trace attention;  // MAG, SWA: u with prefix P; MAL: [P; M]
    typename FeedForward<T, Backend>::Trace ffn;
    Matrix<T> a, g;  // MAG: RMSNorm_y(attention output), sigma(RMSNorm_m(memory output))
    Matrix<T> u;     // MAC: RMSNorm_mix(x)
    std::vector<MacSegmentTrace<T>> segments;  // MAC

    [[nodiscard]] bool empty() const { return !filled; }
};

namespace detail {

/// Each sequence's rows of u (B*N x d, sequence-major) after the rows of P: (B*(p+N)) x d.
template <class T>
Matrix<T> with_prefix(const Matrix<T>& P, const Matrix<T>& u, int B) {
    const Eigen::Index p = P.rows(), N = u.rows() / B;
    Matrix<T> out(B * (p + N), u.cols());
    for (int b = 0; b < B; ++b) {
        out.middleRows(b * (p + N), p) = P;
        out.middleRows(b * (p + N) + p, N) = u.middleRows(b * N, N);
    }
    return out;
}

/// The inverse of with_prefix: the rows after each sequence's p prefix rows.
template <class T>
Matrix<T> without_prefix(const Matrix<T>& full, int B, Eigen::Index p) {
    const Eigen::Index N = full.rows() / B - p;
    Matrix<T> out(B * N, full.cols());
    for (int b = 0; b < B; ++b) {
        out.middleRows(b * N, N) = full.middleRows(b * (p + N) + p, N);
    }
    return out;
}

/// du (B*N x d) with p zero rows before each sequence's: the adjoint of without_prefix.
template <class T>
Matrix<T> zero_prefix(const Matrix<T>& du, int B, Eigen::Index p) {
    return with_prefix(Matrix<T>::Zero(p, du.cols()).eval(), du, B);
}

/// dP += the sum over sequences of the prefix rows of dfull: the adjoint of P in with_prefix
/// (nothing when p = 0: P did not go through this call).
template <class T>
void add_prefix_rows(const Matrix<T>& dfull, int B, Eigen::Index p, Matrix<T>& dP) {
    if (p == 0) {
        return;
    }
    const Eigen::Index n = dfull.rows() / B;
    for (int b = 0; b < B; ++b) {
        dP += dfull.middleRows(b * n, p);
    }
}

/// The body of Block's training calls (a friend of Block and BlockState).
template <class T, class Backend>
struct BlockTraining {
    using Blk = Block<T, Backend>;
    using State = BlockState<T, Backend>;
    using Trace = BlockTrace<T, Backend>;
    /// Whether MAC trains here: its training drives the memory's staged reverse.
    static constexpr bool mac_trains = backend::MemoryTraining<Backend, T>::staged;

    static void forward(const Blk& blk, State& state, const MatrixRef<T>& x, Matrix<T>& y,
                        Trace& trace) {
        constexpr const char* where = "Block::forward (training)";
        require_kind_trains(blk.cfg_.kind, where);
        blk.check(state, x, where);
        check_start(blk, state, where);
        const ThreadScope team(blk.threads_, 3.0 * blk.work_estimate(x.rows()));
        State next = state;  // committed only if every step succeeds
        Trace t;
        t.cfg = blk.cfg_;
        t.batch = state.batch_;
        t.start = state.position_;
        t.rows = x.rows();
        Matrix<T> u;
        blk.norm_mix_.forward(x, u, t.norm_mix);
        Matrix<T> h;
        try {
            h = x + mix(blk, next, u, t);
        } catch (const NonFiniteError& e) {
            blk.rethrow_named(e);
        }
        if (blk.cfg_.use_ffn) {
            blk.require_finite(h, state, "the mixer's residual sum");
            Matrix<T> z, f;
            blk.norm_ffn_.forward(h, z, t.norm_ffn);
            blk.ffn_->forward(z, f, t.ffn);
            h += f;
        }
        blk.require_finite(h, state, "the output");
        next.position_ += x.rows() / state.batch_;
        t.filled = true;
        y = std::move(h);
        trace = std::move(t);
        state = std::move(next);
    }

    /// Block::backward: accumulate into zeros, added to grads once every check has passed.
    static void backward(const Blk& blk, const Trace& tr, const MatrixRef<T>& dy, Matrix<T>& dx,
                         BlockParams<T>& grads, BlockStateGradient<T>* d_in,
                         const BlockStateGradient<T>* d_out) {
        constexpr const char* where = "Block::backward";
        const BlockConfig& cfg = blk.cfg_;
        check_trace(blk, tr, where);
        check_gradient_rows(dy, tr.rows, cfg.d_model, where, "dy");
        check_same_tensors(*blk.params_, grads, cfg, where, "grads");
        BlockParams<T> g = BlockParams<T>::zeros(cfg);
        accumulate(blk, tr, dy, dx, g, d_in, d_out);
        add_tensors(g, grads, cfg);
    }

    /// backward's work with g, of this block's tensor shapes, finite, taking the gradients
    /// (added to what it holds): what Model::backward calls with its own zeroed accumulator
    /// (no second accumulator, no pass over the caller's gradients). Checks as backward but
    /// g's; if it throws, dx and d_in are unchanged (g is the caller's to discard).
    static void accumulate(const Blk& blk, const Trace& tr, const MatrixRef<T>& dy,
                           Matrix<T>& dx, BlockParams<T>& g, BlockStateGradient<T>* d_in,
                           const BlockStateGradient<T>* d_out) {
        constexpr const char* where = "Block::backward";
        const BlockConfig& cfg = blk.cfg_;
        check_trace(blk, tr, where);
        check_gradient_rows(dy, tr.rows, cfg.d_model, where, "dy");
        if (overlaps(dy, dx)) {
            throw ShapeError(concat(where, ": dx shares storage with dy, expected a distinct "
                                           "matrix"));
        }
        if (d_out != nullptr && !d_out->empty()) {
            check_state_gradient(blk, tr, *d_out);
        }
        const ThreadScope team(blk.threads_, 3.0 * blk.work_estimate(tr.rows));
        Matrix<T> dh = dy;
        if (cfg.use_ffn) {
            Matrix<T> dz, dres;
            blk.ffn_->backward(tr.ffn, dy, dz, g.ffn);
            blk.norm_ffn_.backward(tr.norm_ffn, dz, dres, g.norm_ffn);
            dh += dres;
        }
        BlockStateGradient<T> d_start;  // stays empty for a fresh start: no earlier piece
        const Matrix<T> du = mix_backward(blk, tr, dh, g, d_out,
                                          d_in != nullptr && tr.start != 0 ? &d_start : nullptr);
        Matrix<T> dres;
        blk.norm_mix_.backward(tr.norm_mix, du, dres, g.norm_mix);
        dh += dres;
        if (!all_finite(dh) || !tensors_finite(g, cfg)) {
            throw NonFiniteError(concat(where, ": the gradients overflow, expected finite "
                                               "values; grads are unchanged"));
        }
        dx = std::move(dh);
        if (d_in != nullptr) {
            *d_in = std::move(d_start);
        }
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
            check_trace_shape(tr.u, rows, cfg.d_model, where, "u");
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
            check_trace_shape(tr.a, rows, cfg.d_model, where, "a");
            check_trace_shape(tr.g, rows, cfg.d_model, where, "g");
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

    static Eigen::Index prefix_rows(const BlockConfig& cfg) {
        return cfg.kind == BlockKind::MAG || cfg.kind == BlockKind::MAL ? cfg.n_persistent : 0;
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

    /// A training forward starts from a fresh state or one whose memory is at a chunk boundary.
    static void check_start(const Blk& blk, const State& state, const char* where) {
        if (state.position_ == 0 || !has_memory(blk.cfg_.kind)) {
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

    /// SWA*(P ‖ u), MAG's attention and SWA's mixer: every position sees all of P (none when
    /// N_p = 0) and its window of u; the trace keeps P for the prefix gradient.
    static Matrix<T> prefix_attention(const Blk& blk, State& next, const Matrix<T>& u, Trace& t) {
        const Matrix<T>& P = blk.params_->persistent;
        Matrix<T> y;
        blk.attention_->forward(next.attention_, u, y, t.attention,
                                blk.cfg_.n_persistent > 0 ? &P : nullptr);
        return y;
    }

    /// prefix_attention's backward: dy -> du (resized), the attention's gradients and P's
    /// added to g, the window's state adjoint through da_out / da_in.
    static void prefix_attention_backward(const Blk& blk, const Trace& tr, const Matrix<T>& dy,
                                          Matrix<T>& du, BlockParams<T>& g,
                                          AttentionStateGradient<T>* da_in,
                                          const AttentionStateGradient<T>* da_out) {
        const bool has_p = blk.cfg_.n_persistent > 0;
        Matrix<T> dP;
        blk.attention_->backward(tr.attention, dy, du, g.attention, has_p ? &dP : nullptr, da_in,
                                 da_out);
        if (has_p) g.persistent += dP;
    }

    /// The mixer's training forward on u. From a fresh state, next's memory (and MAL's
    /// attention) restart from fresh states that take P first; else they continue.
    static Matrix<T> mix(const Blk& blk, State& next, const Matrix<T>& u, Trace& t) {
        const BlockConfig& cfg = blk.cfg_;
        const int B = next.batch_;
        const Matrix<T>& P = blk.params_->persistent;
        const bool fresh = next.position_ == 0;
        const Eigen::Index p = fresh ? prefix_rows(cfg) : 0;
        if constexpr (mac_trains) {
            if (cfg.kind == BlockKind::MAC) {
                t.u = u;
                return MacTraining<T, Backend>::forward(blk, next, u, t.memory, t.segments);
            }
        }
        if (cfg.kind == BlockKind::SWA) {  // o = SWA*(P ‖ u): MAG's attention branch alone
            return prefix_attention(blk, next, u, t);
        }
        if (fresh) {
            next.memory_ = blk.memory_->make_state(B);
        }
        Matrix<T> m;
        if (cfg.kind == BlockKind::LMM) {
            blk.memory_->forward(next.memory_, u, m, t.memory);
            return m;
        }
        blk.memory_->forward(next.memory_, p > 0 ? with_prefix(P, u, B) : u, m, t.memory);
        Matrix<T> y;
        if (cfg.kind == BlockKind::MAL) {
            if (fresh) {
                next.attention_ = blk.attention_->make_state(B);
            }
            blk.attention_->forward(next.attention_, m, y, t.attention);
            return p > 0 ? without_prefix(y, B, p) : y;
        }
        // MAG: o = RMSNorm_y(SWA*(P ‖ u)) ⊙ σ(RMSNorm_m(M(P ‖ u))).
        y = prefix_attention(blk, next, u, t);
        Matrix<T> gl;
        blk.norm_y_->forward(y, t.a, t.norm_y);
        blk.norm_m_->forward(p > 0 ? without_prefix(m, B, p) : m, gl, t.norm_m);
        t.g = gl.unaryExpr([](T v) { return sigmoid(v); });
        return t.a.cwiseProduct(t.g);
    }

    /// The mixer's backward: do (B*N x d) -> du; parameter gradients added to g; the state's
    /// adjoint through the memory and the attention (d_out in, d_in out, either may be null).
    static Matrix<T> mix_backward(const Blk& blk, const Trace& tr, const Matrix<T>& dout,
                                  BlockParams<T>& g, const BlockStateGradient<T>* d_out,
                                  BlockStateGradient<T>* d_in) {
        const BlockConfig& cfg = blk.cfg_;
        const int B = tr.batch;
        const Eigen::Index p = tr.start == 0 ? prefix_rows(cfg) : 0;
        const auto* dm_out = d_out != nullptr ? &d_out->memory : nullptr;
        const auto* da_out = d_out != nullptr ? &d_out->attention : nullptr;
        auto* dm_in = d_in != nullptr ? &d_in->memory : nullptr;
        auto* da_in = d_in != nullptr ? &d_in->attention : nullptr;
        Matrix<T> du, dfull;
        if constexpr (mac_trains) {
            if (cfg.kind == BlockKind::MAC) {
                return MacTraining<T, Backend>::backward(blk, tr.memory, tr.segments, tr.u, B,
                                                         tr.start, dout, g, d_out, d_in);
            }
        }
        if (cfg.kind == BlockKind::LMM) {
            blk.memory_->backward(tr.memory, dout, du, g.memory, dm_in, dm_out);
            return du;
        }
        if (cfg.kind == BlockKind::SWA) {
            prefix_attention_backward(blk, tr, dout, du, g, da_in, da_out);
            return du;
        }
        if (cfg.kind == BlockKind::MAL) {
            Matrix<T> dm;
            blk.attention_->backward(tr.attention, zero_prefix(dout, B, p), dm, g.attention,
                                     nullptr, da_in, da_out);
            blk.memory_->backward(tr.memory, dm, dfull, g.memory, dm_in, dm_out);
            add_prefix_rows(dfull, B, p, g.persistent);
            return without_prefix(dfull, B, p);
        }
        const Matrix<T> da = dout.cwiseProduct(tr.g);
        const Matrix<T> dgl = (dout.array() * tr.a.array() * tr.g.array() *
                               (T(1) - tr.g.array())).matrix();
        Matrix<T> dya, dm;
        blk.norm_y_->backward(tr.norm_y, da, dya, g.norm_y);
        blk.norm_m_->backward(tr.norm_m, dgl, dm, g.norm_m);
        prefix_attention_backward(blk, tr, dya, du, g, da_in, da_out);
        blk.memory_->backward(tr.memory, zero_prefix(dm, B, p), dfull, g.memory, dm_in, dm_out);
        add_prefix_rows(dfull, B, p, g.persistent);
        du += without_prefix(dfull, B, p);
        return du;
    }
};

}  // namespace detail

}  // namespace titans
