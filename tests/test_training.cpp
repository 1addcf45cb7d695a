// The pieces of a training step (math §9): AdamW against a plain per-element loop, the
// warm-up + cosine schedule, the global gradient norm and its clipping, the losses against
// finite differences, the refusals; and a feed-forward trained with them (its own backward)
// to fit a random teacher.
#include "test_common.hpp"

#include <cmath>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

using namespace titans_test;
using titans::AdamW;
using titans::AdamWConfig;
using titans::FeedForward;
using titans::FeedForwardConfig;
using titans::FeedForwardKind;
using titans::FeedForwardParams;
using titans::WarmupCosine;

namespace {

/// Every entry of a FeedForwardParams, in visit order, as one vector of doubles.
template <class T>
std::vector<double> flat(const FeedForwardParams<T>& p, const FeedForwardConfig& cfg) {
    std::vector<double> out;
    FeedForwardParams<T>::tensors(p, cfg, [&](const std::string&, const Matrix<T>& m) {
        for (Eigen::Index i = 0; i < m.size(); ++i) out.push_back(static_cast<double>(m.data()[i]));
    });
    return out;
}

/// Which entries of flat() AdamW decays: those of tensors with more than one row and column
/// (or all, with decay_vectors).
template <class T>
std::vector<bool> decayed(const FeedForwardParams<T>& p, const FeedForwardConfig& cfg, bool all) {
    std::vector<bool> out;
    FeedForwardParams<T>::tensors(p, cfg, [&](const std::string&, const Matrix<T>& m) {
        out.insert(out.end(), static_cast<std::size_t>(m.size()),
                   all || (m.rows() > 1 && m.cols() > 1));
    });
    return out;
}

template <class T>
FeedForwardParams<T> random_grads(const FeedForwardConfig& cfg, Rng& rng, double scale) {
    auto g = FeedForwardParams<T>::zeros(cfg);
    FeedForwardParams<T>::tensors(g, cfg, [&](const std::string&, Matrix<T>& m) {
        m = (random_matrix(m.rows(), m.cols(), rng) * scale).template cast<T>();
    });
    return g;
}

}  // namespace

// AdamW over several steps (a warm-up + cosine rate, fresh gradients each step, matrices and
// vectors, with and without decaying vectors) against the update written per element in double
// from Loshchilov & Hutter's algorithm.
TEMPLATE_TEST_CASE("adamw: == plain loop", "[training]", float, double) {
    using T = TestType;
    const FeedForwardKind kind = GENERATE(FeedForwardKind::SwiGLU, FeedForwardKind::GELU);
    const bool decay_vectors = GENERATE(false, true);
    Rng rng(seed_for("adamw-loop", static_cast<std::uint64_t>(kind) * 2 + decay_vectors));
    // GELU with hidden 1 makes w1 and w2 vectors.
    const FeedForwardConfig cfg{.d_model = 3, .kind = kind,
                                .hidden = kind == FeedForwardKind::GELU ? 1 : 4};
    auto p = FeedForwardParams<T>::random(cfg, 9);
    const AdamWConfig oc{.beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.3,
                         .decay_vectors = decay_vectors};
    AdamW<T> opt(oc);
    const WarmupCosine lr{.peak = 0.05, .warmup = 2, .total = 6, .floor = 0.2};

    std::vector<double> ref = flat(p, cfg), m(ref.size(), 0.0), v(ref.size(), 0.0);
    const std::vector<bool> dec = decayed(p, cfg, decay_vectors);
    for (int t = 1; t <= 7; ++t) {
        const auto g = random_grads<T>(cfg, rng, t == 3 ? 1e-4 : 2.0);  // a tiny step too
        const std::vector<double> gf = flat(g, cfg);
        const double rate = lr(t);
        for (std::size_t i = 0; i < ref.size(); ++i) {
            m[i] = oc.beta1 * m[i] + (1 - oc.beta1) * gf[i];
            v[i] = oc.beta2 * v[i] + (1 - oc.beta2) * gf[i] * gf[i];
            const double mhat = m[i] / (1 - std::pow(oc.beta1, t));
            const double vhat = v[i] / (1 - std::pow(oc.beta2, t));
            if (dec[i]) ref[i] -= rate * oc.weight_decay * ref[i];
            ref[i] -= rate * mhat / (std::sqrt(vhat) + oc.eps);
        }
        opt.step(p, g, cfg, rate);
        CHECK(opt.steps() == t);
        const std::vector<double> got = flat(p, cfg);
        const Eigen::Map<const Eigen::VectorXd> a(got.data(), static_cast<Eigen::Index>(got.size()));
        const Eigen::Map<const Eigen::VectorXd> b(ref.data(), static_cast<Eigen::Index>(ref.size()));
        INFO("step " << t);
        CHECK(rel_error(a, b) <= tol<T>());
    }
}

// AdamW's arithmetic is exact per operation in T (each entry rounded as the plain loop in T
// rounds it, in its order), whatever the tensor's length and alignment: second moments in the
// subnormal range (tiny gradients) and a tiny eps make the square root decide the step, where
// an approximate vector root (Eigen's fast float sqrt: an rsqrt with one Newton step, flushing
// subnormals to 0) would be off. Tensors of odd lengths (5 x 7, 7 x 5, 1 x 5) reach vector
// tails.
TEMPLATE_TEST_CASE("adamw: exact in T", "[training]", float, double) {
    using T = TestType;
    Rng rng(seed_for(std::string("adamw-exact/") + type_name<T>(), 0));
    const FeedForwardConfig cfg{.d_model = 5, .kind = FeedForwardKind::GELU, .hidden = 7};
    auto p = FeedForwardParams<T>::random(cfg, 4);
    const AdamWConfig oc{.beta1 = 0.9, .beta2 = 0.99, .eps = 1e-30, .weight_decay = 0.1};
    AdamW<T> opt(oc);
    std::vector<T> ref, m, v;
    FeedForwardParams<T>::tensors(p, cfg, [&](const std::string&, const Matrix<T>& x) {
        ref.insert(ref.end(), x.data(), x.data() + x.size());
    });
    m.assign(ref.size(), T(0));
    v.assign(ref.size(), T(0));
    const std::vector<bool> dec = decayed(p, cfg, false);
    const T tiny = std::numeric_limits<T>::min() * T(1e6);  // g² subnormal
    for (int t = 1; t <= 3; ++t) {
        auto g = random_grads<T>(cfg, rng, 1.0);
        FeedForwardParams<T>::tensors(g, cfg, [&](const std::string&, Matrix<T>& x) {
            for (Eigen::Index i = 0; i < x.size(); i += 2) x.data()[i] *= tiny;
        });
        const double rate = 0.01 * t;
        std::vector<T> gf;
        FeedForwardParams<T>::tensors(g, cfg, [&](const std::string&, const Matrix<T>& x) {
            gf.insert(gf.end(), x.data(), x.data() + x.size());
        });
        const T b1 = static_cast<T>(oc.beta1), b2 = static_cast<T>(oc.beta2),
                eps = static_cast<T>(oc.eps),
                step = static_cast<T>(rate / (1 - std::pow(oc.beta1, t))),
                root2 = static_cast<T>(std::sqrt(1 - std::pow(oc.beta2, t))),
                shrink = static_cast<T>(1 - rate * oc.weight_decay);
        for (std::size_t i = 0; i < ref.size(); ++i) {
            m[i] = b1 * m[i] + (T(1) - b1) * gf[i];
            v[i] = b2 * v[i] + (T(1) - b2) * (gf[i] * gf[i]);
            const T base = dec[i] ? ref[i] * shrink : ref[i];
            ref[i] = base - step * m[i] / (std::sqrt(v[i]) / root2 + eps);
        }
        opt.step(p, g, cfg, rate);
        std::vector<T> got;
        FeedForwardParams<T>::tensors(p, cfg, [&](const std::string&, const Matrix<T>& x) {
            got.insert(got.end(), x.data(), x.data() + x.size());
        });
        INFO("step " << t);
        REQUIRE(got.size() == ref.size());
        std::size_t differ = 0;
        for (std::size_t i = 0; i < ref.size(); ++i) differ += got[i] != ref[i];
        CHECK(differ == 0);
    }
}

// The rate: 0 -> peak linearly, half a cosine to floor * peak, then flat; no decay when total
// is 0; refusals.
TEST_CASE("schedule: warm-up, cosine", "[training]") {
    const WarmupCosine s{.peak = 2.0, .warmup = 4, .total = 12, .floor = 0.25};
    CHECK(s(1) == 0.5);
    CHECK(s(4) == 2.0);
    CHECK(std::abs(s(8) - 2.0 * (0.25 + 0.75 * 0.5)) <= 1e-15);  // half way down
    CHECK(std::abs(s(5) - 2.0 * (0.25 + 0.75 * 0.5 * (1 + std::cos(std::numbers::pi / 8)))) <= 1e-15);
    CHECK(s(12) == 0.5);
    CHECK(s(1000) == 0.5);
    for (int t = 5; t < 12; ++t) CHECK(s(t + 1) < s(t));
    const WarmupCosine flat_after{.peak = 1.0, .warmup = 0, .total = 0};
    CHECK(flat_after(1) == 1.0);
    CHECK(flat_after(99) == 1.0);
    CHECK_THROWS_AS(s(0), titans::ConfigError);
    CHECK_THROWS_AS((WarmupCosine{.floor = 1.5}.validate()), titans::ConfigError);
    CHECK_THROWS_AS((WarmupCosine{.peak = -1}.validate()), titans::ConfigError);
    CHECK_THROWS_AS((WarmupCosine{.warmup = -1}.validate()), titans::ConfigError);
}

// The global norm is the norm of every entry as one vector (also for 1e200 entries in double,
// where squaring overflows); clipping brings it to max_norm and leaves gradients under it
// alone; a NaN is refused and nothing changes.
TEMPLATE_TEST_CASE("gradients: norm, clipping", "[training]", float, double) {
    using T = TestType;
    Rng rng(seed_for("grad-norm"));
    const FeedForwardConfig cfg{.d_model = 4, .kind = FeedForwardKind::SwiGLU, .hidden = 3};
    auto g = random_grads<T>(cfg, rng, 3.0);
    const std::vector<double> f = flat(g, cfg);
    double sq = 0.0;
    for (double x : f) sq += x * x;
    CHECK(std::abs(titans::gradient_norm(g, cfg) - std::sqrt(sq)) <= 1e-14 * std::sqrt(sq));

    const auto before = g;
    CHECK(titans::clip_gradient_norm(g, cfg, 1e6) == titans::gradient_norm(before, cfg));
    CHECK(identical(g.w1, before.w1));
    const double n = titans::clip_gradient_norm(g, cfg, 0.5);
    CHECK(std::abs(n - std::sqrt(sq)) <= 1e-14 * n);
    CHECK(std::abs(titans::gradient_norm(g, cfg) - 0.5) <= tol<T>() * 10);
    CHECK(rel_error(g.w2, (before.w2.template cast<double>() * (0.5 / n)).eval()) <= tol<T>());

    if constexpr (std::is_same_v<T, double>) {
        auto big = g;
        big.w1.setConstant(1e200);
        const double expect = 1e200 * std::sqrt(static_cast<double>(big.w1.size()));
        CHECK(std::abs(titans::gradient_norm(big, cfg) - expect) <= 1e-12 * expect);
    }
    auto bad = g;
    bad.w3(1, 1) = std::numeric_limits<T>::quiet_NaN();
    const auto bad0 = bad;
    CHECK_THROWS_AS(titans::clip_gradient_norm(bad, cfg, 0.5), titans::NonFiniteError);
    CHECK(identical(bad.w1, bad0.w1));
    CHECK_THROWS_AS(titans::clip_gradient_norm(g, cfg, 0.0), titans::ConfigError);
}

// dL/dy of mean squared error and cross-entropy (with ignored rows and logits of 1e3) against
// central differences; cross-entropy against log-softmax written out; refusals.
TEST_CASE("losses: gradient vs FD", "[training]") {
    Rng rng(seed_for("loss-fd"));
    Matrixd y = random_matrix(4, 3, rng);
    const Matrixd target = random_matrix(4, 3, rng);
    Matrixd dy, scratch;
    titans::mse_loss<double>(y, target, dy);
    CHECK(rel_error(dy, central_diff(y, 1e-6, [&] {
                        return titans::mse_loss<double>(y, target, scratch);
                    })) <= 1e-9);

    for (const double shift : {0.0, 1e3}) {
        Matrixd z = (random_matrix(5, 4, rng) * 3.0).array() + shift;
        const std::vector<int> labels{2, -1, 0, 3, 3};
        Matrixd dz;
        const double loss = titans::cross_entropy_loss<double>(z, labels, dz);
        double expect = 0.0;
        for (int r : {0, 2, 3, 4}) {
            const Eigen::RowVectorXd e = (z.row(r).array() - shift).exp();
            expect += -std::log(e(labels[static_cast<std::size_t>(r)]) / e.sum());
        }
        CHECK(std::abs(loss - expect / 4) <= 1e-12 * std::abs(loss));
        CHECK(dz.row(1).isZero(0.0));
        CHECK(rel_error(dz, central_diff(z, 1e-4, [&] {
                            return titans::cross_entropy_loss<double>(z, labels, scratch);
                        })) <= 1e-7);
    }
    const std::vector<int> none{-1, -1};
    Matrixd z2 = random_matrix(2, 3, rng), dz2;
    CHECK(titans::cross_entropy_loss<double>(z2, none, dz2) == 0.0);
    CHECK(dz2.isZero(0.0));
    const std::vector<int> wrong{0, 3};
    CHECK_THROWS_AS(titans::cross_entropy_loss<double>(z2, wrong, dz2), titans::ShapeError);
    CHECK_THROWS_AS(titans::cross_entropy_loss<double>(z2, std::vector<int>{0}, dz2),
                    titans::ShapeError);
    CHECK_THROWS_AS(titans::mse_loss<double>(z2, target, dz2), titans::ShapeError);
}

// A feed-forward trained by its own backward, clipping and AdamW on a schedule fits a random
// teacher of the same shape: the mean squared error falls 100-fold.
TEMPLATE_TEST_CASE("training: FFN fits teacher", "[training]", float, double) {
    using T = TestType;
    Rng rng(seed_for("ffn-teacher"));
    const FeedForwardConfig cfg{.d_model = 4, .kind = FeedForwardKind::SwiGLU, .hidden = 8};
    const FeedForward<T> teacher(cfg, FeedForwardParams<T>::random(cfg, 1));
    auto p = FeedForwardParams<T>::random(cfg, 2);
    AdamW<T> opt({.weight_decay = 0.0});
    const WarmupCosine lr{.peak = 0.02, .warmup = 20, .total = 400, .floor = 0.05};
    double first = 0.0, last = 0.0;
    for (int step = 1; step <= 400; ++step) {
        const Matrix<T> x = random_matrix(32, cfg.d_model, rng).cast<T>();
        const FeedForward<T> student(cfg, p);
        typename FeedForward<T>::Trace trace;
        Matrix<T> y, dy, dx;
        student.forward(x, y, trace);
        const double loss = titans::mse_loss<T>(y, teacher.forward(x), dy);
        auto g = FeedForwardParams<T>::zeros(cfg);
        student.backward(trace, dy, dx, g);
        titans::clip_gradient_norm(g, cfg, 1.0);
        opt.step(p, g, cfg, lr(step));
        if (step == 1) first = loss;
        last = loss;
    }
    INFO("first " << first << " last " << last);
    CHECK(last < first / 100);
}

// step refuses a bad rate, gradients of another shape or with a NaN, and parameters other than
// those it stepped before; nothing changes then.
TEST_CASE("adamw: refusals", "[training][errors]") {
    Rng rng(seed_for("adamw-refusals"));
    const FeedForwardConfig cfg{.d_model = 3, .kind = FeedForwardKind::SwiGLU, .hidden = 2};
    auto p = FeedForwardParams<double>::random(cfg, 4);
    auto g = random_grads<double>(cfg, rng, 1.0);
    AdamW<double> opt;
    CHECK_THROWS_AS(opt.step(p, g, cfg, -1.0), titans::ConfigError);
    CHECK_THROWS_AS(opt.step(p, g, cfg, std::nan("")), titans::ConfigError);
    auto bad = g;
    bad.w2 = Matrixd::Zero(3, 3);
    CHECK_THROWS_AS(opt.step(p, bad, cfg, 0.1), titans::ShapeError);
    bad = g;
    bad.w1(0, 1) = std::numeric_limits<double>::infinity();
    const auto p0 = p;
    CHECK_THROWS_AS(opt.step(p, bad, cfg, 0.1), titans::NonFiniteError);
    CHECK(identical(p.w1, p0.w1));
    CHECK(opt.steps() == 0);
    CHECK(opt.moments().empty());
    opt.step(p, g, cfg, 0.1);
    CHECK(opt.steps() == 1);
    // Other parameters (a GELU layer has no w3) after the first step.
    const FeedForwardConfig gelu{.d_model = 3, .kind = FeedForwardKind::GELU, .hidden = 2};
    auto q = FeedForwardParams<double>::random(gelu, 4);
    const auto qg = FeedForwardParams<double>::random(gelu, 5);
    CHECK_THROWS_AS(opt.step(q, qg, gelu, 0.1), titans::ShapeError);
    CHECK(opt.steps() == 1);
    CHECK_THROWS_AS(AdamW<double>(AdamWConfig{.beta1 = 1.0}), titans::ConfigError);
    CHECK_THROWS_AS(AdamW<double>(AdamWConfig{.eps = 0.0}), titans::ConfigError);
}

// zeros() of every parameter struct is all zeros (the memory's conv taps and gate biases and the
// norm weights too): what gradients are added to.
TEST_CASE("training: zeros() are zeros", "[training]") {
    using titans::BlockKind;
    for (const BlockKind kind : titans::all_block_kinds) {
        titans::ModelConfig cfg = titans::ModelConfig::uniform(kind, 2, 8, 2, 2, 4, 11, 4);
        for (auto& b : cfg.blocks) b.memory.use_conv = true;
        const auto z = titans::ModelParams<double>::zeros(cfg);
        titans::ModelParams<double>::tensors(z, cfg, [&](const std::string& name, const auto& m) {
            INFO(titans::to_string(kind) << " " << name);
            CHECK(m.isZero(0.0));
        });
        // And random() is not: the check above can fail.
        double sum = 0.0;
        const auto r = titans::ModelParams<double>::random(cfg, 1);
        titans::ModelParams<double>::tensors(r, cfg,
                                             [&](const std::string&, const auto& m) {
                                                 sum += m.cwiseAbs().sum();
                                             });
        CHECK(sum > 0.0);
    }
}

namespace {

/// A user's own parameter struct, not a template: it names its Scalar for the optimiser.
struct TwoTensors {
    using Scalar = double;
    Matrixd a;
    titans::RowVector<double> b;
    template <class Self, class V>
    static void tensors(Self& self, const int&, V&& v) {
        v(std::string("a"), self.a);
        v(std::string("b"), self.b);
    }
};

}  // namespace

TEST_CASE("adamw: a user's own struct", "[training]") {
    Rng rng(seed_for("adamw: a user's own struct"));
    const int cfg = 0;
    TwoTensors p{random_matrix(3, 2, rng), random_matrix(1, 4, rng)};
    TwoTensors g{random_matrix(3, 2, rng), random_matrix(1, 4, rng)};
    const double norm = std::sqrt(g.a.squaredNorm() + g.b.squaredNorm());
    CHECK(std::abs(titans::gradient_norm(g, cfg) - norm) <= 1e-14 * norm);
    CHECK(std::abs(titans::clip_gradient_norm(g, cfg, 0.5 * norm) - norm) <= 1e-14 * norm);
    CHECK(std::abs(titans::gradient_norm(g, cfg) - 0.5 * norm) <= 1e-14 * norm);
    const TwoTensors before = p;
    AdamW<double> opt;
    opt.step(p, g, cfg, 0.1);
    // The first step moves every entry by about lr against its gradient's sign.
    for (Eigen::Index i = 0; i < p.a.size(); ++i) {
        CHECK(std::abs(p.a.data()[i] - before.a.data()[i] * (1 - 0.1 * 0.01) +
                       0.1 * (g.a.data()[i] > 0 ? 1 : -1)) <= 1e-6);
    }
    CHECK(opt.steps() == 1);
}
