#pragma once
// titans/models/block.hpp: the Titans blocks (SPEC §7): memory alone (LMM), memory as a
// context (MAC), as a gate (MAG), as a layer (MAL), each a pre-norm residual block
//     h = x + Mixer(RMSNorm(x)),   out = h + FFN(RMSNorm(h))

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../attention/attention.hpp"
#include "../attention/rope.hpp"
#include "../detail/check.hpp"
#include "../detail/activation.hpp"
#include "../detail/eigen_math.hpp"
#include "../detail/enum_names.hpp"
#include "../detail/float_env.hpp"
#include "../detail/visit.hpp"
#include "../detail/random.hpp"
#include "../error.hpp"
#include "../layers/feed_forward.hpp"
#include "../layers/rms_norm.hpp"
#include "../memory/mlp.hpp"
#include "../memory/neural_memory.hpp"
#include "../types.hpp"

namespace titans {

/// Which sequence mixer a block uses (SPEC §7).
enum class BlockKind {
    LMM,  ///< the neural memory alone: Mixer(u) = M(u)
    MAC,  ///< memory as a context: segments attend over P ‖ M*_{t-1}(S) ‖ S, then write/gate
    MAG,  ///< memory as a gate: RMSNorm(SWA*(P ‖ u)) ⊙ σ(RMSNorm(M(P ‖ u)))
    MAL,  ///< memory as a layer: SWA(M(P ‖ u))
};

[[nodiscard]] inline const char* to_string(BlockKind k) {
    switch (k) {
        case BlockKind::LMM: return "LMM";
        case BlockKind::MAC: return "MAC";
        case BlockKind::MAG: return "MAG";
        case BlockKind::MAL: return "MAL";
    }
    return "?";
}

/// Inverse of to_string: sets `out` and returns true if `s` names an enumerator, else false.
[[nodiscard]] inline bool from_string(std::string_view s, BlockKind& out) {
    return detail::enum_from_string(s, out,
                                    {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL});
}

/// Settings of one block. `memory.d_model`, `attention.d_model` and `ffn.d_model` must all
/// equal `d_model` (make() sets them). For MAC, `segment` is C and the attention window is
/// not used (every token sees its whole segment prefix); for MAG and MAL the window is w.
struct BlockConfig {
    BlockKind kind = BlockKind::MAG;
    int d_model = 64;
    MemoryConfig memory{};
    AttentionConfig attention{};
    int n_persistent = 4;  ///< N_p persistent tokens (SPEC §6); unused by LMM
    int segment = 64;      ///< C, MAC segment length (absolute positions)
    bool use_ffn = true;
    FeedForwardConfig ffn{};
    double norm_eps = 1e-6;

    /// A block of kind `kind`, width d, H heads for memory and attention, memory depth L,
    /// window / segment `span`, with the memory chunk `chunk`. MAC's memory reads with
    /// Retrieval::InChunk so "the updated memory" of SPEC §7 includes the token's own write.
    [[nodiscard]] static BlockConfig make(BlockKind kind, int d, int heads, int depth, int span,
                                          int chunk = 64) {
        BlockConfig c;
        c.kind = kind;
        c.d_model = d;
        c.memory.d_model = d;
        c.memory.n_heads = heads;
        c.memory.depth = depth;
        c.memory.chunk = chunk;
        c.memory.retrieval = kind == BlockKind::MAC ? Retrieval::InChunk : Retrieval::Lagged;
        c.attention.d_model = d;
        c.attention.n_heads = heads;
        c.attention.window = span;
        c.segment = span;
        c.ffn.d_model = d;
        return c;
    }

    /// Serialization hook: calls v(name, field) for every setting, in declaration order: kind,
    /// d_model, memory.* (MemoryConfig::fields), attention.*, n_persistent, segment, use_ffn,
    /// ffn.*, norm_eps. Every field is visited whatever the kind (attention.* for LMM too).
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, BlockConfig>);
        using S = std::string;
        v(S("kind"), self.kind);
        v(S("d_model"), self.d_model);
        MemoryConfig::fields(self.memory, detail::prefixed("memory", v));
        AttentionConfig::fields(self.attention, detail::prefixed("attention", v));
        v(S("n_persistent"), self.n_persistent);
        v(S("segment"), self.segment);
        v(S("use_ffn"), self.use_ffn);
        FeedForwardConfig::fields(self.ffn, detail::prefixed("ffn", v));
        v(S("norm_eps"), self.norm_eps);
    }

    void validate() const {
        constexpr const char* w = "BlockConfig";
        detail::require<ConfigError>(d_model >= 1, w, "d_model", d_model, ">= 1");
        memory.validate();
        detail::require<ConfigError>(memory.d_model == d_model, w, "memory.d_model",
                                     memory.d_model, detail::concat("d_model = ", d_model));
        if (kind != BlockKind::LMM) {
            attention.validate();
            detail::require<ConfigError>(attention.d_model == d_model, w, "attention.d_model",
                                         attention.d_model, detail::concat("d_model = ", d_model));
            detail::require<ConfigError>(n_persistent >= 0, w, "n_persistent", n_persistent,
                                         ">= 0");
        }
        if (kind == BlockKind::MAC) {
            detail::require<ConfigError>(segment >= 1, w, "segment", segment, ">= 1");
        }
        if (use_ffn) {
            ffn.validate();
            detail::require<ConfigError>(ffn.d_model == d_model, w, "ffn.d_model", ffn.d_model,
                                         detail::concat("d_model = ", d_model));
        }
        detail::require<ConfigError>(norm_eps > 0, w, "norm_eps", norm_eps, "> 0");
    }
};

/// Outer parameters of a block. Shapes (d = d_model, N_p = n_persistent):
///   norm_mix, norm_ffn   1 x d    pre-norm weights of the two sub-blocks
///   memory               see MemoryParams
///   attention            see AttentionParams (empty for LMM)
///   persistent           N_p x d  persistent tokens P (SPEC §6; empty for LMM)
///   norm_y, norm_m       1 x d    MAG's output norms (empty otherwise)
///   ffn                  see FeedForwardParams (empty if !use_ffn)
template <class T>
struct BlockParams {
    RowVector<T> norm_mix, norm_ffn;
    MemoryParams<T> memory;
    AttentionParams<T> attention;
    Matrix<T> persistent;
    RowVector<T> norm_y, norm_m;
    FeedForwardParams<T> ffn;

    /// Seeded parameters: norms 1, persistent tokens N(0, 1), the rest from each part's random().
    [[nodiscard]] static BlockParams random(const BlockConfig& cfg, std::uint64_t seed) {
        return generate(cfg, seed, true);
    }
    /// Every tensor at its shape, zero-filled, without the generator's work: what a loader
    /// (titans::io::load_parameters) fills. Not a usable initialisation.
    [[nodiscard]] static BlockParams zeros(const BlockConfig& cfg) { return generate(cfg, 0, false); }
    /// random() (draw) or zeros() (!draw).
    [[nodiscard]] static BlockParams generate(const BlockConfig& cfg, std::uint64_t seed,
                                              bool draw) {
        cfg.validate();
        BlockParams p;
        const int d = cfg.d_model;
        p.norm_mix = RowVector<T>::Ones(d);
        p.norm_ffn = RowVector<T>::Ones(d);
        p.memory = MemoryParams<T>::generate(cfg.memory, seed * 4 + 1, draw);
        if (cfg.kind != BlockKind::LMM) {
            p.attention = AttentionParams<T>::generate(cfg.attention, seed * 4 + 2, draw);
            p.persistent = detail::TensorDraw<T>(seed * 4 + 3, draw)(cfg.n_persistent, d, 1.0);
        }
        if (cfg.kind == BlockKind::MAG) {
            p.norm_y = RowVector<T>::Ones(d);
            p.norm_m = RowVector<T>::Ones(d);
        }
        if (cfg.use_ffn) {
            p.ffn = FeedForwardParams<T>::generate(cfg.ffn, seed * 4 + 4, draw);
        }
        return p;
    }

    /// Serialization hook: calls v(name, tensor) for every tensor `cfg` uses, in this order:
    /// norm_mix, norm_ffn, memory.*, attention.* and persistent (not LMM), norm_y and norm_m
    /// (MAG), ffn.* (use_ffn); tensor is the member itself (const if Self is).
    template <class Self, class V>
    static void tensors(Self& self, const BlockConfig& cfg, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, BlockParams>);
        using S = std::string;
        v(S("norm_mix"), self.norm_mix);
        v(S("norm_ffn"), self.norm_ffn);
        MemoryParams<T>::tensors(self.memory, cfg.memory, detail::prefixed("memory", v));
        if (cfg.kind != BlockKind::LMM) {
            AttentionParams<T>::tensors(self.attention, cfg.attention,
                                        detail::prefixed("attention", v));
            v(S("persistent"), self.persistent);
        }
        if (cfg.kind == BlockKind::MAG) {
            v(S("norm_y"), self.norm_y);
            v(S("norm_m"), self.norm_m);
        }
        if (cfg.use_ffn) {
            FeedForwardParams<T>::tensors(self.ffn, cfg.ffn, detail::prefixed("ffn", v));
        }
    }

    /// Throws ShapeError / NonFiniteError naming the first bad tensor.
    void validate(const BlockConfig& cfg) const {
        const Eigen::Index d = cfg.d_model;
        const detail::TensorCheck check{"BlockParams"};
        check(norm_mix, "norm_mix", 1, d);
        check(norm_ffn, "norm_ffn", 1, d);
        memory.validate(cfg.memory);
        if (cfg.kind != BlockKind::LMM) {
            attention.validate(cfg.attention);
            check(persistent, "persistent", cfg.n_persistent, d);
        }
        if (cfg.kind == BlockKind::MAG) {
            check(norm_y, "norm_y", 1, d);
            check(norm_m, "norm_m", 1, d);
        }
        if (cfg.use_ffn) {
            ffn.validate(cfg.ffn);
        }
    }
};

template <class T>
class Block;

/// The state of B streams through one block: the memory's state, the attention's KV ring
/// buffer (MAG, MAL), and for MAC the keys/values of the segment in progress and the memory
/// weights at the segment's start. Made by Block::make_state(B); copyable.
template <class T>
class BlockState {
public:
    BlockState() = default;
    [[nodiscard]] int batch() const { return batch_; }
    /// Tokens seen per sequence (persistent tokens not counted).
    [[nodiscard]] std::int64_t position() const { return position_; }
    [[nodiscard]] const MemoryState<T>& memory() const { return memory_; }
    [[nodiscard]] const AttentionState<T>& attention() const { return attention_; }

    /// Serialization hook (checkpoints): calls v(name, x) for everything a resumed stream needs
    /// to continue bit-identically, x a Matrix<T>& or std::int64_t& (const if Self is):
    ///     position               std::int64_t (block tokens; the memory's own position
    ///                            also counts the persistent tokens for MAG and MAL)
    ///     memory.*               MemoryState::tensors
    ///     attention.*            AttentionState::tensors (MAG, MAL; its k/v rows vary)
    ///     seg_k.{b}, seg_v.{b}   MAC: keys/values of the segment in progress, 2C x D_att
    ///     snapshot.{b}.{h}.{l}   MAC: memory weights at the segment start, layer_in x layer_out
    /// Load into a state from make_state() of the same block. P W_K and P W_V (MAC) are not
    /// visited: make_state derives them from the parameters.
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, BlockState>);
        v(std::string("position"), self.position_);
        MemoryState<T>::tensors(self.memory_, detail::prefixed("memory", v));
        if (self.kind_ == BlockKind::MAG || self.kind_ == BlockKind::MAL) {
            AttentionState<T>::tensors(self.attention_, detail::prefixed("attention", v));
        }
        if (self.kind_ == BlockKind::MAC) {
            for (std::size_t b = 0; b < self.seg_k_.size(); ++b) {
                v(detail::visit_name("seg_k", b), self.seg_k_[b]);
            }
            for (std::size_t b = 0; b < self.seg_v_.size(); ++b) {
                v(detail::visit_name("seg_v", b), self.seg_v_[b]);
            }
            const auto H = static_cast<std::size_t>(self.memory_.config().n_heads);
            for (std::size_t i = 0; i < self.snapshot_.size(); ++i) {
                for (std::size_t l = 0; l < self.snapshot_[i].size(); ++l) {
                    v(detail::visit_name("snapshot", i / H, i % H, l), self.snapshot_[i][l]);
                }
            }
        }
    }

private:
    friend class Block<T>;
    BlockKind kind_ = BlockKind::LMM;
    int segment_ = 0, n_persistent_ = 0, d_model_ = 0, attention_dim_ = 0;  // buffer sizes
    int batch_ = 0;
    std::int64_t position_ = 0;
    MemoryState<T> memory_;
    AttentionState<T> attention_;
    // MAC: per sequence the interleaved keys/values [h_0, s_0, h_1, s_1, ...] of the segment
    // in progress (2C x D_att), and per (sequence, head) the memory weights M_{t-1} at its start.
    std::vector<Matrix<T>> seg_k_, seg_v_;
    std::vector<std::vector<Matrix<T>>> snapshot_;
    Matrix<T> k_prefix_, v_prefix_;  // P W_K, P W_V (MAC)
};

/// One Titans block (SPEC §7), pre-norm and residual:
///     u = RMSNorm(x),  h = x + Mixer(u),  out = h + FFN(RMSNorm(h))
/// with Mixer by kind (P = persistent tokens, M = the neural memory, streamed):
///   LMM  M(u)
///   MAG  o = RMSNorm_y(SWA*(P ‖ u)) ⊙ σ(RMSNorm_m(M(P ‖ u)))   (P always visible, window w)
///   MAL  o = SWA(M(P ‖ u))                                      (plain window over P ‖ u)
///   MAC  per segment S of C tokens: h = M*_{t-1}(S) (read, memory as at the segment start),
///        y = Attn(P ‖ h ‖ S) (rows of S), write M with y, o = y ⊙ σ(M*_t(y))
/// P enters the memory (MAG, MAL) and the attention's window (MAL) once, at the start of each
/// stream (make_state). Shapes: x (B*N) x d -> (B*N) x d. Streaming in pieces of any sizes
/// equals one call. Choices where SPEC is silent (docs/math.md §9): MAC's h rows are visible
/// causally (h_j to tokens j' >= j of the segment) and M*_t(y_i) is the in-chunk read after
/// token i's own write, so no output depends on a later token; h is read from the memory's
/// query projection without its conv (the conv belongs to the memory's own input stream).
///
///     auto cfg = titans::BlockConfig::make(titans::BlockKind::MAG, 64, 4, 2, 128);
///     titans::Block<float> block(cfg, titans::BlockParams<float>::random(cfg, 1));
///     auto st = block.make_state(1);
///     titans::Matrixf y = block.forward(st, x);   // x: N x 64
template <class T>
class Block {
public:
    using State = BlockState<T>;

    Block(BlockConfig config, BlockParams<T> params)
        : cfg_(std::move(config)),
          params_(std::move(params)),
          memory_(validated(cfg_, params_).memory, params_.memory),
          norm_mix_(params_.norm_mix, cfg_.norm_eps),
          norm_ffn_(params_.norm_ffn, cfg_.norm_eps) {
        if (cfg_.kind != BlockKind::LMM) {
            attention_.emplace(cfg_.attention, params_.attention);
        }
        if (cfg_.kind == BlockKind::MAG) {
            norm_y_.emplace(params_.norm_y, cfg_.norm_eps);
            norm_m_.emplace(params_.norm_m, cfg_.norm_eps);
        }
        if (cfg_.use_ffn) {
            ffn_.emplace(cfg_.ffn, params_.ffn);
        }
    }

    [[nodiscard]] const BlockConfig& config() const { return cfg_; }
    [[nodiscard]] const BlockParams<T>& params() const { return params_; }
    [[nodiscard]] const NeuralMemory<T>& memory() const { return memory_; }

    /// A fresh state for `batch` streams; for MAG and MAL the memory (and for MAL the
    /// attention window) has already consumed the persistent tokens.
    [[nodiscard]] State make_state(int batch = 1) const {
        State st;
        st.kind_ = cfg_.kind;
        st.segment_ = cfg_.segment;
        st.n_persistent_ = cfg_.n_persistent;
        st.d_model_ = cfg_.d_model;
        st.attention_dim_ = cfg_.attention.inner_dim();
        st.batch_ = batch;
        st.memory_ = memory_.make_state(batch);
        if (cfg_.kind != BlockKind::LMM) {
            st.attention_ = attention_->make_state(batch);
        }
        const Eigen::Index np = cfg_.n_persistent;
        if ((cfg_.kind == BlockKind::MAG || cfg_.kind == BlockKind::MAL) && np > 0) {
            Matrix<T> p(np * batch, cfg_.d_model);
            for (int b = 0; b < batch; ++b) {
                p.middleRows(b * np, np) = params_.persistent;
            }
            Matrix<T> yp = memory_.forward(st.memory_, p);
            if (cfg_.kind == BlockKind::MAL) {
                (void)attention_->forward(st.attention_, yp);
            }
        }
        if (cfg_.kind == BlockKind::MAC) {
            const int D = cfg_.attention.inner_dim();
            st.seg_k_.assign(static_cast<std::size_t>(batch), Matrix<T>::Zero(2 * cfg_.segment, D));
            st.seg_v_ = st.seg_k_;
            // Filled now (refreshed at every segment start) so every entry has a fixed shape.
            const int Hm = cfg_.memory.n_heads;
            st.snapshot_.resize(static_cast<std::size_t>(batch) * static_cast<std::size_t>(Hm));
            for (int b = 0; b < batch; ++b) {
                for (int h = 0; h < Hm; ++h) {
                    st.snapshot_[static_cast<std::size_t>(b * Hm + h)] =
                        memory_.current_weights(st.memory_, b, h);
                }
            }
            st.k_prefix_ = params_.persistent * params_.attention.w_k;
            st.v_prefix_ = params_.persistent * params_.attention.w_v;
        }
        return st;
    }

    /// The next piece of every stream: x (B*N) x d -> (B*N) x d.
    [[nodiscard]] Matrix<T> forward(State& state, const Matrix<T>& x) const {
        check(state, x, "Block::forward");
        const Matrix<T> u = norm_mix_.forward(x);
        Matrix<T> h = x + mix(state, u);
        if (cfg_.use_ffn) {
            h += ffn_->forward(norm_ffn_.forward(h));
        }
        return h;
    }

    /// The mixer alone (SPEC §7) on already-normalised input u: (B*N) x d -> (B*N) x d.
    /// Advances the state (memory, attention, position) like forward().
    [[nodiscard]] Matrix<T> mix(State& state, const Matrix<T>& u) const {
        check(state, u, "Block::mix");
        Matrix<T> o;
        switch (cfg_.kind) {
            case BlockKind::LMM: o = memory_.forward(state.memory_, u); break;
            case BlockKind::MAG: o = mix_mag(state, u); break;
            case BlockKind::MAL:
                o = attention_->forward(state.attention_, memory_.forward(state.memory_, u));
                break;
            case BlockKind::MAC: o = mix_mac(state, u); break;
        }
        state.position_ += u.rows() / state.batch_;
        return o;
    }

private:
    void check(const State& state, const Matrix<T>& x, const char* where) const {
        if (state.batch_ < 1 || state.kind_ != cfg_.kind || state.segment_ != cfg_.segment ||
            state.n_persistent_ != cfg_.n_persistent || state.d_model_ != cfg_.d_model ||
            state.attention_dim_ != cfg_.attention.inner_dim()) {
            throw ConfigError(detail::concat(where, ": state was made for a different block (or "
                                                    "default-constructed), expected a state from "
                                                    "make_state() of this block"));
        }
        if (x.cols() != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": x has ", x.cols(),
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (x.rows() % state.batch_ != 0) {
            throw ShapeError(detail::concat(where, ": x has ", x.rows(),
                                            " rows, expected a multiple of the state's batch = ",
                                            state.batch_));
        }
        if (!detail::all_finite(x)) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
    }

    static const BlockConfig& validated(const BlockConfig& cfg, const BlockParams<T>& p) {
        cfg.validate();
        p.validate(cfg);
        return cfg;
    }
    static T sigmoid(T v) { return detail::sigmoid(v); }

    Matrix<T> mix_mag(State& st, const Matrix<T>& u) const {
        const Matrix<T>* prefix = cfg_.n_persistent > 0 ? &params_.persistent : nullptr;
        const Matrix<T> y = attention_->forward(st.attention_, u, prefix);
        const Matrix<T> m = memory_.forward(st.memory_, u);
        Matrix<T> gate = norm_m_->forward(m);
        gate = gate.unaryExpr([](T v) { return sigmoid(v); });
        return (norm_y_->forward(y).array() * gate.array()).matrix();
    }

    /// h rows of MAC: the memory's query path (W_Q, phi, L2 norm; no conv) read through the
    /// snapshot weights of each head, concatenated and projected by the memory's W_O.
    Matrix<T> read_snapshot(const State& st, int b, const Matrix<T>& u) const {
        const MemoryConfig& mc = cfg_.memory;
        const MemoryParams<T>& mp = params_.memory;
        const int H = mc.n_heads, dh = mc.head_dim();
        Matrix<T> q = u * mp.w_q;
        if (mc.qkv_activation == Activation::SiLU) {
            detail::activate_in_place(Activation::SiLU, q);
        }
        if (mc.normalize_qk) {
            detail::l2_normalize_heads(q, H, dh);
        }
        Matrix<T> heads(u.rows(), mc.inner_dim());
        for (int h = 0; h < H; ++h) {
            const Matrix<T> qh = q.middleCols(h * dh, dh);
            const auto& W = st.snapshot_[static_cast<std::size_t>(b * H + h)];
            heads.middleCols(h * dh, dh) = memory_forward(W, qh, mc.activation, mc.residual);
        }
        return heads * mp.w_o;
    }

    Matrix<T> mix_mac(State& st, const Matrix<T>& u) const {
        const int B = st.batch_, C = cfg_.segment, Hm = cfg_.memory.n_heads;
        const int Ha = cfg_.attention.n_heads, dha = cfg_.attention.head_dim();
        const Eigen::Index N = u.rows() / B;
        const AttentionParams<T>& ap = params_.attention;
        Matrix<T> out(u.rows(), cfg_.d_model);
        Eigen::Index t = 0;
        while (t < N) {
            const std::int64_t pos = st.position_ + t;
            const int o = static_cast<int>(pos % C);
            const int m = static_cast<int>(std::min<Eigen::Index>(C - o, N - t));
            if (o == 0) {  // segment start: remember M_{t-1}
                for (int b = 0; b < B; ++b) {
                    for (int h = 0; h < Hm; ++h) {
                        st.snapshot_[static_cast<std::size_t>(b * Hm + h)] =
                            memory_.current_weights(st.memory_, b, h);
                    }
                }
            }
            Matrix<T> y(static_cast<Eigen::Index>(B) * m, cfg_.d_model);
            for (int b = 0; b < B; ++b) {
                const Matrix<T> us = u.middleRows(b * N + t, m);
                const Matrix<T> hrows = read_snapshot(st, b, us);
                Matrix<T> qs = us * ap.w_q, ks = us * ap.w_k;
                const Matrix<T> vs = us * ap.w_v;
                if (cfg_.attention.rope) {
                    apply_rope(qs, Ha, dha, pos, cfg_.attention.rope_base);
                    apply_rope(ks, Ha, dha, pos, cfg_.attention.rope_base);
                }
                const Matrix<T> kh = hrows * ap.w_k, vh = hrows * ap.w_v;
                Matrix<T>& sk = st.seg_k_[static_cast<std::size_t>(b)];
                Matrix<T>& sv = st.seg_v_[static_cast<std::size_t>(b)];
                for (int i = 0; i < m; ++i) {
                    sk.row(2 * (o + i)) = kh.row(i);
                    sv.row(2 * (o + i)) = vh.row(i);
                    sk.row(2 * (o + i) + 1) = ks.row(i);
                    sv.row(2 * (o + i) + 1) = vs.row(i);
                }
                // Query of token o+i sits at interleaved position 2(o+i)+1 (query stride 2) and
                // sees P, then h_0..h_{o+i} and s_0..s_{o+i}: causal over the segment, h
                // included.
                Matrix<T> att(m, qs.cols());
                prefix_window_attention<T>(qs, st.k_prefix_, st.v_prefix_,
                                           sk.topRows(2 * (o + m)), sv.topRows(2 * (o + m)), Ha,
                                           dha, 2 * C, 2 * o + 1, att, /*query_stride=*/2);
                y.middleRows(static_cast<Eigen::Index>(b) * m, m) = att * ap.w_o;
            }
            // Write the memory with y, read the updated memory: o = y ⊙ σ(M*_t(y)).
            const Matrix<T> r = memory_.forward(st.memory_, y);
            for (int b = 0; b < B; ++b) {
                out.middleRows(b * N + t, m) =
                    (y.middleRows(static_cast<Eigen::Index>(b) * m, m).array() *
                     r.middleRows(static_cast<Eigen::Index>(b) * m, m)
                         .unaryExpr([](T v) { return sigmoid(v); })
                         .array())
                        .matrix();
            }
            t += m;
        }
        return out;
    }

    BlockConfig cfg_;
    BlockParams<T> params_;
    NeuralMemory<T> memory_;
    RMSNorm<T> norm_mix_, norm_ffn_;
    std::optional<Attention<T>> attention_;    // all kinds but LMM
    std::optional<RMSNorm<T>> norm_y_, norm_m_;  // MAG
    std::optional<FeedForward<T>> ffn_;        // if use_ffn
};

}  // namespace titans
