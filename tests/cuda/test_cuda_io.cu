// Checkpoints of CUDA states (titans::io, State::tensors of the CUDA memory and attention
// states): a model's state written on the GPU restores on the GPU (continuing bit for bit) and
// on the CPU (continuing within rounding), and a CPU checkpoint restores on the GPU.

#include <titans/backend/cuda/cuda.cuh>
#include <titans/io/checkpoint.hpp>

#include <filesystem>

#include "block_cases.hpp"

namespace {

using namespace titans_test;
using titans::backend::Cuda;

std::filesystem::path temp_file(const std::string& name) {
    return std::filesystem::temp_directory_path() /
           ("titans_cuda_io_" + name + "_" + std::to_string(base_seed()) + ".safetensors");
}

}  // namespace

TEST_CASE("cuda io: checkpoints across backends", "[cuda]") {
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAC, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::LMM}};
    for (std::size_t s = 0; s < 2; ++s) {
        Rng rng(seed_for("cuda io", s));
        const int B = 2, N1 = 11, N2 = 9;
        const ModelCase mc = make_model_case<double>(stacks[s].first, stacks[s].second, 8, 0, 0, rng);
        const titans::Model<double> cpu(mc.cfg, mc.params);
        const titans::Model<double, Cuda> gpu(mc.cfg, mc.params);
        auto sc = cpu.make_state(B);
        auto sg = gpu.make_state(B);
        const Matrixd x1 = random_matrix(B * N1, 8, rng), x2 = random_matrix(B * N2, 8, rng);
        (void)cpu.forward(sc, x1);
        (void)gpu.forward(sg, x1);
        INFO("stack " << s);
        const auto gpu_file = temp_file("gpu"), cpu_file = temp_file("cpu");
        titans::io::save_checkpoint(gpu_file, gpu, sg);
        titans::io::save_checkpoint(cpu_file, cpu, sc);
        auto sg_gpu = titans::io::load_checkpoint(gpu_file, gpu);  // GPU -> GPU
        auto sc_gpu = titans::io::load_checkpoint(gpu_file, cpu);  // GPU -> CPU
        auto sg_cpu = titans::io::load_checkpoint(cpu_file, gpu);  // CPU -> GPU
        std::filesystem::remove(gpu_file);
        std::filesystem::remove(cpu_file);
        const Matrixd want = gpu.forward(sg, x2), ref = cpu.forward(sc, x2);
        CHECK(identical(gpu.forward(sg_gpu, x2), want));
        CHECK(rel_error(cpu.forward(sc_gpu, x2), ref) <= 1e-12);
        CHECK(rel_error(gpu.forward(sg_cpu, x2), ref) <= 1e-12);
        CHECK(rel_error(want, ref) <= 1e-12);
    }
}
