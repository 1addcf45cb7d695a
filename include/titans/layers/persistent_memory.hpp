#pragma once
// titans/layers/persistent_memory.hpp: PersistentMemory<T>, the learnable input-independent
// tokens of math §6.

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../detail/float_env.hpp"
#include "../detail/random.hpp"
#include "../error.hpp"
#include "../fwd.hpp"
#include "../limits.hpp"
#include "../types.hpp"

namespace titans {

/// Persistent memory (math §6): N_p learnable, input-independent tokens P = [p_1 .. p_{N_p}]
/// (N_p x d, N_p >= 0), prepended to the sequence an attention layer sees, x̃ = P ‖ x. They are
/// outer parameters: never updated at test time.
///
/// Three ways to use them: pass tokens() as the always-visible prefix of Attention::forward
/// (the streaming form of P ‖ x: every query sees P whatever its window); project them once
/// for an attention layer on the same backend with project_for() (P W_K and P W_V kept on the
/// backend, nothing per call); or materialise P ‖ x with prepend() for a layer that should
/// process the persistent tokens as sequence tokens. The tokens are host parameters, like
/// every layer's; Backend is the backend of the attention they are projected for.
///
///     auto P = titans::PersistentMemory<float>::random(/*n_tokens=*/4, /*d_model=*/64, 11);
///     titans::Matrixf y = attn.forward(state, x, &P.tokens());   // x̃ = P ‖ x, P always visible
///     const auto kv = P.project_for(attn);                       // once
///     attn.forward(state, x, y, kv);                             // same y, no projection
///     titans::Matrixf xt = P.prepend(x);                         // (4 + N) x 64
template <class T, class Backend>
class PersistentMemory {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::PersistentMemory: T must be float or double");

public:
    using Scalar = T;

    /// From given tokens: N_p x d with d >= 1 (N_p = 0 is allowed: no persistent memory), finite.
    explicit PersistentMemory(Matrix<T> tokens) : tokens_(std::move(tokens)) {
        detail::require<ShapeError>(tokens_.cols() >= 1, "PersistentMemory", "tokens.cols()",
                                    tokens_.cols(), ">= 1 (d_model)");
        if (!detail::all_finite(tokens_)) {
            throw NonFiniteError("PersistentMemory: tokens has a NaN or infinite entry");
        }
    }

    /// N_p tokens of width d drawn from a seeded generator (identical on every platform), entries
    /// N(0, stddev^2); the default stddev 1 matches the scale of normalised inputs.
    [[nodiscard]] static PersistentMemory random(int n_tokens, int d_model, std::uint64_t seed,
                                                 double stddev = 1.0) {
        constexpr const char* w = "PersistentMemory::random";
        detail::require_in_range(n_tokens, 0, limits::max_persistent, w, "n_tokens");
        detail::require_in_range(d_model, 1, limits::max_d_model, w, "d_model");
        detail::require<ConfigError>(std::isfinite(stddev) && stddev >= 0, w, "stddev", stddev,
                                     "a finite value >= 0");
        detail::require_representable<T>(stddev, w, "stddev");
        detail::require_budget(detail::sat_mul(n_tokens, d_model, std::int64_t{sizeof(T)}), w,
                               "tokens size", detail::scalar_name<T>(),
                               "reduce n_tokens or d_model");
        detail::SplitMix64 rng(seed);
        Matrix<T> m(n_tokens, d_model);
        for (Eigen::Index i = 0; i < m.size(); ++i) {
            m.data()[i] = static_cast<T>(stddev * rng.normal());
        }
        return PersistentMemory(std::move(m));
    }

    /// N_p.
    [[nodiscard]] int size() const { return static_cast<int>(tokens_.rows()); }
    /// d.
    [[nodiscard]] int d_model() const { return static_cast<int>(tokens_.cols()); }
    /// P, N_p x d.
    [[nodiscard]] const Matrix<T>& tokens() const { return tokens_; }

    /// P projected for `attention` (P W_K and P W_V on its backend, shared by every sequence:
    /// Attention::project_prefix), for Attention::forward(state, x, y, prefix). ShapeError if
    /// the widths differ.
    template <class Attn>
        requires std::is_same_v<Attn, Attention<T, Backend>>
    [[nodiscard]] auto project_for(const Attn& attention) const {
        return attention.project_prefix(tokens_);
    }

    /// P ‖ x for `batch` sequences stacked sequence-major: x is (B*N) x d, the result
    /// (B*(N_p + N)) x d with rows [b*(N_p+N), b*(N_p+N) + N_p) = P and the next N rows =
    /// sequence b. With the default batch = 1: x is N x d, the result (N_p + N) x d.
    [[nodiscard]] Matrix<T> prepend(const Matrix<T>& x, int batch = 1) const {
        constexpr const char* w = "PersistentMemory::prepend";
        detail::require<ConfigError>(batch >= 1, w, "batch", batch, ">= 1");
        if (x.cols() != tokens_.cols()) {
            throw ShapeError(detail::concat(w, ": x has ", x.cols(), " columns, expected d = ",
                                            tokens_.cols()));
        }
        if (x.rows() % batch != 0) {
            throw ShapeError(detail::concat(w, ": x has ", x.rows(),
                                            " rows, expected a multiple of batch = ", batch));
        }
        const Eigen::Index n = x.rows() / batch, np = tokens_.rows();
        Matrix<T> out(static_cast<Eigen::Index>(batch) * (np + n), x.cols());
        for (Eigen::Index b = 0; b < batch; ++b) {
            out.middleRows(b * (np + n), np) = tokens_;
            out.middleRows(b * (np + n) + np, n) = x.middleRows(b * n, n);
        }
        return out;
    }

private:
    Matrix<T> tokens_;
};

}  // namespace titans
