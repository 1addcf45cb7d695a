#pragma once
// bench/bench_common.hpp: what every benchmark binary shares: the GEMM baseline that every
// figure is read against, and the machine context written into the JSON.

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <string>

#include <titans/types.hpp>

namespace titans_bench {

/// Eigen float n x n x n row-major GEMM, C.noalias() = A * B, counter GFLOPS: the machine's
/// dense-product rate in the same run as the other benchmarks.
inline void BM_Gemm(benchmark::State& state) {
    const Eigen::Index n = state.range(0);
    const titans::Matrixf A = titans::Matrixf::Random(n, n);
    const titans::Matrixf B = titans::Matrixf::Random(n, n);
    titans::Matrixf C(n, n);
    for (auto _ : state) {
        C.noalias() = A * B;
        benchmark::DoNotOptimize(C.data());
        benchmark::ClobberMemory();
    }
    const double nd = static_cast<double>(n);
    state.counters["GFLOPS"] = benchmark::Counter(
        static_cast<double>(state.iterations()) * 2.0 * nd * nd * nd / 1e9,
        benchmark::Counter::kIsRate);
    state.counters["eigen_threads"] = benchmark::Counter(Eigen::nbThreads());
}

/// Eigen's thread count and SIMD set and the OpenMP version, into the JSON context.
inline void add_machine_context() {
    benchmark::AddCustomContext("eigen_threads", std::to_string(Eigen::nbThreads()));
    benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
#if defined(_OPENMP)
    benchmark::AddCustomContext("openmp", std::to_string(_OPENMP));
#else
    benchmark::AddCustomContext("openmp", "off");
#endif
}

/// The end of every benchmark main(): parse the flags (unknown ones are an error), add the
/// machine context, run what was registered. Returns the exit code.
inline int run(int argc, char** argv) {
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
        return 1;
    }
    add_machine_context();
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}

}  // namespace titans_bench
