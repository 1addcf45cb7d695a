// The oracle of the memory's backward (math §9): reference::per_token_backward
// (tests/reference/reference_memory_backward.hpp, reverse mode through the per-token recurrence
// of math §3, written without the library's backward code) against finite differences of the
// reference forward, for every tensor a configuration uses and for x, over random small
// configurations that cycle through every mode per_token supports: Lagged / InChunk,
// DataDependent / Constant gates, conv, q/k normalisation, residual, SiLU / GELU memory,
// SiLU / identity projections, clipping (math §10) on and off.
#include "test_common.hpp"

#include "reference/reference_memory_backward.hpp"

#include <algorithm>
#include <array>
#include <string>
#include <vector>

using namespace titans_test;
namespace ref = titans::reference;

namespace {

/// Modes from the low 8 bits of `bits`, shapes and values at random (gate biases and conv taps
/// moved off their initial values so that every gate and tap matters).
BackwardCase draw_backward_case(int bits, Rng& rng) {
    BackwardCase c;
    MemoryConfig& g = c.cfg;
    g.retrieval = (bits & 1) ? Retrieval::InChunk : Retrieval::Lagged;
    g.gates = (bits & 2) ? GateMode::Constant : GateMode::DataDependent;
    g.use_conv = (bits & 4) == 0;
    g.normalize_qk = (bits & 8) == 0;
    g.residual = (bits & 16) != 0;
    g.activation = (bits & 32) ? Activation::GELU : Activation::SiLU;
    g.qkv_activation = (bits & 64) ? Activation::Identity : Activation::SiLU;
    g.max_grad_norm = (bits & 128) ? pick(rng, std::vector<double>{0.05, 0.3, 1.0}) : 0.0;
    draw_backward_shapes(c, rng);
    const int tokens = uniform_int(rng, 1, 5);
    c.x = random_matrix(c.batch * tokens, g.d_model, rng);
    c.dy = random_matrix(c.batch * tokens, g.d_model, rng);
    return c;
}

}  // namespace

TEST_CASE("reference: memory backward vs FD", "[backward][reference]") {
    const int i = GENERATE(range(0, 64));
    const std::uint64_t seed = seed_for("memory-backward-ref", static_cast<std::uint64_t>(i));
    Rng rng(seed);
    // Case i has mode bits i * 37 mod 256: 64 distinct combinations, each mode on in 30-32.
    BackwardCase c = draw_backward_case((i * 37) % 256, rng);
    INFO("seed=" << seed << " case=" << i);
    const auto loss = [&]() { return c.dy.cwiseProduct(ref::per_token(c.cfg, c.p, c.x, c.batch).y).sum(); };
    ref::Gradients g = ref::per_token_backward(c.cfg, c.p, c.x, c.batch, c.dy);
    const double atol = fd_floor(loss());
    std::vector<std::pair<std::string, const double*>> grads;
    MemoryParams<double>::tensors(g.params, c.cfg, [&](const std::string& name, const auto& m) {
        grads.emplace_back(name, m.data());
    });
    std::size_t k = 0;
    MemoryParams<double>::tensors(c.p, c.cfg, [&](const std::string& name, auto& m) {
        INFO(name);
        CHECK(note_error<double>("memory backward reference",
                                 tensor_error(m.data(), grads[k++].second, m.size(), atol, loss)) <= 1e-6);
    });
    CHECK(note_error<double>("memory backward reference",
                             tensor_error(c.x.data(), g.x.data(), c.x.size(), atol, loss)) <= 1e-6);
}
