// titans::io consumer: saves a memory's parameters and a checkpoint, loads both back and checks
// the resumed stream continues bit-identically. Argument: a scratch file path.
#include <titans/io/checkpoint.hpp>
#include <titans/titans.hpp>

#include <cstdio>

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    const titans::MemoryConfig cfg{.d_model = 8, .n_heads = 2, .depth = 2, .chunk = 4};
    const titans::NeuralMemory<float> mem(cfg, titans::MemoryParams<float>::random(cfg, 3));
    titans::io::save_parameters(argv[1], mem);
    const titans::NeuralMemory<float> loaded(
        cfg, titans::io::load_parameters<titans::MemoryParams<float>>(argv[1], cfg));
    auto st = mem.make_state(1);
    const titans::Matrixf x = titans::Matrixf::Random(6, 8);
    (void)mem.forward(st, x);
    titans::io::save_checkpoint(argv[1], mem, st);
    auto resumed = titans::io::load_checkpoint(argv[1], loaded);
    const bool same = mem.forward(st, x) == loaded.forward(resumed, x);
    std::printf("titans::io consumer: resume %s\n", same ? "bit-identical" : "DIFFERS");
    return same ? 0 : 1;
}
