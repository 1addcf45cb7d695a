#pragma once
// titans/text/sampling.hpp: picking the next token from a row of logits: temperature, top-k,
// top-p (nucleus), from a seeded generator whose state can be saved and restored.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include <Eigen/Core>

#include "../detail/random.hpp"
#include "../error.hpp"

namespace titans::text {

/// Settings of a Sampler.
struct SamplerConfig {
    double temperature = 1.0;  ///< >= 0; 0: the most likely token (greedy), no random draw
    int top_k = 0;             ///< >= 0; keep the k most likely tokens (0: all)
    double top_p = 1.0;        ///< in (0, 1]; keep the most likely tokens up to this mass (1: all)
    std::uint64_t seed = 0;    ///< the generator's seed

    /// ConfigError naming the first invalid field: temperature finite and >= 0, top_k >= 0,
    /// top_p in (0, 1].
    void validate() const {
        constexpr const char* w = "SamplerConfig";
        detail::require<ConfigError>(std::isfinite(temperature) && temperature >= 0, w,
                                     "temperature", temperature,
                                     "a finite value >= 0 (0: the most likely token)");
        detail::require<ConfigError>(top_k >= 0, w, "top_k", top_k,
                                     "an integer >= 0 (0: no limit)");
        detail::require<ConfigError>(top_p > 0 && top_p <= 1, w, "top_p", top_p,
                                     "a value in (0, 1] (1: no limit)");
    }
};

/// Picks token ids from rows of logits (one call per token), reproducibly from a seed.
///
/// For logits l (V of them) and temperature t > 0:
///   1. order the ids by logit, largest first, the lower id first among equal logits;
///   2. top_k > 0: keep the first min(top_k, V) of them;
///   3. weights w_i = exp((l_i - max l) / t) of the kept ids (computed in double);
///   4. top_p < 1: keep the shortest prefix of the kept ids whose weight reaches
///      top_p * (their total weight) (at least one id);
///   5. draw u = uniform(0, 1) * (the kept ids' total weight) from SplitMix64 (one draw per
///      call) and return the first kept id, in that order, whose running weight exceeds u.
/// So an id is drawn with probability softmax(l / t) restricted to the kept set and renormalised;
/// an id whose weight underflows to 0 is never drawn. t = 0 returns the argmax (the lowest id
/// on ties) and draws nothing, whatever top_k and top_p.
///
/// The generator's whole state is one 64-bit word (state(), restore()): a sampler restored
/// from a saved state picks the same ids as the one that was saved.
///
///     titans::text::Sampler sampler({.temperature = 0.8, .top_k = 40, .seed = 7});
///     int id = sampler.sample(logits.row(logits.rows() - 1));
class Sampler {
public:
    /// Validates `config` (ConfigError naming the field).
    explicit Sampler(const SamplerConfig& config = {})
        : cfg_((config.validate(), config)), rng_(config.seed) {}

    [[nodiscard]] const SamplerConfig& config() const { return cfg_; }
    /// The generator's state (SamplerConfig::seed before the first draw).
    [[nodiscard]] std::uint64_t state() const { return rng_.state(); }
    /// Continues from a state returned by state().
    void restore(std::uint64_t state) { rng_ = detail::SplitMix64(state); }

    /// The next id from one row (or column) of logits of V entries: an id in [0, V). Throws
    /// ShapeError (not a vector, or empty), NonFiniteError (a NaN or infinite logit); the
    /// generator does not advance then.
    template <class Derived>
    [[nodiscard]] int sample(const Eigen::MatrixBase<Derived>& logits) {
        const std::vector<double> l = checked(logits);
        if (cfg_.temperature == 0) {
            return static_cast<int>(std::max_element(l.begin(), l.end()) - l.begin());
        }
        std::vector<int> ids = kept_order(l);
        std::vector<double> w = weights(l, ids);
        double total = std::accumulate(w.begin(), w.end(), 0.0);
        if (cfg_.top_p < 1) {
            total = keep_nucleus(ids, w, total);
        }
        return draw(ids, w, rng_.uniform() * total);
    }

private:
    template <class Derived>
    static std::vector<double> checked(const Eigen::MatrixBase<Derived>& logits) {
        constexpr const char* where = "Sampler::sample";
        if ((logits.rows() != 1 && logits.cols() != 1) || logits.size() == 0 ||
            logits.size() > std::numeric_limits<int>::max()) {
            throw ShapeError(detail::concat(where, ": logits is ", logits.rows(), " x ",
                                            logits.cols(), ", expected one non-empty row "
                                            "(or column) of at most 2^31 - 1 entries"));
        }
        std::vector<double> l(static_cast<std::size_t>(logits.size()));
        for (Eigen::Index i = 0; i < logits.size(); ++i) {
            l[static_cast<std::size_t>(i)] = static_cast<double>(logits.derived().coeff(i));
            if (!std::isfinite(l[static_cast<std::size_t>(i)])) {
                throw NonFiniteError(detail::concat(where, ": logits[", i, "] = ",
                                                    l[static_cast<std::size_t>(i)],
                                                    ", expected a finite value"));
            }
        }
        return l;
    }

    /// Steps 1-2: the ids that may be drawn, in the order the draw walks them (largest logit
    /// first, the lower id first on ties; index order when nothing is cut, the same result).
    [[nodiscard]] std::vector<int> kept_order(const std::vector<double>& l) const {
        std::vector<int> ids(l.size());
        std::iota(ids.begin(), ids.end(), 0);
        const auto before = [&l](int a, int b) {
            const auto ua = static_cast<std::size_t>(a), ub = static_cast<std::size_t>(b);
            return l[ua] > l[ub] || (l[ua] == l[ub] && a < b);
        };
        const std::size_t k = cfg_.top_k > 0
                                  ? std::min(static_cast<std::size_t>(cfg_.top_k), ids.size())
                                  : ids.size();
        if (k < ids.size()) {
            std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k),
                              ids.end(), before);
            ids.resize(k);
        } else if (cfg_.top_p < 1) {
            std::sort(ids.begin(), ids.end(), before);
        }
        return ids;
    }

    /// Step 3: exp((l_i - max) / t) for the kept ids (in [0, 1], the largest 1).
    [[nodiscard]] std::vector<double> weights(const std::vector<double>& l,
                                              const std::vector<int>& ids) const {
        const double m = *std::max_element(l.begin(), l.end());
        std::vector<double> w(ids.size());
        for (std::size_t i = 0; i < ids.size(); ++i) {
            w[i] = std::exp((l[static_cast<std::size_t>(ids[i])] - m) / cfg_.temperature);
        }
        return w;
    }

    /// Step 4: cuts ids and w (in order, largest first) to the shortest prefix whose weight
    /// reaches top_p * total; returns the prefix's weight.
    double keep_nucleus(std::vector<int>& ids, std::vector<double>& w, double total) const {
        const double target = cfg_.top_p * total;
        double acc = 0;
        std::size_t n = 0;
        while (n < w.size() && (n == 0 || acc < target)) {
            acc += w[n++];
        }
        ids.resize(n);
        w.resize(n);
        return acc;
    }

    /// Step 5: the first id whose running weight exceeds u; rounding aside that is always
    /// reached, else the last id of positive weight.
    static int draw(const std::vector<int>& ids, const std::vector<double>& w, double u) {
        double acc = 0;
        std::size_t last = 0;
        for (std::size_t i = 0; i < ids.size(); ++i) {
            acc += w[i];
            if (w[i] > 0) last = i;
            if (acc > u) return ids[i];
        }
        return ids[last];
    }

    SamplerConfig cfg_;
    detail::SplitMix64 rng_;
};

}  // namespace titans::text
