// bench/bench_memory.cpp: throughput of the neural long-term memory (math §1-5) on the CPU
// backend, against the rate of a plain Eigen GEMM on the same machine.
//
//   BM_Gemm             float 512 x 512 x 512 row-major GEMM, C.noalias() = A * B: the
//                       reference rate ("what this machine does on dense products").
//   BM_MemoryChunked    NeuralMemory<float> forward, UpdateMode::Chunked (math §4).
//   BM_MemoryPerToken   NeuralMemory<float> forward, UpdateMode::PerToken (math §3).
//
// Headline configuration: float, d = 512, H = 8, d_h = 64, L = 2, e = 4, b = 64, B = 1,
// lagged retrieval, data-dependent gates, conv on. The sweeps vary one axis at a time around
// it (chunk b, depth L, head width d_h with H = 8 fixed, batch B, in-chunk retrieval); the
// full cartesian product would take too long.
//
// Counters (all rates are per second of wall-clock time, UseRealTime):
//   tokens_per_second   B * N tokens per iteration
//   GFLOPS              memory_forward_flops(cfg, B, N) per iteration (memory_flops.hpp), / 1e9
//   flops_per_token     memory_forward_flops / (B * N), a constant of the configuration
//
// Ratios across benchmarks (fraction of BM_Gemm's rate, chunked / per-token speedups) are not
// counters: one benchmark cannot see another's result. tools/bench_report.py computes them
// from the JSON of a single run (--benchmark_format=json --benchmark_out=FILE), so that both
// sides of every ratio were measured under the same machine load.
//
// Timing: one forward call of N tokens per iteration from a fresh state (a copy of a state
// made once, restored with the timer paused), so every iteration does the same work on the
// same values. Setup (parameters, inputs, state, output buffer) is outside the timed loop;
// the per-call allocations of forward (q|k|v, gate logits, head outputs) are inside, as in use.
//
// Parameters: MemoryParams<float>::random(cfg, 1) with theta_max = 0.01 (values stay finite),
// except the forget-gate bias b_alpha = -8 (alpha ~ 3e-4) instead of random()'s -5
// (alpha ~ 0.007; -4, alpha ~ 0.018, before). With random()'s forget gate the write
// (theta ~ 0.005) cannot keep up and for L >= 2 the memory decays towards 0 (0 is a fixed
// point of the MLP update: its gradient vanishes with the weights): after 2048 tokens the
// weights are ~1e-5..1e-8, and a longer stream goes through subnormal floats, which makes
// every product 5-15x slower on x86. That is a property of untrained random gates, not of the
// algorithm; with -8 the weights stay O(0.1) over the whole benchmark. The counter
// `subnormal_outputs` (subnormal entries of the last output) flags a run that still hits
// subnormals. A non-finite output fails the benchmark.

#include <benchmark/benchmark.h>

#include <titans/titans.hpp>

#include "bench_common.hpp"
#include "memory_flops.hpp"

#include <Eigen/Core>

#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

using titans::Matrixf;
using titans::MemoryConfig;

/// Forget-gate bias (alpha = sigmoid(-8) ~ 3e-4); see the header comment. Override with
/// -DTITANS_BENCH_FORGET_BIAS=... to compare.
#ifndef TITANS_BENCH_FORGET_BIAS
#define TITANS_BENCH_FORGET_BIAS -8.0f
#endif
constexpr float kForgetBias = TITANS_BENCH_FORGET_BIAS;

struct MemoryCase {
    int chunk, depth, d_head, batch, retrieval;  // retrieval: 0 Lagged, 1 InChunk
    long tokens;                                 // N per sequence per iteration
};

MemoryConfig make_config(const MemoryCase& c, titans::UpdateMode update) {
    MemoryConfig cfg{};
    cfg.d_model = 512;
    cfg.n_heads = 8;
    cfg.d_head = c.d_head;
    cfg.depth = c.depth;
    cfg.expansion = 4;
    cfg.activation = titans::Activation::SiLU;
    cfg.use_conv = true;
    cfg.gates = titans::GateMode::DataDependent;
    cfg.theta_max = 0.01;
    cfg.update = update;
    cfg.retrieval = c.retrieval == 0 ? titans::Retrieval::Lagged : titans::Retrieval::InChunk;
    cfg.chunk = c.chunk;
    return cfg;
}

MemoryCase case_from(const benchmark::State& state) {
    return MemoryCase{static_cast<int>(state.range(0)), static_cast<int>(state.range(1)),
                      static_cast<int>(state.range(2)), static_cast<int>(state.range(3)),
                      static_cast<int>(state.range(4)), static_cast<long>(state.range(5))};
}

void run_memory(benchmark::State& state, titans::UpdateMode update) {
    const MemoryCase c = case_from(state);
    const MemoryConfig cfg = make_config(c, update);
    auto params = titans::MemoryParams<float>::random(cfg, 1);
    params.b_alpha.setConstant(kForgetBias);
    const titans::NeuralMemory<float> mem(cfg, std::move(params));
    const auto fresh = mem.make_state(c.batch);
    auto st = fresh;
    const Matrixf x = Matrixf::Random(static_cast<Eigen::Index>(c.batch) * c.tokens, cfg.d_model);
    Matrixf y(x.rows(), cfg.d_model);

    for (auto _ : state) {
        state.PauseTiming();
        st = fresh;
        state.ResumeTiming();
        mem.forward(st, x, y);
        benchmark::DoNotOptimize(y.data());
        benchmark::ClobberMemory();
    }
    if (!y.allFinite()) {
        state.SkipWithError("non-finite memory output (state diverged)");
        return;
    }
    const auto subnormal = static_cast<double>(
        (y.array().abs() < std::numeric_limits<float>::min() && y.array() != 0.0f).count());
    state.counters["subnormal_outputs"] = benchmark::Counter(subnormal);
    const double iters = static_cast<double>(state.iterations());
    const double tokens = static_cast<double>(c.batch) * static_cast<double>(c.tokens);
    const double flops = titans_bench::memory_forward_flops(cfg, c.batch, c.tokens);
    state.counters["tokens_per_second"] = benchmark::Counter(iters * tokens, benchmark::Counter::kIsRate);
    state.counters["GFLOPS"] = benchmark::Counter(iters * flops / 1e9, benchmark::Counter::kIsRate);
    state.counters["flops_per_token"] = benchmark::Counter(flops / tokens);
}

void BM_MemoryChunked(benchmark::State& state) { run_memory(state, titans::UpdateMode::Chunked); }
void BM_MemoryPerToken(benchmark::State& state) { run_memory(state, titans::UpdateMode::PerToken); }


// Arguments: b, L, d_h, B, retrieval (0 lagged, 1 in-chunk), N.
const std::vector<std::string> kArgNames{"b", "L", "dh", "B", "inchunk", "N"};

// Chunked: one axis at a time around the headline (b = 64, L = 2, d_h = 64, B = 1, lagged).
// N = 2048 tokens per iteration (~50 ms at the headline on 2 idle cores, well under 1 s on a
// loaded machine); b = 1 runs a chunk machinery per token, so it gets N = 256.
void chunked_args(benchmark::internal::Benchmark* bm) {
    bm->ArgNames(kArgNames);
    bm->Args({64, 2, 64, 1, 0, 2048});   // headline
    for (int b : {1, 16, 256}) {         // chunk sweep
        bm->Args({b, 2, 64, 1, 0, b == 1 ? 256 : 2048});
    }
    for (int L : {1, 3}) {               // depth sweep
        bm->Args({64, L, 64, 1, 0, 2048});
    }
    for (int dh : {32, 128}) {           // head-width sweep (H = 8 fixed, so D = 8 d_h)
        bm->Args({64, 2, dh, 1, 0, 2048});
    }
    bm->Args({64, 2, 64, 1, 1, 2048});   // headline, in-chunk retrieval
    for (int B : {2, 4}) {               // batch sweep
        bm->Args({64, 2, 64, B, 0, 1024});  // B * N = 2048, 4096 tokens
    }
}

// Per-token: the (L, d_h) points of the chunked sweeps, B = 1, and the headline in-chunk.
// b is ignored by this path (recorded as 1); N = 256 (3-4x slower per token than chunked at
// L = 2, so an iteration stays in the tens of ms).
void per_token_args(benchmark::internal::Benchmark* bm) {
    bm->ArgNames(kArgNames);
    for (int L : {1, 2, 3}) {
        bm->Args({1, L, 64, 1, 0, 256});
    }
    for (int dh : {32, 128}) {
        bm->Args({1, 2, dh, 1, 0, 256});
    }
    bm->Args({1, 2, 64, 1, 1, 256});
}

}  // namespace

BENCHMARK(titans_bench::BM_Gemm)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemoryChunked)->Apply(chunked_args)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MemoryPerToken)->Apply(per_token_args)->Unit(benchmark::kMillisecond)->UseRealTime();

int main(int argc, char** argv) {
    return titans_bench::run(argc, argv);
}
