// bench/bench_train.cpp: the memory's training step (math §9) on the CPU backend, beside its
// forward and the plain GEMM rate of the same run.
//
//   BM_Gemm             float 512^3 GEMM: the machine's dense-product rate.
//   BM_MemoryForward    NeuralMemory<float>::forward from a fresh state (as bench_memory).
//   BM_MemoryTrainStep  the training forward (keeping the chunk-start memory) + backward
//                       (dy given), gradients into a preallocated MemoryParams.
//   BM_ModelForward     a 4-block model (LMM, MAC, MAG, MAL; the headline memory in each, MAC's
//                       with the in-chunk read; attention of 8 heads over a window or segment
//                       of 256, SwiGLU feed-forward, vectors in and out), forward from a fresh
//                       state.
//   BM_ModelTrainStep   its training forward + backward (dout given). GFLOPS from
//                       Model::work_estimate (2 flops per multiply-add; the step 3x).
//   BM_RebuildStep      a whole optimiser step of that model with a vocabulary of 512 (token
//                       ids in, logits out) written by hand as examples/06 did before the
//                       Trainer: the Model rebuilt from the parameters, a fresh state, the
//                       training forward, cross-entropy, backward, clipping, AdamW.
//   BM_TrainerStep      the same step by titans::Trainer (the model takes the parameters in
//                       place: Model::set_parameters). Same arithmetic, bit for bit: the ratio
//                       of the two times is the cost or gain of the Trainer's bookkeeping.
//   BM_ModelRebuild     the rebuild alone (Model from a copy of the parameters) and
//   BM_SetParameters    Model::set_parameters alone (the values swapped in, MAC's and MAG's
//                       derived data made again), for that model.
//   BM_AdamWHost        one AdamW<float>::step over that model's parameters (host tensors,
//                       checked into scratch, then written), and
//   BM_AdamWBuffer      the same step by ModelAdamW (the parameter buffer: propose, commit);
//                       counter parameters_per_second.
//
// Headline: float, d = 512, H = 8, d_h = 64, L = 2, e = 4, b = 64, B = 1, N = 2048, lagged
// retrieval, data-dependent gates, conv on (the headline of bench_memory); and in-chunk
// retrieval. Counters: tokens_per_second (B * N per iteration) and GFLOPS, where a training
// step counts memory_training_flops, 3x the forward's FLOP model (memory_flops.hpp: the
// backward of a product is two products of the same size, the usual convention), so "step
// GFLOPS / GEMM GFLOPS" is the fraction of the machine's dense rate the step achieves, and
// "step time / forward time" (from the two benchmarks' real times) is the cost of training
// over inference.
//
// Parameters: MemoryParams<float>::random(cfg, 1), theta_max = 0.01 and the forget-gate bias
// -8, as bench_memory (the memory stays away from subnormals); a non-finite output or gradient
// fails the benchmark.

#include <benchmark/benchmark.h>

#include <titans/titans.hpp>
#include <titans/train/trainer.hpp>

#include "bench_common.hpp"
#include "memory_flops.hpp"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace {

using titans::Matrixf;
using titans::MemoryConfig;

MemoryConfig headline(int retrieval) {
    MemoryConfig cfg{};
    cfg.d_model = 512;
    cfg.n_heads = 8;
    cfg.d_head = 64;
    cfg.depth = 2;
    cfg.expansion = 4;
    cfg.theta_max = 0.01;
    cfg.chunk = 64;
    cfg.retrieval = retrieval == 0 ? titans::Retrieval::Lagged : titans::Retrieval::InChunk;
    return cfg;
}

titans::NeuralMemory<float> make_memory(const MemoryConfig& cfg) {
    auto params = titans::MemoryParams<float>::random(cfg, 1);
    params.b_alpha.setConstant(-8.0f);
    return titans::NeuralMemory<float>(cfg, std::move(params));
}

/// tokens_per_second and GFLOPS, from the tokens and flops of one iteration.
void set_counters(benchmark::State& state, long tokens, double flops) {
    const double iters = static_cast<double>(state.iterations());
    state.counters["tokens_per_second"] =
        benchmark::Counter(iters * static_cast<double>(tokens), benchmark::Counter::kIsRate);
    state.counters["GFLOPS"] = benchmark::Counter(iters * flops / 1e9, benchmark::Counter::kIsRate);
}

/// One forward (train false) or training step (forward keeping the trace, then backward) of N
/// tokens per iteration, from a fresh state.
void run(benchmark::State& state, bool train) {
    const MemoryConfig cfg = headline(static_cast<int>(state.range(0)));
    const long N = state.range(1);
    const auto mem = make_memory(cfg);
    const auto fresh = mem.make_state(1);
    auto st = fresh;
    const Matrixf x = Matrixf::Random(N, cfg.d_model);
    const Matrixf dy = Matrixf::Random(N, cfg.d_model) * (1.0f / static_cast<float>(N));
    Matrixf y(N, cfg.d_model), dx(N, cfg.d_model);
    titans::NeuralMemory<float>::Trace trace;
    auto grads = titans::MemoryParams<float>::zeros(cfg);
    for (auto _ : state) {
        state.PauseTiming();
        st = fresh;
        state.ResumeTiming();
        if (train) {
            mem.forward(st, x, y, trace);
            mem.backward(trace, dy, dx, grads);
        } else {
            mem.forward(st, x, y);
        }
        benchmark::DoNotOptimize(dx.data());
        benchmark::DoNotOptimize(y.data());
    }
    if (!y.allFinite() || !dx.allFinite() || !grads.w_q.allFinite()) {
        state.SkipWithError("non-finite output or gradient");
        return;
    }
    set_counters(state, N, train ? titans_bench::memory_training_flops(cfg, 1, N)
                                 : titans_bench::memory_forward_flops(cfg, 1, N));
}

titans::ModelConfig model_config() {
    titans::ModelConfig cfg;
    cfg.d_model = 512;
    for (auto kind : {titans::BlockKind::LMM, titans::BlockKind::MAC, titans::BlockKind::MAG,
                      titans::BlockKind::MAL}) {
        auto b = titans::BlockConfig::make(kind, 512, 8, 2, 256, 64);
        b.memory = headline(kind == titans::BlockKind::MAC ? 1 : 0);
        cfg.blocks.push_back(b);
    }
    return cfg;
}

/// The model's forward (train false) or training step over N tokens per iteration.
void run_model(benchmark::State& state, bool train) {
    const titans::ModelConfig cfg = model_config();
    const long N = state.range(0);
    auto params = titans::ModelParams<float>::random(cfg, 1);
    for (auto& b : params.blocks) b.memory.b_alpha.setConstant(-8.0f);
    const titans::Model<float> model(cfg, std::move(params));
    const auto fresh = model.make_state(1);
    auto st = fresh;
    const Matrixf x = Matrixf::Random(N, cfg.d_model);
    const Matrixf dout = Matrixf::Random(N, cfg.d_model) * (1.0f / static_cast<float>(N));
    Matrixf y, dx;
    titans::Model<float>::Trace trace;
    auto grads = titans::ModelParams<float>::zeros(cfg);
    for (auto _ : state) {
        state.PauseTiming();
        st = fresh;
        state.ResumeTiming();
        if (train) {
            model.forward(st, x, y, trace);
            model.backward(trace, dout, grads, &dx);
        } else {
            y = model.forward(st, x);
        }
        benchmark::DoNotOptimize(y.data());
    }
    if (!y.allFinite() || (train && (!dx.allFinite() || !grads.head.allFinite()))) {
        state.SkipWithError("non-finite output or gradient");
        return;
    }
    set_counters(state, N, (train ? 3.0 : 1.0) * 2.0 * model.work_estimate(N));
}

/// The headline model with a vocabulary (token ids in), its parameters (the forget-gate bias
/// as above) and one step's data: N random ids, each labelled with the next.
struct StepCase {
    titans::ModelConfig cfg = model_config();
    titans::ModelParams<float> params;
    std::vector<int> ids, labels;
    explicit StepCase(long N) {
        cfg.vocab_size = 512;
        params = titans::ModelParams<float>::random(cfg, 1);
        for (auto& b : params.blocks) b.memory.b_alpha.setConstant(-8.0f);
        for (long i = 0; i <= N; ++i) ids.push_back(static_cast<int>((i * 7919) % 512));
        labels.assign(ids.begin() + 1, ids.end());
        ids.pop_back();
    }
};

const titans::TrainerConfig step_settings{.schedule = {.peak = 1e-4}, .clip_norm = 1.0};

void BM_RebuildStep(benchmark::State& state) {
    StepCase c(state.range(0));
    titans::AdamW<float> opt(step_settings.adamw);
    double loss = 0;
    for (auto _ : state) {
        const titans::Model<float> m(c.cfg, c.params);
        auto st = m.make_state(1);
        titans::Model<float>::Trace trace;
        Matrixf logits, dlogits;
        m.forward_tokens(st, c.ids, logits, trace);
        loss = titans::cross_entropy_loss<float>(logits, c.labels, dlogits);
        auto g = titans::ModelParams<float>::zeros(c.cfg);
        m.backward(trace, dlogits, g);
        titans::clip_gradient_norm(g, c.cfg, step_settings.clip_norm);
        opt.step(c.params, g, c.cfg, step_settings.schedule(opt.steps() + 1));
    }
    if (!std::isfinite(loss)) state.SkipWithError("non-finite loss");
    set_counters(state, state.range(0), 3.0 * 2.0 * titans::Model<float>(c.cfg, c.params)
                                                     .work_estimate(state.range(0)));
}

void BM_TrainerStep(benchmark::State& state) {
    StepCase c(state.range(0));
    titans::Trainer<float> trainer(c.cfg, c.params, step_settings);
    double loss = 0;
    for (auto _ : state) {
        loss = trainer.step(c.ids, c.labels, 1);
    }
    if (!std::isfinite(loss)) state.SkipWithError("non-finite loss");
    set_counters(state, state.range(0), 3.0 * 2.0 * trainer.model().work_estimate(state.range(0)));
}

void BM_ModelRebuild(benchmark::State& state) {
    const StepCase c(1);
    for (auto _ : state) {
        const titans::Model<float> m(c.cfg, c.params);
        benchmark::DoNotOptimize(&m);
    }
}

void BM_SetParameters(benchmark::State& state) {
    const StepCase c(1);
    titans::Model<float> model(c.cfg, c.params);
    for (auto _ : state) {
        state.PauseTiming();
        titans::ModelParams<float> next = c.params;
        state.ResumeTiming();
        model.set_parameters(std::move(next));
        state.PauseTiming();
        next = titans::ModelParams<float>{};  // the old values freed outside the timing
        state.ResumeTiming();
    }
}

/// The gradients of one optimiser step: every parameter's, of magnitude about 1e-3.
titans::ModelParams<float> step_gradients(const titans::ModelConfig& cfg) {
    titans::ModelParams<float> g = titans::ModelParams<float>::random(cfg, 2);
    titans::ModelParams<float>::tensors(g, cfg, [](const std::string&, auto& m) { m *= 1e-3f; });
    return g;
}

void set_parameter_rate(benchmark::State& state, const titans::ModelConfig& cfg,
                        const titans::ModelParams<float>& p) {
    state.counters["parameters_per_second"] = benchmark::Counter(
        static_cast<double>(titans::detail::flat_size(p, cfg)), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_AdamWHost(benchmark::State& state) {
    const StepCase c(1);
    titans::ModelParams<float> p = c.params;
    const titans::ModelParams<float> g = step_gradients(c.cfg);
    titans::AdamW<float> opt(step_settings.adamw);
    for (auto _ : state) {
        opt.step(p, g, c.cfg, 1e-4);
    }
    set_parameter_rate(state, c.cfg, p);
}

void BM_AdamWBuffer(benchmark::State& state) {
    const StepCase c(1);
    titans::ModelAdamW<float, titans::backend::Cpu> opt(c.cfg, c.params,
                                                        titans::AdamW<float>(step_settings.adamw));
    titans::ModelGradients<float, titans::backend::Cpu> g(c.cfg, c.params);
    titans::backend::add_flat<titans::backend::Cpu>(step_gradients(c.cfg), c.cfg, g.view());
    for (auto _ : state) {
        opt.propose(std::as_const(g).view(), 1e-4);
        opt.commit();
    }
    set_parameter_rate(state, c.cfg, c.params);
}

void BM_MemoryForward(benchmark::State& state) { run(state, false); }
void BM_ModelForward(benchmark::State& state) { run_model(state, false); }
void BM_ModelTrainStep(benchmark::State& state) { run_model(state, true); }
void BM_MemoryTrainStep(benchmark::State& state) { run(state, true); }

// Arguments: retrieval (0 lagged, 1 in-chunk), N.
void args(benchmark::internal::Benchmark* bm) {
    bm->ArgNames({"inchunk", "N"});
    bm->Args({0, 2048});
    bm->Args({1, 2048});
}

}  // namespace

BENCHMARK(titans_bench::BM_Gemm)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemoryForward)->Apply(args)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemoryTrainStep)->Apply(args)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ModelForward)->ArgName("N")->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ModelTrainStep)->ArgName("N")->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RebuildStep)->ArgName("N")->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TrainerStep)->ArgName("N")->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ModelRebuild)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_SetParameters)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamWHost)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamWBuffer)->Unit(benchmark::kMillisecond)->UseRealTime();

int main(int argc, char** argv) { return titans_bench::run(argc, argv); }
