#pragma once
// titans/models/model.hpp: a stack of Titans blocks with an embedding (or raw vectors in),
// a final RMSNorm and an output head.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/visit.hpp"
#include "../detail/random.hpp"
#include "../error.hpp"
#include "../layers/rms_norm.hpp"
#include "../types.hpp"
#include "block.hpp"

namespace titans {

/// Settings of a Model. vocab_size > 0: token ids in, logits (vocab_size wide) out.
/// vocab_size = 0: raw d_model-wide vectors in, d_out-wide vectors out (d_out = 0: d_model).
struct ModelConfig {
    int vocab_size = 0;
    int d_model = 64;
    int d_out = 0;
    std::vector<BlockConfig> blocks;  ///< one per layer; kinds may be mixed
    double norm_eps = 1e-6;

    /// `n_layers` blocks of one kind (see BlockConfig::make).
    [[nodiscard]] static ModelConfig uniform(BlockKind kind, int n_layers, int d, int heads,
                                             int depth, int span, int vocab = 0, int chunk = 64) {
        ModelConfig c;
        c.vocab_size = vocab;
        c.d_model = d;
        for (int i = 0; i < n_layers; ++i) {
            c.blocks.push_back(BlockConfig::make(kind, d, heads, depth, span, chunk));
        }
        return c;
    }

    [[nodiscard]] int output_dim() const {
        return vocab_size > 0 ? vocab_size : (d_out > 0 ? d_out : d_model);
    }

    /// Serialization hook: calls v(name, field) for every setting, in declaration order:
    /// vocab_size, d_model, d_out, blocks.{i}.* (BlockConfig::fields) for every block,
    /// norm_eps. The number of blocks is not a field: a reader sizes `blocks` before visiting.
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, ModelConfig>);
        using S = std::string;
        v(S("vocab_size"), self.vocab_size);
        v(S("d_model"), self.d_model);
        v(S("d_out"), self.d_out);
        for (std::size_t i = 0; i < self.blocks.size(); ++i) {
            BlockConfig::fields(self.blocks[i],
                                detail::prefixed(detail::visit_name("blocks", i), v));
        }
        v(S("norm_eps"), self.norm_eps);
    }

    void validate() const {
        constexpr const char* w = "ModelConfig";
        detail::require<ConfigError>(vocab_size >= 0, w, "vocab_size", vocab_size,
                                     ">= 0 (0 means vectors in and out)");
        detail::require<ConfigError>(d_model >= 1, w, "d_model", d_model, ">= 1");
        detail::require<ConfigError>(d_out >= 0, w, "d_out", d_out, ">= 0");
        detail::require<ConfigError>(!blocks.empty(), w, "blocks.size()", blocks.size(), ">= 1");
        detail::require<ConfigError>(norm_eps > 0, w, "norm_eps", norm_eps, "> 0");
        for (std::size_t i = 0; i < blocks.size(); ++i) {
            blocks[i].validate();
            detail::require<ConfigError>(blocks[i].d_model == d_model, w,
                                         detail::concat("blocks[", i, "].d_model").c_str(),
                                         blocks[i].d_model, detail::concat("d_model = ", d_model));
        }
    }
};

/// Outer parameters of a Model: embedding (vocab_size x d; empty without a vocabulary),
/// blocks, norm_final (1 x d), head (d x output_dim()).
template <class T>
struct ModelParams {
    Matrix<T> embedding;
    std::vector<BlockParams<T>> blocks;
    RowVector<T> norm_final;
    Matrix<T> head;

    [[nodiscard]] static ModelParams random(const ModelConfig& cfg, std::uint64_t seed) {
        return generate(cfg, seed, true);
    }
    /// Every tensor at its shape, zero-filled, without the generator's work: what a loader
    /// (titans::io::load_parameters) fills. Not a usable initialisation.
    [[nodiscard]] static ModelParams zeros(const ModelConfig& cfg) { return generate(cfg, 0, false); }
    /// random() (draw) or zeros() (!draw).
    [[nodiscard]] static ModelParams generate(const ModelConfig& cfg, std::uint64_t seed,
                                              bool draw) {
        cfg.validate();
        ModelParams p;
        detail::TensorDraw<T> gauss(seed * 1000003 + 7, draw);
        if (cfg.vocab_size > 0) {
            p.embedding = gauss(cfg.vocab_size, cfg.d_model, 1.0);
        }
        for (std::size_t i = 0; i < cfg.blocks.size(); ++i) {
            p.blocks.push_back(BlockParams<T>::generate(cfg.blocks[i], seed * 131 + i + 1, draw));
        }
        p.norm_final = RowVector<T>::Ones(cfg.d_model);
        p.head = gauss(cfg.d_model, cfg.output_dim(), 1.0 / std::sqrt(double(cfg.d_model)));
        return p;
    }

    /// Serialization hook: calls v(name, tensor) for every tensor `cfg` uses, in this order:
    /// embedding (vocab_size > 0), blocks.{i}.* (BlockParams::tensors), norm_final, head;
    /// tensor is the member itself (const if Self is). Non-const: `blocks` is first resized to
    /// cfg.blocks.size(), so a default-constructed ModelParams can be filled; const: the counts
    /// must match (ShapeError).
    template <class Self, class V>
    static void tensors(Self& self, const ModelConfig& cfg, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, ModelParams>);
        using S = std::string;
        if constexpr (std::is_const_v<Self>) {
            if (self.blocks.size() != cfg.blocks.size()) {
                throw ShapeError(detail::concat("ModelParams::tensors: blocks has ",
                                                self.blocks.size(), " entries, expected ",
                                                cfg.blocks.size()));
            }
        } else {
            self.blocks.resize(cfg.blocks.size());
        }
        if (cfg.vocab_size > 0) {
            v(S("embedding"), self.embedding);
        }
        for (std::size_t i = 0; i < cfg.blocks.size(); ++i) {
            BlockParams<T>::tensors(self.blocks[i], cfg.blocks[i],
                                    detail::prefixed(detail::visit_name("blocks", i), v));
        }
        v(S("norm_final"), self.norm_final);
        v(S("head"), self.head);
    }
};

/// The state of B streams through a Model: one BlockState per layer and the position.
template <class T>
struct ModelState {
    std::vector<BlockState<T>> blocks;
    int batch = 0;
    std::int64_t position = 0;

    /// Serialization hook (checkpoints): calls v(name, x) for position (std::int64_t&) and
    /// blocks.{i}.* (BlockState::tensors) of every block, x const if Self is. Load into a
    /// state from make_state() of the same model.
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, ModelState>);
        v(std::string("position"), self.position);
        for (std::size_t i = 0; i < self.blocks.size(); ++i) {
            BlockState<T>::tensors(self.blocks[i],
                                   detail::prefixed(detail::visit_name("blocks", i), v));
        }
    }
};

/// A Titans model (SPEC §7): embedding -> blocks -> RMSNorm -> head, streaming.
///
///     auto cfg = titans::ModelConfig::uniform(titans::BlockKind::MAC, 2, 64, 4, 2, 32, 256);
///     titans::Model<float> model(cfg, titans::ModelParams<float>::random(cfg, 1));
///     auto st = model.make_state(1);
///     titans::Matrixf logits = model.forward_tokens(st, ids);  // ids.size() x 256
template <class T>
class Model {
public:
    using State = ModelState<T>;

    Model(ModelConfig config, ModelParams<T> params)
        : cfg_(std::move(config)),
          params_(std::move(params)),
          norm_final_(validated(cfg_, params_).norm_final, cfg_.norm_eps) {
        for (std::size_t i = 0; i < cfg_.blocks.size(); ++i) {
            blocks_.emplace_back(cfg_.blocks[i], params_.blocks[i]);
        }
    }

    [[nodiscard]] const ModelConfig& config() const { return cfg_; }
    [[nodiscard]] const ModelParams<T>& params() const { return params_; }
    [[nodiscard]] const std::vector<Block<T>>& blocks() const { return blocks_; }

    [[nodiscard]] State make_state(int batch = 1) const {
        detail::require<ConfigError>(batch >= 1, "Model::make_state", "batch", batch, ">= 1");
        State st;
        st.batch = batch;
        for (const auto& b : blocks_) {
            st.blocks.push_back(b.make_state(batch));
        }
        return st;
    }

    /// Vectors in: x (B*N) x d_model -> (B*N) x output_dim().
    [[nodiscard]] Matrix<T> forward(State& state, const Matrix<T>& x) const {
        if (state.batch < 1 || state.blocks.size() != blocks_.size()) {
            throw ConfigError("Model::forward: state was made for a different model (or "
                              "default-constructed), expected a state from make_state()");
        }
        Matrix<T> h = x;
        for (std::size_t i = 0; i < blocks_.size(); ++i) {
            h = blocks_[i].forward(state.blocks[i], h);
        }
        state.position += x.rows() / state.batch;
        return norm_final_.forward(h) * params_.head;
    }

    /// Token ids in (B*N of them, sequence-major) -> logits (B*N) x vocab_size.
    [[nodiscard]] Matrix<T> forward_tokens(State& state, const std::vector<int>& ids) const {
        detail::require<ConfigError>(cfg_.vocab_size > 0, "Model::forward_tokens", "vocab_size",
                                     cfg_.vocab_size, "> 0 (this model takes vectors: forward)");
        Matrix<T> x(static_cast<Eigen::Index>(ids.size()), cfg_.d_model);
        for (std::size_t i = 0; i < ids.size(); ++i) {
            detail::require<ShapeError>(ids[i] >= 0 && ids[i] < cfg_.vocab_size,
                                        "Model::forward_tokens", "token id", ids[i],
                                        detail::concat("in [0, ", cfg_.vocab_size, ")"));
            x.row(static_cast<Eigen::Index>(i)) = params_.embedding.row(ids[i]);
        }
        return forward(state, x);
    }

private:
    /// Validates the configuration and the model-level tensors (the blocks validate theirs).
    static const ModelParams<T>& validated(const ModelConfig& cfg, const ModelParams<T>& p) {
        cfg.validate();
        if (p.blocks.size() != cfg.blocks.size()) {
            throw ShapeError(detail::concat("ModelParams: blocks has ", p.blocks.size(),
                                            " entries, expected ", cfg.blocks.size()));
        }
        const detail::TensorCheck check{"ModelParams"};
        check(p.embedding, "embedding", cfg.vocab_size > 0 ? cfg.vocab_size : 0,
              cfg.vocab_size > 0 ? cfg.d_model : 0);
        check(p.norm_final, "norm_final", 1, cfg.d_model);
        check(p.head, "head", cfg.d_model, cfg.output_dim());
        return p;
    }

    ModelConfig cfg_;
    ModelParams<T> params_;
    std::vector<Block<T>> blocks_;
    RMSNorm<T> norm_final_;
};

}  // namespace titans
