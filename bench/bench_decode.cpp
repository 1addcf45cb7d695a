// bench/bench_decode.cpp: serving, one token per stream per call (decode), against the
// chunked rate and the machine's GEMM rate measured in the same run.
//
//   BM_Gemm/512                 float 512^3 GEMM: the machine's dense-product rate
//   BM_StreamRead/MB            sum of an 8 MB (cache) or 256 MB (DRAM) float array with
//                               OpenMP's threads: what this machine reads per second
//   BM_MemoryChunked            headline memory, B = 1, 2048 tokens in calls of 64
//   BM_MemoryDecode/B           headline memory, B streams x 1 token per call, B in {1, 8, 64}
//   BM_ModelChunked/kind        4-block model (d 512), B = 1, 1024 tokens in calls of 64
//   BM_ModelDecode/kind/B       the same model, B streams x 1 token per call
//
// Headline memory: float, d 512, H 8, d_h 64, L 2, expansion 4, chunk 64, lagged retrieval,
// data-dependent gates, conv; theta_max 0.01 and forget bias -8 as in bench_memory.cpp. The
// model: ModelConfig::uniform(kind, 4 blocks, d 512, H 8, L 2, span 512, chunk 64), kinds MAG
// and MAC, same two memory settings in every block.
//
// Timing: decode benchmarks run a fixed number of steps (calls) on one state that keeps
// streaming (the state is made outside the timed loop), so chunk ends (every 64 steps) fall
// inside the measurement as in use; each step's wall time is recorded.
// Counters:
//   tokens_per_second   B tokens per step, per second of wall-clock time
//   p50_us, p99_us      percentiles of one step's latency (microseconds): the time from a
//                       token's arrival to its output, for every stream of the step
//   GFLOPS              (GEMM only)
//   bytes_per_step      what a step must read (4 bytes per value): every parameter once and,
//                       per stream, the memory weights of every head and the attention's
//                       keys and values (model): decoding reads every weight for a single
//                       token, so it is bound by memory bandwidth, not by arithmetic
//   GBps                bytes_per_step per second: compare with BM_StreamRead's GBps
// Ratios (decode / chunked, fraction of GEMM) come from one run's JSON: tools/decode_report.py.
// Under load: bench/decode_contention.sh runs this binary with 0, 1 and 2 busy-loop processes,
// each with the default threads and with OMP_NUM_THREADS=1.

#include <benchmark/benchmark.h>

#include <titans/titans.hpp>

#include "bench_common.hpp"

#include <algorithm>
#include <cstddef>
#include <chrono>
#include <vector>

namespace {

using titans::Matrixf;
using clock_type = std::chrono::steady_clock;

constexpr int kD = 512;
constexpr float kForgetBias = -8.0f;
constexpr double kThetaMax = 0.01;

titans::MemoryConfig memory_config() {
    titans::MemoryConfig cfg;
    cfg.d_model = kD;
    cfg.n_heads = 8;
    cfg.d_head = 64;
    cfg.depth = 2;
    cfg.expansion = 4;
    cfg.chunk = 64;
    cfg.theta_max = kThetaMax;
    return cfg;
}

const titans::NeuralMemory<float>& memory() {
    static const titans::NeuralMemory<float> mem = [] {
        const auto cfg = memory_config();
        auto p = titans::MemoryParams<float>::random(cfg, 1);
        p.b_alpha.setConstant(kForgetBias);
        return titans::NeuralMemory<float>(cfg, std::move(p));
    }();
    return mem;
}

titans::Model<float> make_model(titans::BlockKind kind) {
    auto cfg = titans::ModelConfig::uniform(kind, 4, kD, 8, 2, 512);
    for (auto& b : cfg.blocks) {
        b.memory.theta_max = kThetaMax;
    }
    auto p = titans::ModelParams<float>::random(cfg, 1);
    for (auto& b : p.blocks) {
        b.memory.b_alpha.setConstant(kForgetBias);
    }
    return titans::Model<float>(cfg, std::move(p));
}

const titans::Model<float>& model(titans::BlockKind kind) {
    static const titans::Model<float> mag = make_model(titans::BlockKind::MAG);
    static const titans::Model<float> mac = make_model(titans::BlockKind::MAC);
    return kind == titans::BlockKind::MAG ? mag : mac;
}

titans::BlockKind kind_of(std::int64_t k) {
    return k == 0 ? titans::BlockKind::MAG : titans::BlockKind::MAC;
}

/// p-th percentile (0..100) of `v` (sorted in place), nearest rank.
double percentile(std::vector<double>& v, double p) {
    std::sort(v.begin(), v.end());
    const auto i = static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
}

/// Runs `steps` calls of step(i) (one per benchmark iteration), recording each call's
/// latency; sets tokens_per_second (tokens per call) and p50_us, p99_us.
template <class Step>
void run_steps(benchmark::State& state, std::int64_t tokens_per_call, Step&& step) {
    std::vector<double> us;
    us.reserve(static_cast<std::size_t>(state.max_iterations));
    std::int64_t i = 0;
    for (auto _ : state) {
        const auto t0 = clock_type::now();
        if (!step(i++)) {
            state.SkipWithError("non-finite output");
            return;
        }
        us.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
    }
    state.counters["tokens_per_second"] = benchmark::Counter(
        static_cast<double>(state.iterations() * tokens_per_call), benchmark::Counter::kIsRate);
    state.counters["p50_us"] = percentile(us, 50);
    state.counters["p99_us"] = percentile(us, 99);
}

/// Bytes a decode step reads at least: every parameter once, and for each of B streams the
/// memory weights of every head (math §4: the chunk-start weights W^s).
double step_bytes(const titans::MemoryConfig& m, double params, int B) {
    double per_head = 0;
    for (int l = 1; l <= m.depth; ++l) {
        per_head += static_cast<double>(m.layer_in(l)) * m.layer_out(l);
    }
    return 4.0 * (params + static_cast<double>(B) * m.n_heads * per_head);
}

void set_bytes(benchmark::State& state, double bytes) {
    state.counters["bytes_per_step"] = bytes;
    state.counters["GBps"] = benchmark::Counter(
        bytes * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}

void BM_StreamRead(benchmark::State& state) {
    const auto n = static_cast<std::size_t>(state.range(0)) << 18;  // range(0) MB of floats
    const std::vector<float> a(n, 1.0f);
    for (auto _ : state) {
        double total = 0;
#if defined(_OPENMP)
#pragma omp parallel for reduction(+ : total) schedule(static)
#endif
        for (std::size_t i = 0; i < n; i += 4096) {  // Eigen's vectorised sum per block
            total += Eigen::Map<const Eigen::VectorXf>(a.data() + i, 4096).sum();
        }
        benchmark::DoNotOptimize(total);
    }
    state.counters["GBps"] = benchmark::Counter(
        static_cast<double>(state.iterations()) * static_cast<double>(n) * 4.0 / 1e9,
        benchmark::Counter::kIsRate);
}

/// `pool` pieces of rows x d, made once per benchmark.
std::vector<Matrixf> inputs(Eigen::Index rows, int pool = 16) {
    std::vector<Matrixf> v;
    for (int i = 0; i < pool; ++i) {
        v.push_back(Matrixf::Random(rows, kD));
    }
    return v;
}

void BM_MemoryChunked(benchmark::State& state) {
    const auto& mem = memory();
    auto st = mem.make_state(1);
    const auto x = inputs(64);
    Matrixf y;
    run_steps(state, 64, [&](std::int64_t i) {
        mem.forward(st, x[static_cast<std::size_t>(i) % x.size()], y);
        return titans::detail::all_finite(y);
    });
}

void BM_MemoryDecode(benchmark::State& state) {
    const auto B = static_cast<int>(state.range(0));
    const auto& mem = memory();
    auto st = mem.make_state(B);
    const auto x = inputs(B, 64);
    Matrixf y;
    run_steps(state, B, [&](std::int64_t i) {
        mem.forward(st, x[static_cast<std::size_t>(i) % x.size()], y);
        return titans::detail::all_finite(y);
    });    set_bytes(state, step_bytes(mem.config(),
                                 static_cast<double>(mem.config().parameter_count()), B));
}

void BM_ModelChunked(benchmark::State& state) {
    const auto& m = model(kind_of(state.range(0)));
    auto st = m.make_state(1);
    const auto x = inputs(64);
    run_steps(state, 64, [&](std::int64_t i) {
        return titans::detail::all_finite(m.forward(st, x[static_cast<std::size_t>(i) % x.size()]));
    });
}

void BM_ModelDecode(benchmark::State& state) {
    const auto& m = model(kind_of(state.range(0)));
    const auto B = static_cast<int>(state.range(1));
    auto st = m.make_state(B);
    const auto x = inputs(B, 64);
    run_steps(state, B, [&](std::int64_t i) {
        return titans::detail::all_finite(m.forward(st, x[static_cast<std::size_t>(i) % x.size()]));
    });    double bytes = 4.0 * static_cast<double>(m.config().parameter_count());
    for (const auto& b : m.config().blocks) {
        bytes += step_bytes(b.memory, 0.0, B);
        // Attention keys and values each step reads per stream: the window (MAG, MAL) or, on
        // average, a segment's worth of P ‖ h ‖ s rows (MAC).
        const double rows = b.kind == titans::BlockKind::MAC ? b.segment : b.attention.window - 1;
        bytes += 4.0 * 2.0 * rows * b.attention.inner_dim() * B;
    }
    set_bytes(state, bytes);
}

// Steps per benchmark: whole chunks (64 calls) so that chunk ends weigh as in a long stream.
BENCHMARK(titans_bench::BM_Gemm)->Arg(512)->UseRealTime();
BENCHMARK(BM_StreamRead)->ArgName("MB")->Arg(8)->Arg(256)->UseRealTime();
BENCHMARK(BM_MemoryChunked)->Iterations(32)->UseRealTime();
BENCHMARK(BM_MemoryDecode)->Arg(1)->Iterations(1024)->UseRealTime();
BENCHMARK(BM_MemoryDecode)->Arg(8)->Iterations(512)->UseRealTime();
BENCHMARK(BM_MemoryDecode)->Arg(64)->Iterations(128)->UseRealTime();
BENCHMARK(BM_ModelChunked)->ArgName("mac")->Arg(0)->Arg(1)->Iterations(16)->UseRealTime();
BENCHMARK(BM_ModelDecode)
    ->ArgNames({"mac", "B"})
    ->Args({0, 1})->Args({0, 8})->Args({0, 64})->Args({1, 1})->Args({1, 8})->Args({1, 64})
    ->Iterations(128)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return titans_bench::run(argc, argv); }
