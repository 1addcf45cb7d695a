// The training surface keeps the promises of the inference surface: a refused AdamW step,
// clipping or norm changes nothing (params, grads, moments, step count compared bit for bit), for
// parameters and gradients of another configuration of every parameter struct; finite inputs
// never give silent non-finite results (mse_loss, AdamW settings and steps near the limits of
// float and double); counters and schedules at the limits of int64 are refused, not UB.

#include "robust_common.hpp"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

using namespace titans_test;
using titans::AdamW;
using titans::AdamWConfig;
using titans::AttentionConfig;
using titans::AttentionParams;
using titans::BlockConfig;
using titans::BlockKind;
using titans::BlockParams;
using titans::ConfigError;
using titans::FeedForwardConfig;
using titans::FeedForwardKind;
using titans::FeedForwardParams;
using titans::ModelConfig;
using titans::ModelParams;
using titans::NonFiniteError;
using titans::ShapeError;
using titans::WarmupCosine;

namespace {

/// Names, shapes and bit patterns of a list of tensors: equal only if bit-identical.
struct TrainingBits {
    std::vector<std::string> names;
    std::vector<std::uint64_t> bits;
    bool operator==(const TrainingBits&) const = default;

    template <class M>
    void add(const std::string& name, const M& m) {
        names.push_back(name);
        bits.push_back(static_cast<std::uint64_t>(m.rows()));
        bits.push_back(static_cast<std::uint64_t>(m.cols()));
        for (Eigen::Index i = 0; i < m.size(); ++i) {
            const double v = static_cast<double>(m.data()[i]);
            std::uint64_t b = 0;
            std::memcpy(&b, &v, sizeof b);
            bits.push_back(b);
        }
    }
};

/// Every tensor of p as its own configuration `own` names them.
template <class Params, class Config>
TrainingBits params_bits(const Params& p, const Config& own) {
    TrainingBits s;
    Params::tensors(p, own, [&s](const std::string& name, const auto& m) { s.add(name, m); });
    return s;
}

/// The step count and every moment of an optimiser.
template <class T>
TrainingBits optimizer_bits(const AdamW<T>& opt) {
    TrainingBits s;
    s.bits.push_back(static_cast<std::uint64_t>(opt.steps()));
    for (const auto& [name, mo] : opt.moments()) {
        s.add("m." + name, mo.m);
        s.add("v." + name, mo.v);
    }
    return s;
}

/// Gradients of cfg's shapes, uniform in [-scale, scale], from a fresh seed.
template <class Params, class Config>
Params training_grads(const Config& cfg, std::uint64_t seed, double scale = 1.0) {
    Rng rng(seed);
    Params g = Params::zeros(cfg);
    Params::tensors(g, cfg, [&](const std::string&, auto& m) {
        m = (random_matrix(m.rows(), m.cols(), rng) * scale).template cast<typename titans::detail::ParamsScalar<Params>::type>();
    });
    return g;
}

/// Runs `call`, which must throw E with `text` in its message, and checks that params (of
/// configuration pc), grads (of gc) and the optimiser are bit-identical afterwards.
template <class E, class Params, class Config, class T, class F>
void refused_unchanged(const Params& params, const Config& pc, const Params& grads,
                       const Config& gc, const AdamW<T>& opt, F&& call, const std::string& text) {
    const TrainingBits p0 = params_bits(params, pc), g0 = params_bits(grads, gc);
    const TrainingBits o0 = optimizer_bits(opt);
    REQUIRE_THROWS_AS(call(), E);
    REQUIRE_THROWS_WITH(call(), TITANS_CONTAINS(text));
    CHECK(params_bits(params, pc) == p0);
    CHECK(params_bits(grads, gc) == g0);
    CHECK(optimizer_bits(opt) == o0);
}

/// Parameters (and gradients) of `other` given to AdamW::step, gradient_norm and
/// clip_gradient_norm with `cfg`: ShapeError naming params or grads and `expect`, nothing
/// changed; with a fresh optimiser and with one that has stepped on cfg's parameters.
template <class Params, class Config>
void check_foreign_configuration(const Config& cfg, const Config& other, const std::string& expect,
                                 std::uint64_t seed) {
    using T = typename titans::detail::ParamsScalar<Params>::type;
    INFO("expected: " << expect);
    Params p = Params::random(cfg, seed);
    Params g = training_grads<Params>(cfg, seed + 1);
    Params q = Params::random(other, seed + 2);
    Params qg = training_grads<Params>(other, seed + 3, 1e3);
    AdamW<T> stepped;
    {
        Params p1 = p;
        stepped.step(p1, g, cfg, 0.01);
    }
    std::vector<AdamW<T>> opts{AdamW<T>(), stepped};
    for (AdamW<T>& opt : opts) {
        refused_unchanged<ShapeError>(q, other, g, cfg, opt, [&] { opt.step(q, g, cfg, 0.1); },
                                      "AdamW::step: params do not fit cfg");
        refused_unchanged<ShapeError>(q, other, g, cfg, opt, [&] { opt.step(q, g, cfg, 0.1); },
                                      expect);
        refused_unchanged<ShapeError>(p, cfg, qg, other, opt, [&] { opt.step(p, qg, cfg, 0.1); },
                                      "AdamW::step: grads do not fit cfg");
        refused_unchanged<ShapeError>(q, other, qg, other, opt,
                                      [&] { opt.step(q, qg, cfg, 0.1); }, expect);
    }
    const AdamW<T> none;
    refused_unchanged<ShapeError>(p, cfg, qg, other, none,
                                  [&] { (void)titans::gradient_norm(qg, cfg); },
                                  "gradient_norm: grads do not fit cfg");
    refused_unchanged<ShapeError>(p, cfg, qg, other, none,
                                  [&] { (void)titans::clip_gradient_norm(qg, cfg, 1e-3); },
                                  "clip_gradient_norm: grads do not fit cfg");
    refused_unchanged<ShapeError>(p, cfg, qg, other, none,
                                  [&] { (void)titans::clip_gradient_norm(qg, cfg, 1e-3); }, expect);
    // A NaN in every tensor, so validate() stops at the first: still a ShapeError
    // (gradient_norm returns NaN for a NaN only on gradients that fit).
    Params::tensors(qg, other, [](const std::string&, auto& m) {
        if (m.size() > 0) m.data()[0] = std::numeric_limits<T>::quiet_NaN();
    });
    refused_unchanged<ShapeError>(p, cfg, qg, other, none,
                                  [&] { (void)titans::gradient_norm(qg, cfg); },
                                  "gradient_norm: grads do not fit cfg");
}

}  // namespace

TEMPLATE_TEST_CASE("adamw: foreign params",
                   "[robustness][training]", float, double) {
    using T = TestType;
    const std::uint64_t seed = seed_for("adamw foreign", sizeof(T));
    const MemoryConfig mem{.d_model = 4, .n_heads = 2, .depth = 2, .chunk = 4};
    MemoryConfig deeper = mem, one_head = mem, wider = mem;
    deeper.depth = 3;
    one_head.n_heads = 1;
    wider.d_model = 6;
    SECTION("MemoryParams") {
        check_foreign_configuration<MemoryParams<T>>(mem, deeper, "expected depth = 2", seed);
        check_foreign_configuration<MemoryParams<T>>(mem, one_head, "w_theta is 4 x 1, expected 4 x 2",
                                                     seed);
        check_foreign_configuration<MemoryParams<T>>(mem, wider, "expected 4 x 4", seed);
    }
    SECTION("AttentionParams") {
        const AttentionConfig a{.d_model = 4, .n_heads = 2, .window = 8};
        AttentionConfig b = a;
        b.d_model = 6;
        check_foreign_configuration<AttentionParams<T>>(a, b, "expected 4 x 4", seed);
    }
    SECTION("FeedForwardParams") {
        const FeedForwardConfig swiglu{.d_model = 3, .kind = FeedForwardKind::SwiGLU, .hidden = 2};
        const FeedForwardConfig gelu{.d_model = 3, .kind = FeedForwardKind::GELU, .hidden = 2};
        check_foreign_configuration<FeedForwardParams<T>>(swiglu, gelu, "w3", seed);
    }
    SECTION("BlockParams of every kind") {
        for (const BlockKind kind : titans::all_block_kinds) {
            INFO(titans::to_string(kind));
            const BlockConfig cfg = BlockConfig::make(kind, 4, 2, 2, 8, 4);
            BlockConfig shallow = cfg;
            shallow.memory.depth = 1;
            const BlockConfig narrow = BlockConfig::make(kind, 6, 2, 2, 8, 4);
            if (titans::has_memory(kind)) {
                check_foreign_configuration<BlockParams<T>>(cfg, shallow, "expected depth = 2", seed);
            }
            // The norm weights (RMSNorm's parameters) are the first tensors visited.
            check_foreign_configuration<BlockParams<T>>(cfg, narrow, "norm_mix is 1 x 6, expected 1 x 4",
                                                        seed);
            if (kind != BlockKind::LMM) {
                BlockConfig more = cfg;  // PersistentMemory's tokens
                more.n_persistent = cfg.n_persistent + 2;
                check_foreign_configuration<BlockParams<T>>(cfg, more, "persistent", seed);
                const BlockConfig lmm = BlockConfig::make(BlockKind::LMM, 4, 2, 2, 8, 4);
                check_foreign_configuration<BlockParams<T>>(cfg, lmm, "AttentionParams: w_q is 0 x 0",
                                                            seed);
            }
        }
    }
    SECTION("ModelParams") {
        const ModelConfig cfg = ModelConfig::uniform(BlockKind::MAG, 2, 4, 2, 2, 8, 11, 4);
        ModelConfig three = ModelConfig::uniform(BlockKind::MAG, 3, 4, 2, 2, 8, 11, 4);
        ModelConfig shallow = ModelConfig::uniform(BlockKind::MAG, 2, 4, 2, 1, 8, 11, 4);
        ModelConfig vocab = ModelConfig::uniform(BlockKind::MAG, 2, 4, 2, 2, 8, 13, 4);
        check_foreign_configuration<ModelParams<T>>(cfg, three, "blocks has 3 entries, expected 2",
                                                    seed);
        check_foreign_configuration<ModelParams<T>>(cfg, shallow, "blocks.0: ", seed);
        check_foreign_configuration<ModelParams<T>>(cfg, vocab, "embedding is 13 x 4, expected 11 x 4",
                                                    seed);
    }
}

namespace {

/// The feed-forward the numeric cases step: every tensor a matrix, so every tensor is decayed.
const FeedForwardConfig training_ffn{.d_model = 3, .kind = FeedForwardKind::SwiGLU, .hidden = 2};

/// opt.step(p, g, training_ffn, lr) must throw E naming `text` and change nothing.
template <class E, class T>
void step_refused(AdamW<T>& opt, FeedForwardParams<T>& p, const FeedForwardParams<T>& g, double lr,
                  const std::string& text) {
    refused_unchanged<E>(p, training_ffn, g, training_ffn, opt,
                         [&] { opt.step(p, g, training_ffn, lr); }, text);
}

/// Moments of training_ffn's shapes, every m entry `m`, every v entry `v`.
template <class T>
std::map<std::string, typename AdamW<T>::Moments> training_moments(T m, T v) {
    std::map<std::string, typename AdamW<T>::Moments> out;
    const auto z = FeedForwardParams<T>::zeros(training_ffn);
    FeedForwardParams<T>::tensors(z, training_ffn, [&](const std::string& name, const auto& x) {
        out[name] = {Matrix<T>::Constant(x.rows(), x.cols(), m),
                     Matrix<T>::Constant(x.rows(), x.cols(), v)};
    });
    return out;
}

template <class T>
bool all_finite_params(const FeedForwardParams<T>& p) {
    return titans::detail::tensors_finite(p, training_ffn);
}

}  // namespace

// Finite inputs, values near the largest T: a step either stays finite or is refused with
// everything as it was (float and double, each at its own limit).
TEMPLATE_TEST_CASE("adamw: steps at T limits", "[robustness][training]", float, double) {
    using T = TestType;
    const double max = static_cast<double>(std::numeric_limits<T>::max());
    const double root_max = std::sqrt(max);
    const std::uint64_t seed = seed_for("adamw limits", sizeof(T));
    auto p = FeedForwardParams<T>::random(training_ffn, seed);
    auto g = training_grads<FeedForwardParams<T>>(training_ffn, seed + 1);
    AdamW<T> opt({.weight_decay = 10.0});
    opt.step(p, g, training_ffn, 1e-3);  // moments to keep unchanged

    SECTION("a gradient whose square overflows the second moment") {
        g.w3(1, 0) = static_cast<T>(4 * root_max);
        step_refused<NonFiniteError>(opt, p, g, 1e-3, "second moment v (g²) of 'w3'");
        g.w3(1, 0) = static_cast<T>(-0.5 * root_max);  // g² = max / 4: a finite step
        opt.step(p, g, training_ffn, 1e-3);
        CHECK(all_finite_params(p));
        CHECK(opt.steps() == 2);
    }
    SECTION("a rate whose step lr / (1 - beta1^t) overflows") {
        step_refused<ConfigError>(opt, p, g, max / 2, "lr / (1 - beta1^t)");
    }
    SECTION("a rate whose decay factor 1 - lr * weight_decay overflows") {
        AdamW<T> nob1({.beta1 = 0.0, .weight_decay = 10.0});  // lr / bias1 = lr
        step_refused<ConfigError>(nob1, p, g, max / 2, "1 - lr * weight_decay");
    }
    SECTION("a decay that takes a parameter past the largest T") {
        p.w1(0, 1) = static_cast<T>(max / 100);
        step_refused<NonFiniteError>(opt, p, g, 1e3, "the parameter of 'w1'");  // factor -9999
    }
    SECTION("resumed moments far from their gradients") {
        AdamW<T> resumed({}, 3, training_moments<T>(static_cast<T>(max / 2), T(0)));
        step_refused<NonFiniteError>(resumed, p, g, 1.0, "the parameter of 'w1' NaN or infinite in");
    }
    SECTION("params with a NaN") {
        p.w2(1, 1) = std::numeric_limits<T>::quiet_NaN();
        step_refused<NonFiniteError>(opt, p, g, 1e-3, "params 'w2' has a NaN or infinite entry");
    }
    SECTION("tiny and huge finite gradients that fit") {
        g.w1.setConstant(static_cast<T>(1e-30));
        g.w2.setConstant(static_cast<T>(0.25 * root_max));
        opt.step(p, g, training_ffn, 1e-3);
        CHECK(all_finite_params(p));
        for (const auto& [name, mo] : opt.moments()) {
            CHECK(mo.m.allFinite());
            CHECK(mo.v.allFinite());
        }
    }
}

// Settings valid in double but not in the optimiser's T are refused at construction, naming
// the setting, as the layer configurations do (eps rounding to 0 made 0 / 0).
TEST_CASE("adamw: settings not in T", "[robustness][training]") {
    CHECK_NOTHROW(AdamW<double>(AdamWConfig{.eps = 1e-50}));
    REQUIRE_THROWS_NAMING(AdamW<float>(AdamWConfig{.eps = 1e-50}), ConfigError,
                          "AdamWConfig: eps = 1e-50, expected a finite value representable in float");
    REQUIRE_THROWS_NAMING(AdamW<double>(AdamWConfig{.eps = 1e-310}), ConfigError, "eps");
    CHECK_NOTHROW(AdamW<double>(AdamWConfig{.beta2 = 1 - 1e-10}));
    REQUIRE_THROWS_NAMING(AdamW<float>(AdamWConfig{.beta2 = 1 - 1e-10}), ConfigError,
                          "beta2 = 1, expected a value that stays < 1 in float");
    REQUIRE_THROWS_NAMING(AdamW<float>(AdamWConfig{.beta1 = 1 - 1e-9}), ConfigError, "beta1");
    CHECK_NOTHROW(AdamW<double>(AdamWConfig{.weight_decay = 1e39}));
    REQUIRE_THROWS_NAMING(AdamW<float>(AdamWConfig{.weight_decay = 1e39}), ConfigError,
                          "weight_decay");
    // The resuming constructor (what load_optimizer calls) applies the same rules.
    REQUIRE_THROWS_NAMING(AdamW<float>(AdamWConfig{.eps = 1e-50}, 0, {}), ConfigError, "eps");
}

// The step counter: INT64_MAX - 1 steps to INT64_MAX; at INT64_MAX a step is refused (t = steps
// + 1 would overflow).
TEMPLATE_TEST_CASE("adamw: counter at limit", "[robustness][training]", float, double) {
    using T = TestType;
    constexpr std::int64_t top = std::numeric_limits<std::int64_t>::max();
    const std::uint64_t seed = seed_for("adamw counter", sizeof(T));
    auto p = FeedForwardParams<T>::random(training_ffn, seed);
    const auto g = training_grads<FeedForwardParams<T>>(training_ffn, seed + 1);
    AdamW<T> opt({}, top - 1, training_moments<T>(T(0.01), T(0.02)));
    opt.step(p, g, training_ffn, 1e-3);
    CHECK(opt.steps() == top);
    CHECK(all_finite_params(p));
    step_refused<ConfigError>(opt, p, g, 1e-3,
                              "steps() = 9223372036854775807, expected < 9223372036854775807");
}

// Moments given with steps = 0 are checked as any moments are (the check was skipped at 0):
// other shapes, another tensor, are refused unchanged; zero moments step as a fresh optimiser.
TEMPLATE_TEST_CASE("adamw: moments at step 0", "[robustness][training]", float, double) {
    using T = TestType;
    const std::uint64_t seed = seed_for("adamw steps 0", sizeof(T));
    auto p = FeedForwardParams<T>::random(training_ffn, seed);
    const auto g = training_grads<FeedForwardParams<T>>(training_ffn, seed + 1);
    auto moments = training_moments<T>(T(0.01), T(0.02));
    moments["w1"] = {Matrix<T>::Zero(2, 2), Matrix<T>::Zero(2, 2)};
    AdamW<T> misshapen({}, 0, moments);
    step_refused<ShapeError>(misshapen, p, g, 1e-3, "params 'w1' (3 x 2) is not a tensor");
    moments = training_moments<T>(T(0.01), T(0.02));
    moments["w4"] = moments["w1"];
    AdamW<T> extra({}, 0, moments);
    step_refused<ShapeError>(extra, p, g, 1e-3, "params have 3 tensors, expected 4");

    AdamW<T> zero({}, 0, training_moments<T>(T(0), T(0)));
    AdamW<T> fresh;
    auto p2 = p;
    zero.step(p, g, training_ffn, 1e-2);
    fresh.step(p2, g, training_ffn, 1e-2);
    CHECK(params_bits(p, training_ffn) == params_bits(p2, training_ffn));
    CHECK(optimizer_bits(zero) == optimizer_bits(fresh));
}

namespace {

/// A user's struct whose visitor names one tensor twice.
struct TwiceNamed {
    using Scalar = double;
    Matrixd a, b;
    template <class Self, class V>
    static void tensors(Self& self, const int&, V&& v) {
        v(std::string("a"), self.a);
        v(std::string("a"), self.b);
    }
};

}  // namespace

TEST_CASE("adamw: two tensors of one name", "[robustness][training]") {
    Rng rng(seed_for("adamw twice named"));
    TwiceNamed p{random_matrix(2, 3, rng), random_matrix(2, 3, rng)};
    const TwiceNamed g{random_matrix(2, 3, rng), random_matrix(2, 3, rng)};
    const TwiceNamed p0 = p;
    AdamW<double> opt;
    REQUIRE_THROWS_NAMING(opt.step(p, g, 0, 0.1), ShapeError, "name the tensor 'a' twice");
    CHECK(identical(p.a, p0.a));
    CHECK(identical(p.b, p0.b));
    CHECK(opt.steps() == 0);
    CHECK(opt.moments().empty());
}

// mse_loss where y - target, its square or 2 (y - target) / n overflows T: the loss (double) and
// dy (T) computed by scaling where representable, else NonFiniteError with dy unchanged.
TEMPLATE_TEST_CASE("mse_loss: limits of T", "[robustness][training]", float,
                   double) {
    using T = TestType;
    const double max = static_cast<double>(std::numeric_limits<T>::max());
    Matrix<T> dy = Matrix<T>::Constant(2, 3, T(7));
    const Matrix<T> dy0 = dy;
    SECTION("y - target overflows T; dy fits") {
        Matrix<T> y(1, 4), t(1, 4);
        y << T(0.9 * max), T(-0.9 * max), T(0.5 * max), T(0.1 * max);
        t << T(-0.9 * max), T(0.9 * max), T(0), T(0);
        if constexpr (std::is_same_v<T, float>) {  // the loss fits a double
            const double loss = titans::mse_loss<T>(y, t, dy);
            const Matrixd d = y.template cast<double>() - t.template cast<double>();
            CHECK(std::abs(loss - d.squaredNorm() / 4) <= 1e-12 * loss);
            CHECK(rel_error(dy.template cast<double>(), (d / 2).eval()) <= 1e-6);
        } else {  // the loss (1.8 max)² does not fit a double
            REQUIRE_THROWS_NAMING(titans::mse_loss<T>(y, t, dy), NonFiniteError,
                                  "the loss mean((y - target)²) exceeds the largest double");
            CHECK(identical(dy, dy0));
        }
    }
    SECTION("the sum of squares overflows double in double; the mean fits") {
        const double big = 1.5 * std::sqrt(max);  // big² > max for T = double
        Matrix<T> y = Matrix<T>::Zero(2, 2), t = Matrix<T>::Zero(2, 2);
        y(1, 0) = static_cast<T>(big);
        t(0, 1) = static_cast<T>(-1e-3 * big);
        const double loss = titans::mse_loss<T>(y, t, dy);
        const double yb = static_cast<double>(y(1, 0)), tb = static_cast<double>(t(0, 1));
        const double expect = (yb / 2) * (yb / 2) + (tb / 2) * (tb / 2);  // (Σ d²) / 4
        CHECK(std::abs(loss - expect) <= 1e-12 * expect);
        CHECK(std::isfinite(loss));
        CHECK(dy.rows() == 2);
        CHECK(std::abs(static_cast<double>(dy(1, 0)) - yb / 2) <= 1e-6 * yb);
    }
    SECTION("dy = 2 (y - target) / n overflows T") {
        Matrix<T> y(1, 1), t(1, 1);
        y << T(0.75 * max);
        t << T(-0.25 * max);  // y - target = max: fits (float: its square fits a double)
        const char* what = std::is_same_v<T, float> ? "dy = 2 (y - target) / n exceeds the largest"
                                                    : "the loss mean((y - target)²) exceeds";
        REQUIRE_THROWS_NAMING(titans::mse_loss<T>(y, t, dy), NonFiniteError, what);
        CHECK(identical(dy, dy0));
        t << T(0.1 * max);
        REQUIRE_THROWS_NAMING(titans::mse_loss<T>(y, t, dy), NonFiniteError, what);
        CHECK(identical(dy, dy0));
    }
    SECTION("tiny magnitudes") {
        Matrix<T> y = Matrix<T>::Constant(1, 3, T(1e-30)), t = Matrix<T>::Zero(1, 3);
        const double loss = titans::mse_loss<T>(y, t, dy);
        const double yd = static_cast<double>(y(0, 0));
        CHECK(std::abs(loss - yd * yd) <= 1e-12 * yd * yd);
    }
}

// clip_gradient_norm: max_norm representable in T; double gradients whose norm exceeds the
// largest double are refused naming that, grads unchanged (gradient_norm returns +inf).
TEMPLATE_TEST_CASE("clip: limits of T", "[robustness][training]", float, double) {
    using T = TestType;
    const double max = static_cast<double>(std::numeric_limits<T>::max());
    const double min = static_cast<double>(std::numeric_limits<T>::min());
    auto g = training_grads<FeedForwardParams<T>>(training_ffn, seed_for("clip limits", sizeof(T)));
    const AdamW<T> none;
    refused_unchanged<ConfigError>(g, training_ffn, g, training_ffn, none,
                                   [&] { (void)titans::clip_gradient_norm(g, training_ffn, min / 4); },
                                   "max_norm");
    g.w1.setConstant(static_cast<T>(0.9 * max));
    if constexpr (std::is_same_v<T, double>) {
        CHECK(titans::gradient_norm(g, training_ffn) == std::numeric_limits<double>::infinity());
        refused_unchanged<NonFiniteError>(
            g, training_ffn, g, training_ffn, none,
            [&] { (void)titans::clip_gradient_norm(g, training_ffn, 1.0); },
            "the norm of grads exceeds the largest double (every entry finite)");
    } else {
        refused_unchanged<ConfigError>(g, training_ffn, g, training_ffn, none,
                                       [&] { (void)titans::clip_gradient_norm(g, training_ffn, 1e39); },
                                       "max_norm = 1e+39, expected a finite value representable in float");
        const double before = titans::clip_gradient_norm(g, training_ffn, 1e10);  // norm in double
        CHECK(std::abs(before - 0.9 * max * std::sqrt(6.0)) <= 1e-6 * before);
        CHECK(std::abs(titans::gradient_norm(g, training_ffn) - 1e10) <= 1e-5 * 1e10);
    }
}

// A schedule built with out-of-range fields never yields a rate; valid fields at the ends of
// int64 give rates in [floor * peak, peak] without overflowing t - warmup or total - warmup.
TEST_CASE("schedule: validated per call", "[robustness][training]") {
    constexpr std::int64_t top = std::numeric_limits<std::int64_t>::max();
    constexpr std::int64_t bottom = std::numeric_limits<std::int64_t>::min();
    REQUIRE_THROWS_NAMING((WarmupCosine{.warmup = -5})(1), ConfigError, "WarmupCosine: warmup = -5");
    REQUIRE_THROWS_NAMING((WarmupCosine{.warmup = -1, .total = 10})(top), ConfigError, "warmup");
    REQUIRE_THROWS_NAMING((WarmupCosine{.warmup = bottom, .total = top})(top), ConfigError, "warmup");
    REQUIRE_THROWS_NAMING((WarmupCosine{.total = -1})(3), ConfigError, "total");
    REQUIRE_THROWS_NAMING((WarmupCosine{.peak = std::nan("")})(1), ConfigError, "peak");
    REQUIRE_THROWS_NAMING((WarmupCosine{.peak = -1e-3})(1), ConfigError, "peak");
    REQUIRE_THROWS_NAMING((WarmupCosine{.floor = 2.0})(1), ConfigError, "floor");
    REQUIRE_THROWS_NAMING((WarmupCosine{.floor = std::nan("")})(1), ConfigError, "floor");

    const WarmupCosine late{.peak = 2.0, .warmup = top - 1, .total = top, .floor = 0.25};
    CHECK(late(top - 1) == 2.0);
    CHECK(late(top) == 0.5);
    const WarmupCosine longest{.peak = 2.0, .warmup = 0, .total = top, .floor = 0.25};
    for (const std::int64_t t : {std::int64_t{1}, top / 2, top - 1, top}) {
        const double r = longest(t);
        CHECK(r >= 0.5);
        CHECK(r <= 2.0);
    }
    CHECK(longest(top) == 0.5);
    CHECK(std::abs(longest(top / 2) - 1.25) <= 1e-12);
}
