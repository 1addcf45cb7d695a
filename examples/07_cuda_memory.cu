// examples/07_cuda_memory.cu: the neural memory on a GPU (titans::backend::Cuda) beside the
// CPU, on the same streams: their outputs agree, and the GPU serves many streams at once.
//
//   07_cuda_memory [--quick] [--streams B] [--tokens N]
//
// Both memories read B streams of N tokens in pieces of 64 (a stream as it arrives), then
// the program prints the largest difference between the two outputs, relative to the
// largest output, and each backend's tokens/s. The CPU figure is of host code compiled in a
// .cu file (nvcc's host pass: no -march=native, no OpenMP), so it is not the CPU backend's
// speed (docs/performance.md has that). Without a CUDA device it says so and exits 77 (ctest:
// skipped). Build: any build with nvcc (target titans::cuda).

#include <titans/titans.hpp>
#include <titans/backend/cuda/cuda.cuh>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

using Clock = std::chrono::steady_clock;

/// The rows of tokens [t, t+n) of every stream of sequence-major x (B streams of N).
titans::Matrixf piece(const titans::Matrixf& x, int B, int N, int t, int n) {
    titans::Matrixf out(B * n, x.cols());
    for (int s = 0; s < B; ++s) {
        out.middleRows(s * n, n) = x.middleRows(s * N + t, n);
    }
    return out;
}

/// Runs `mem` over x in pieces of 64 tokens; returns the outputs (sequence-major) and seconds.
template <class Memory>
double run(const Memory& mem, const titans::Matrixf& x, int B, int N, titans::Matrixf& y) {
    auto state = mem.make_state(B);
    y.resize(x.rows(), x.cols());
    const auto t0 = Clock::now();
    for (int t = 0; t < N; t += 64) {
        const int n = std::min(64, N - t);
        const titans::Matrixf out = mem.forward(state, piece(x, B, N, t, n));
        for (int s = 0; s < B; ++s) {
            y.middleRows(s * N + t, n) = out.middleRows(s * n, n);
        }
    }
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
    int B = 32, N = 1024;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0) {
            B = 4;
            N = 256;
        } else if (std::strcmp(argv[i], "--streams") == 0 && i + 1 < argc) {
            B = std::atoi(argv[++i]);
        } else if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
            N = std::atoi(argv[++i]);
        }
    }
    if (titans::backend::cuda::device_count() == 0) {
        std::printf("07_cuda_memory: no CUDA device on this machine, nothing to run\n");
        return 77;
    }
    // A 2-layer MLP memory over 256-wide tokens, 4 heads, chunks of 64 (math §1-5 defaults:
    // data-dependent gates, conv, clipping).
    titans::MemoryConfig cfg{.d_model = 256, .n_heads = 4, .depth = 2, .chunk = 64};
    auto params = titans::MemoryParams<float>::random(cfg, 7);
    const titans::NeuralMemory<float> cpu(cfg, params);
    const titans::NeuralMemory<float, titans::backend::Cuda> gpu(cfg, params);
    const titans::Matrixf x = titans::Matrixf::Random(B * N, cfg.d_model);

    titans::Matrixf y_cpu, y_gpu;
    const double s_cpu = run(cpu, x, B, N, y_cpu);
    run(gpu, x, B, N, y_gpu);  // the first run pays for cuBLAS's set-up
    const double s_gpu = run(gpu, x, B, N, y_gpu);
    const float diff = (y_gpu - y_cpu).cwiseAbs().maxCoeff() / y_cpu.cwiseAbs().maxCoeff();
    const double tokens = static_cast<double>(B) * N;
    std::printf("%d streams x %d tokens, pieces of 64 (float; outputs copied to the host)\n", B, N);
    std::printf("  largest |GPU - CPU| / largest |CPU output|: %.2e\n", static_cast<double>(diff));
    std::printf("  CPU: %10.0f tokens/s (host code built by nvcc: no -march=native, no OpenMP)\n",
                tokens / s_cpu);
    std::printf("  GPU: %10.0f tokens/s\n", tokens / s_gpu);
    return diff < 1e-4f ? 0 : 1;
}
