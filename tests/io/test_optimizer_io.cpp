// titans::io::save_optimizer / load_optimizer: training stopped after k steps, its parameters
// and AdamW state saved and loaded into fresh objects, takes the same bits for the next k steps
// as training that never stopped; malformed files are refused.
#include "test_common.hpp"
#include "io/temp_dir.hpp"

#include <titans/io/optimizer.hpp>

#include <cmath>
#include <limits>
#include <string>

using namespace titans_test;
using titans::AdamW;
using titans::FeedForward;
using titans::FeedForwardConfig;
using titans::FeedForwardKind;
using titans::FeedForwardParams;

namespace {

/// One step on a fixed batch of the step number: x drawn from the step's seed, the loss
/// Σ dy ⊙ y with dy drawn too.
template <class T>
void train_step(FeedForwardParams<T>& p, AdamW<T>& opt, const FeedForwardConfig& cfg, int step) {
    Rng rng(seed_for("opt-io-step", static_cast<std::uint64_t>(step)));
    const Matrix<T> x = random_matrix(6, cfg.d_model, rng).cast<T>();
    const Matrix<T> dy = random_matrix(6, cfg.d_model, rng).cast<T>();
    const FeedForward<T> ff(cfg, p);
    typename FeedForward<T>::Trace trace;
    Matrix<T> y, dx;
    ff.forward(x, y, trace);
    auto g = FeedForwardParams<T>::zeros(cfg);
    ff.backward(trace, dy, dx, g);
    opt.step(p, g, cfg, 0.01);
}

}  // namespace

TEMPLATE_TEST_CASE("io: optimizer resumes", "[io][training]", float, double) {
    using T = TestType;
    const TempDir dir("optimizer");
    const FeedForwardConfig cfg{.d_model = 5, .kind = FeedForwardKind::SwiGLU, .hidden = 7};
    auto straight = FeedForwardParams<T>::random(cfg, 3);
    AdamW<T> opt({.beta1 = 0.85, .weight_decay = 0.05});
    for (int s = 1; s <= 4; ++s) train_step(straight, opt, cfg, s);
    titans::io::save_parameters(dir / "p.safetensors", cfg, straight);
    titans::io::save_optimizer(dir / "o.safetensors", opt);
    for (int s = 5; s <= 8; ++s) train_step(straight, opt, cfg, s);

    auto resumed = titans::io::load_parameters<FeedForwardParams<T>>(dir / "p.safetensors", cfg);
    AdamW<T> opt2 = titans::io::load_optimizer<T>(dir / "o.safetensors");
    CHECK(opt2.steps() == 4);
    CHECK(opt2.config().beta1 == 0.85);
    CHECK(opt2.config().weight_decay == 0.05);
    for (int s = 5; s <= 8; ++s) train_step(resumed, opt2, cfg, s);
    CHECK(identical(resumed.w1, straight.w1));
    CHECK(identical(resumed.w2, straight.w2));
    CHECK(identical(resumed.w3, straight.w3));
    CHECK(identical(opt2.moments().at("w1").v, opt.moments().at("w1").v));

    // Refused: parameters files, a moment without its pair.
    CHECK_THROWS_AS(titans::io::load_optimizer<T>(dir / "p.safetensors"), titans::FormatError);
    auto w = titans::io::optimizer_writer(opt);
    w.add("m.extra", Matrix<T>::Zero(2, 2).eval());
    w.write(dir / "bad.safetensors");
    CHECK_THROWS_AS(titans::io::load_optimizer<T>(dir / "bad.safetensors"), titans::FormatError);
}

// What save_optimizer writes, load_optimizer reads back: a step whose second moment would
// overflow T (g² beyond the largest value) is refused, so the optimiser saved after it holds
// only finite moments and loads back bit for bit; the save leaves exactly one file.
TEMPLATE_TEST_CASE("io: optimizer save checks", "[io][training]", float, double) {
    using T = TestType;
    const TempDir dir("optimizer_saves");
    const FeedForwardConfig cfg{.d_model = 4, .kind = FeedForwardKind::SwiGLU, .hidden = 3};
    auto p = FeedForwardParams<T>::random(cfg, 5);
    AdamW<T> opt({.weight_decay = 0.1});
    for (int s = 1; s <= 2; ++s) train_step(p, opt, cfg, s);
    auto g = FeedForwardParams<T>::zeros(cfg);
    g.w2.setConstant(static_cast<T>(0.5));
    g.w2(1, 2) = static_cast<T>(4 * std::sqrt(static_cast<double>(std::numeric_limits<T>::max())));
    const auto p0 = p;
    CHECK_THROWS_AS(opt.step(p, g, cfg, 0.01), titans::NonFiniteError);
    CHECK(identical(p.w2, p0.w2));
    titans::io::save_optimizer(dir / "o.safetensors", opt);
    CHECK(dir.entries() == 1);
    const AdamW<T> back = titans::io::load_optimizer<T>(dir / "o.safetensors");
    CHECK(back.steps() == 2);
    REQUIRE(back.moments().size() == opt.moments().size());
    for (const auto& [name, mo] : opt.moments()) {
        CHECK(identical(back.moments().at(name).m, mo.m));
        CHECK(identical(back.moments().at(name).v, mo.v));
    }
}

// A file whose settings are valid in double but not in float: load_optimizer<float> refuses it
// (ConfigError naming the setting), load_optimizer<double> takes it.
TEST_CASE("io: optimizer settings in T", "[io][training]") {
    const TempDir dir("optimizer_float_settings");
    titans::io::save_optimizer(dir / "o.safetensors", AdamW<double>({.eps = 1e-50}));
    CHECK(titans::io::load_optimizer<double>(dir / "o.safetensors").config().eps == 1e-50);
    REQUIRE_THROWS_NAMING(titans::io::load_optimizer<float>(dir / "o.safetensors"),
                          titans::ConfigError, "eps = 1e-50");
}
