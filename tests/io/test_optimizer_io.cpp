// titans::io::save_optimizer / load_optimizer: training stopped after k steps, its parameters
// and AdamW state saved and loaded into fresh objects, takes the same bits for the next k steps
// as training that never stopped; malformed files are refused.
#include "test_common.hpp"
#include "io/temp_dir.hpp"

#include <titans/io/optimizer.hpp>

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
