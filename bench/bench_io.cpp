// bench/bench_io.cpp: speed of the files of titans::io, in MB/s of file bytes, beside the
// machine's memcpy rate of the same bytes (the ceiling of any in-memory serialiser). Files are
// built and parsed in memory (no disk), so the figures are the library's cost alone.
//
//     ./build/release/bench/bench_io
//
// Model: 4 MAG blocks, d = 256, 4 heads, memory depth 2, window 128, float (~20 MB of
// parameters); checkpoints of 8 streams after 300 tokens.
#include <titans/io/checkpoint.hpp>
#include <titans/titans.hpp>

#include <cstring>
#include <vector>

#include "bench_common.hpp"

namespace {

const titans::Model<float>& bench_model() {
    static const titans::Model<float> model = [] {
        const auto cfg = titans::ModelConfig::uniform(titans::BlockKind::MAG, 4, 256, 4, 2, 128);
        return titans::Model<float>(cfg, titans::ModelParams<float>::random(cfg, 7));
    }();
    return model;
}

const titans::ModelState<float>& bench_state() {
    static const titans::ModelState<float> st = [] {
        auto s = bench_model().make_state(8);
        (void)bench_model().forward(s, titans::Matrixf::Random(8 * 300, 256));
        return s;
    }();
    return st;
}

void set_rate(benchmark::State& state, std::size_t bytes) {
    state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                            static_cast<std::int64_t>(bytes));
    state.counters["file_MB"] = static_cast<double>(bytes) / 1e6;
}

void BM_Memcpy(benchmark::State& state) {
    const auto bytes = titans::io::parameters_writer(bench_model().config(), bench_model().params()).bytes();
    std::vector<std::byte> dst(bytes.size());
    for (auto _ : state) {
        std::memcpy(dst.data(), bytes.data(), bytes.size());
        benchmark::DoNotOptimize(dst.data());
        benchmark::ClobberMemory();
    }
    set_rate(state, bytes.size());
}

void BM_SaveParameters(benchmark::State& state) {
    const auto& m = bench_model();
    std::size_t n = 0;
    for (auto _ : state) {
        const auto bytes = titans::io::parameters_writer(m.config(), m.params()).bytes();
        n = bytes.size();
        benchmark::DoNotOptimize(bytes.data());
    }
    set_rate(state, n);
}

void BM_LoadParameters(benchmark::State& state) {
    const auto& m = bench_model();
    const auto bytes = titans::io::parameters_writer(m.config(), m.params()).bytes();
    for (auto _ : state) {
        const titans::io::SafetensorsFile f(bytes);
        auto p = titans::io::load_parameters<titans::ModelParams<float>>(f, m.config());
        benchmark::DoNotOptimize(p.head.data());
    }
    set_rate(state, bytes.size());
}

void BM_SaveCheckpoint(benchmark::State& state) {
    std::size_t n = 0;
    for (auto _ : state) {
        const auto bytes = titans::io::checkpoint_writer(bench_model(), bench_state()).bytes();
        n = bytes.size();
        benchmark::DoNotOptimize(bytes.data());
    }
    set_rate(state, n);
}

void BM_RestoreCheckpoint(benchmark::State& state) {
    const auto bytes = titans::io::checkpoint_writer(bench_model(), bench_state()).bytes();
    for (auto _ : state) {
        const titans::io::SafetensorsFile f(bytes);
        auto st = titans::io::restore_checkpoint(f, bench_model());
        benchmark::DoNotOptimize(st.blocks.data());
    }
    set_rate(state, bytes.size());
}

}  // namespace

BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SaveParameters)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoadParameters)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SaveCheckpoint)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RestoreCheckpoint)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
    return titans_bench::run(argc, argv);
}
