// titans::Trainer (train/trainer.hpp): its step equals the step written out by hand (a model
// rebuilt every step) bit for bit, the loss falls on a learnable task, a refused or failing
// step changes nothing, and its settings are checked.
#include "test_common.hpp"
#include "trainer_common.hpp"

#include "backend/simulated_device.hpp"

#include <limits>
#include <string>
#include <vector>

using namespace titans_test;
using titans::ConfigError;
using titans::NonFiniteError;
using titans::ShapeError;

// The simulated device trains every kind (the memory's and the attention's training passes and
// the memory's staged API, the CPU's on the arena), as the CPU.
static_assert(titans::Model<float, SimulatedDevice>::trainable);
static_assert(titans::Block<float, SimulatedDevice>::trains(BlockKind::MAC));
static_assert(titans::Block<double, SimulatedDevice>::trains(BlockKind::SWA));
static_assert(titans::Model<float>::trainable && titans::Model<double>::trainable);
static_assert(titans::Block<float>::trains(BlockKind::MAC));

// The Trainer on the simulated device takes the CPU trainer's steps bit for bit (losses,
// gradient norms, rates, parameters, optimiser) for models of every kind it trains, with and
// without clipping (MAC + MAG among them).
TEMPLATE_TEST_CASE("trainer: device == CPU", "[training][backend]", float, double) {
    using T = TestType;
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::LMM, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::SWA},
                                                      {BlockKind::MAG, BlockKind::MAC}};
    for (std::size_t s = 0; s < 3; ++s) {
        const std::string name = std::string("trainer/device/") + type_name<T>();
        Rng rng(seed_for(name, s));
        const int vocab = 7, B = uniform_int(rng, 1, 2), N = uniform_int(rng, 5, 9);
        const ModelCase mc = trainer_model_case<T>(stacks[s].first, stacks[s].second, vocab, rng);
        const TrainerConfig tc = trainer_test_config(s == 0 ? 0.05 : 0.0);
        Trainer<T> cpu(mc.cfg, cast_model<T>(mc.params), tc);
        Trainer<T, SimulatedDevice> dev(mc.cfg, cast_model<T>(mc.params), tc);
        for (int t = 1; t <= 3; ++t) {
            INFO("stack " << s << ", step " << t);
            const StepData d = step_data(name + "/data", static_cast<std::uint64_t>(s * 10 + t), B,
                                         N, vocab);
            CHECK(dev.step(d.ids, d.labels, B) == cpu.step(d.ids, d.labels, B));
            CHECK(dev.last_gradient_norm() == cpu.last_gradient_norm());
            CHECK(dev.last_learning_rate() == cpu.last_learning_rate());
            REQUIRE(same_param_bits(dev.params(), cpu.params(), mc.cfg));
            REQUIRE(same_optimizer(dev.optimizer(), cpu.optimizer()));
        }
    }
}

// Three steps of the Trainer and of the hand-written step over the same data: the same loss,
// gradient norm and rate each step, and the same parameters and optimiser, bit for bit, for
// every block kind (MAC's P W_K, P W_V and MAG's projected prefix must follow the parameters
// the model takes in place), with clipping that bites and without clipping.
TEMPLATE_TEST_CASE("trainer: == hand step", "[training]", float, double) {
    using T = TestType;
    const double clip = GENERATE(0.0, 0.05);
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAC, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::LMM}};
    for (std::size_t s = 0; s < 2; ++s) {
        const std::string name = std::string("trainer/hand/") + type_name<T>();
        Rng rng(seed_for(name, s));
        const int vocab = 7, B = uniform_int(rng, 1, 2), N = uniform_int(rng, 5, 9);
        const ModelCase mc = trainer_model_case<T>(stacks[s].first, stacks[s].second, vocab, rng);
        const TrainerConfig tc = trainer_test_config(clip);
        ModelParams<T> p = cast_model<T>(mc.params);
        AdamW<T> opt(tc.adamw);
        Trainer<T> trainer(mc.cfg, p, tc);
        bool clipped = false;
        for (int t = 1; t <= 3; ++t) {
            INFO("stack " << s << ", step " << t << ", clip " << clip);
            const StepData d = step_data(name + "/data", static_cast<std::uint64_t>(s * 10 + t), B,
                                         N, vocab);
            double norm = 0, lr = 0;
            const double loss = hand_step(mc.cfg, p, opt, tc, d, B, norm, lr);
            CHECK(trainer.step(d.ids, d.labels, B) == loss);
            CHECK(trainer.last_loss() == loss);
            CHECK(trainer.last_gradient_norm() == norm);
            CHECK(trainer.last_learning_rate() == lr);
            CHECK(trainer.steps() == t);
            CHECK(trainer.data_position() == t * B);
            REQUIRE(same_param_bits(trainer.params(), p, mc.cfg));
            REQUIRE(same_optimizer(trainer.optimizer(), opt));
            clipped = clipped || (clip > 0 && norm > clip);
        }
        CHECK(clipped == (clip > 0));
    }
}

// A next-token task a model learns at once (token t is followed by t + 1 mod V, sequences
// start anywhere): the loss falls to under half its start in 30 steps. A backward that
// computed a wrong gradient (or a step that ignored it) would not get there.
TEMPLATE_TEST_CASE("trainer: loss falls", "[training]", float, double) {
    using T = TestType;
    const BlockKind kind = GENERATE(BlockKind::LMM, BlockKind::MAC);
    Rng rng(seed_for(std::string("trainer/falls/") + type_name<T>(), static_cast<std::uint64_t>(kind)));
    const int vocab = 5, B = 4, N = 6;
    const auto cfg = ModelConfig::uniform(kind, 1, 8, 2, 1, 4, vocab, 2);
    TrainerConfig tc;
    tc.schedule = {.peak = 3e-2, .warmup = 3, .total = 0};
    Trainer<T> trainer(cfg, ModelParams<T>::random(cfg, rng()), tc);
    double first = 0, last = 0;
    for (int t = 0; t < 30; ++t) {
        std::vector<int> ids, labels;
        for (int b = 0; b < B; ++b) {
            const int start = uniform_int(rng, 0, vocab - 1);
            for (int i = 0; i < N; ++i) {
                ids.push_back((start + i) % vocab);
                labels.push_back((start + i + 1) % vocab);
            }
        }
        const double loss = trainer.step(ids, labels, B);
        if (t == 0) first = loss;
        last = loss;
    }
    INFO("first loss " << first << ", last " << last);
    CHECK(first > 0.5);
    CHECK(last < 0.5 * first);
}

namespace {

/// Runs a step that must throw E naming `text`, then requires the trainer unchanged.
template <class E, class T>
void trainer_require_refused(Trainer<T>& trainer, const Trainer<T>& before, const std::vector<int>& ids,
                     const std::vector<int>& labels, int batch, const char* text) {
    REQUIRE_THROWS_NAMING(trainer.step(ids, labels, batch), E, text);
    REQUIRE(same_trainers(trainer, before));
}

}  // namespace

// Every refused or failing step leaves the parameters, the optimiser and the progress as they
// were (and the next good step is the one a trainer that never saw them takes).
TEMPLATE_TEST_CASE("trainer: refused steps", "[training][errors]", float, double) {
    using T = TestType;
    const std::string name = std::string("trainer/refused/") + type_name<T>();
    Rng rng(seed_for(name));
    const int vocab = 6, B = 2, N = 5;
    const ModelCase mc = trainer_model_case<T>(BlockKind::MAG, BlockKind::MAC, vocab, rng);
    const TrainerConfig tc = trainer_test_config(1.0);
    Trainer<T> trainer(mc.cfg, cast_model<T>(mc.params), tc);
    const StepData d0 = step_data(name, 0, B, N, vocab);
    trainer.step(d0.ids, d0.labels, B);  // moments exist: the refusals must keep them
    const Trainer<T> before = trainer;
    const StepData d = step_data(name, 1, B, N, vocab);

    auto ids = d.ids;
    ids[3] = vocab;
    trainer_require_refused<ShapeError>(trainer, before, ids, d.labels, B, "token id");
    ids[3] = -1;
    trainer_require_refused<ShapeError>(trainer, before, ids, d.labels, B, "token id");
    auto labels = d.labels;
    labels[4] = vocab;
    trainer_require_refused<ShapeError>(trainer, before, d.ids, labels, B, "a label");
    labels.pop_back();
    trainer_require_refused<ShapeError>(trainer, before, d.ids, labels, B, "labels.size()");
    trainer_require_refused<ConfigError>(trainer, before, d.ids, d.labels, 0, "batch");
    trainer_require_refused<ConfigError>(trainer, before, d.ids, d.labels, -2, "batch");
    trainer_require_refused<ShapeError>(trainer, before, d.ids, d.labels, 3, "ids.size()");
    trainer_require_refused<ShapeError>(trainer, before, {}, {}, 1, "ids.size()");

    // The data position would pass max_position.
    Trainer<T> far = before;
    far.set_data_position(titans::limits::max_position - 1);
    const Trainer<T> far_before = far;
    trainer_require_refused<ConfigError>(far, far_before, d.ids, d.labels, B, "data_position");

    // The next good step is the one a trainer that never saw the refusals takes.
    Trainer<T> twin = before;
    CHECK(trainer.step(d.ids, d.labels, B) == twin.step(d.ids, d.labels, B));
    CHECK(same_trainers(trainer, twin));

    // Logits that overflow: every product of the head is about max^2 / 16 (finite parameters).
    constexpr T big = std::numeric_limits<T>::max() / 4;
    auto huge = cast_model<T>(mc.params);
    huge.norm_final.setConstant(big);
    huge.head.setConstant(big);
    Trainer<T> overflow(mc.cfg, huge, tc);
    const Trainer<T> overflow_before = overflow;
    trainer_require_refused<NonFiniteError>(overflow, overflow_before, d.ids, d.labels, B, "not finite");

    // A rate whose step lr / (1 - beta1^t) overflows T: AdamW refuses it before computing
    // anything (naming lr), and the optimiser has not stepped.
    TrainerConfig wild = tc;
    wild.schedule = {.peak = 1e308, .warmup = 0, .total = 0};
    Trainer<T> diverge(mc.cfg, cast_model<T>(mc.params), wild);
    const Trainer<T> diverge_before = diverge;
    trainer_require_refused<ConfigError>(diverge, diverge_before, d.ids, d.labels, B, "lr");
    CHECK(diverge.optimizer().moments().empty());
}

// Settings: every field of TrainerConfig named in its error, a model without a vocabulary, a
// resumed trainer whose optimiser or progress does not fit, set_data_position's range.
TEST_CASE("trainer: settings checked", "[training][errors]") {
    using T = double;
    Rng rng(seed_for("trainer/settings"));
    const int vocab = 5;
    const ModelCase mc = trainer_model_case<T>(BlockKind::LMM, BlockKind::MAL, vocab, rng);
    const auto p = cast_model<T>(mc.params);
    const auto make = [&](const TrainerConfig& c) { return Trainer<T>(mc.cfg, p, c); };
    const auto with = [](auto edit) {
        TrainerConfig c;
        edit(c);
        return c;
    };
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    REQUIRE_NOTHROW(make(TrainerConfig{}));
    REQUIRE_NOTHROW(make(with([](TrainerConfig& c) { c.clip_norm = 0; })));
    for (double bad : {-1.0, nan, inf}) {
        REQUIRE_THROWS_NAMING(make(with([&](TrainerConfig& c) { c.clip_norm = bad; })),
                              ConfigError, "TrainerConfig: clip_norm");
    }
    REQUIRE_THROWS_NAMING(make(with([](TrainerConfig& c) { c.adamw.beta1 = 1.0; })), ConfigError,
                          "TrainerConfig: adamw.beta1");
    REQUIRE_THROWS_NAMING(make(with([](TrainerConfig& c) { c.adamw.eps = 0.0; })), ConfigError,
                          "TrainerConfig: adamw.eps");
    REQUIRE_THROWS_NAMING(make(with([](TrainerConfig& c) { c.schedule.floor = 2.0; })),
                          ConfigError, "TrainerConfig: schedule.floor");
    REQUIRE_THROWS_NAMING(make(with([](TrainerConfig& c) { c.schedule.warmup = -1; })),
                          ConfigError, "TrainerConfig: schedule.warmup");
    REQUIRE_THROWS_NAMING(make(with([&](TrainerConfig& c) { c.schedule.peak = nan; })),
                          ConfigError, "TrainerConfig: schedule.peak");

    ModelConfig vectors = mc.cfg;
    vectors.vocab_size = 0;
    REQUIRE_THROWS_NAMING(
        (Trainer<T>(vectors, ModelParams<T>::random(vectors, 1), TrainerConfig{})), ConfigError,
        "vocab_size");

    // Resumed: the optimiser of other settings, of other tensors, or incomplete; bad progress.
    const TrainerConfig tc;
    Trainer<T> trained(mc.cfg, p, tc);
    const StepData d = step_data("trainer/settings/data", 0, 1, 4, vocab);
    trained.step(d.ids, d.labels, 1);
    const AdamW<T>& opt = trained.optimizer();
    const auto resume = [&](const AdamW<T>& o, const TrainerProgress& pr) {
        return Trainer<T>(mc.cfg, trained.params(), tc, o, pr);
    };
    REQUIRE_NOTHROW(resume(opt, trained.progress()));
    REQUIRE_NOTHROW(resume(AdamW<T>(tc.adamw), {}));
    titans::AdamWConfig other = tc.adamw;
    other.beta2 = 0.9;
    REQUIRE_THROWS_NAMING(resume(AdamW<T>(other, opt.steps(), opt.moments()), {}), ConfigError,
                          "optimizer.config().beta2");
    auto moments = opt.moments();
    moments.begin()->second.m = Matrix<T>::Zero(2, 3);
    moments.begin()->second.v = Matrix<T>::Zero(2, 3);
    REQUIRE_THROWS_NAMING(resume(AdamW<T>(tc.adamw, 1, moments), {}), ShapeError, "moments of");
    moments = opt.moments();
    moments.erase(moments.begin());
    REQUIRE_THROWS_NAMING(resume(AdamW<T>(tc.adamw, 1, moments), {}), ShapeError, "moments of");
    REQUIRE_NOTHROW(resume(AdamW<T>(tc.adamw, 0, {}), {}));
    moments = opt.moments();
    moments["not.a.tensor"] = moments.begin()->second;
    REQUIRE_THROWS_NAMING(resume(AdamW<T>(tc.adamw, 1, moments), {}), ShapeError,
                          "optimizer.moments().size()");
    REQUIRE_THROWS_NAMING(resume(opt, {.data_position = -1}), ConfigError, "data_position");
    REQUIRE_THROWS_NAMING(resume(opt, {.loss = nan}), ConfigError, "loss");
    REQUIRE_THROWS_NAMING(resume(opt, {.learning_rate = -1}), ConfigError, "learning_rate");

    const Trainer<T> before = trained;
    REQUIRE_THROWS_NAMING(trained.set_data_position(-1), ConfigError, "position");
    REQUIRE(same_trainers(trained, before));
    trained.set_data_position(12);
    CHECK(trained.data_position() == 12);
}
