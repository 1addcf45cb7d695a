// Quickstart: a neural long-term memory that learns while it reads (Titans, math §1-5).
// Streams a random sequence through the memory in pieces, then shows that the memory's
// surprise (its associative loss, before each write) falls when it sees a pattern again.
// Runs in well under a second; --quick is accepted (CI passes it) and changes nothing.
#include <titans/titans.hpp>

#include <cstdio>

int main() {
    using namespace titans;
    // 64-wide tokens, 4 heads of 16, a 2-layer MLP memory, chunked update of 16 tokens.
    // Constant gates: learning rate theta, momentum decay eta, forget rate alpha.
    MemoryConfig cfg{.d_model = 64, .n_heads = 4, .depth = 2, .gates = GateMode::Constant,
                     .constant_theta = 0.1, .constant_eta = 0.5, .constant_alpha = 0.001,
                     .chunk = 16};
    NeuralMemory<float> mem(cfg, MemoryParams<float>::random(cfg, /*seed=*/42));
    auto state = mem.make_state(/*batch=*/1);
    Diagnostics<float> diag;  // per-token, per-head surprise of the last call
    Matrixf y;                // outputs, (B*N) x d_model

    Matrixf x = Matrixf::Random(256, 64);  // 256 random tokens, streamed in 4 pieces of 64
    for (int piece = 0; piece < 4; ++piece) {
        mem.forward(state, x.middleRows(piece * 64, 64), y, &diag);
        std::printf("piece %d: output %td x %td, mean surprise %.4f\n", piece + 1, y.rows(),
                    y.cols(), diag.loss.mean());
    }
    Matrixf pattern = Matrixf::Random(64, 64);  // the same 64 tokens, 4 times
    for (int rep = 0; rep < 4; ++rep) {
        mem.forward(state, pattern, y, &diag);
        std::printf("pattern, repetition %d: mean surprise %.4f\n", rep + 1, diag.loss.mean());
    }
    mem.forward(state, Matrixf::Random(64, 64), y, &diag);  // control: tokens never seen
    std::printf("new random piece:       mean surprise %.4f\n", diag.loss.mean());
}
