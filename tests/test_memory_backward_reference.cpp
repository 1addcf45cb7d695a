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

struct BackwardCase {
    MemoryConfig cfg;
    MemoryParams<double> p;
    Matrixd x, dy;
    int batch = 1;
};

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
    g.n_heads = uniform_int(rng, 1, 2);
    g.d_head = uniform_int(rng, 1, 3);
    g.d_model = uniform_int(rng, 2, 6);
    g.depth = uniform_int(rng, 1, 3);
    g.expansion = uniform_int(rng, 1, 2);
    g.conv_kernel = uniform_int(rng, 1, 3);
    g.theta_max = uniform(rng, 0.1, 0.9);
    g.constant_theta = uniform(rng, 0.1, 0.6);
    g.constant_eta = uniform(rng, 0.0, 0.9);
    g.constant_alpha = uniform(rng, 0.0, 0.4);
    g.validate();
    c.p = MemoryParams<double>::random(g, rng());
    const int H = g.n_heads;
    c.p.b_theta = random_matrix(1, H, rng);
    c.p.b_eta = random_matrix(1, H, rng, -1.0, 1.5);
    c.p.b_alpha = random_matrix(1, H, rng, -3.0, 0.0);
    for (Matrixd* conv : {&c.p.conv_q, &c.p.conv_k, &c.p.conv_v}) {
        *conv += random_matrix(g.conv_kernel, g.inner_dim(), rng, -0.3, 0.3);
    }
    c.batch = uniform_int(rng, 1, 2);
    const int tokens = uniform_int(rng, 1, 5);
    c.x = random_matrix(c.batch * tokens, g.d_model, rng);
    c.dy = random_matrix(c.batch * tokens, g.d_model, rng);
    return c;
}

/// Estimates of df/dδ at 0 that fail differently: central at 1e-5 and 1e-6 (roundoff where the
/// derivative is tiny next to |L|), 4th order at 1e-3 and 6th order at 1e-2 (truncation where
/// the curvature is strong, e.g. normalising a short q or k, or a step crossing the clipping
/// threshold). The check takes the best: a wrong gradient is off for all of them.
template <class F>
std::array<double, 4> derivative_estimates(F&& f) {
    const double h0 = 1e-5, h1 = 1e-6, h2 = 1e-3, h3 = 1e-2;
    return {(f(h0) - f(-h0)) / (2 * h0), (f(h1) - f(-h1)) / (2 * h1),
            (f(-2 * h2) - 8 * f(-h2) + 8 * f(h2) - f(2 * h2)) / (12 * h2),
            (-f(-3 * h3) + 9 * f(-2 * h3) - 45 * f(-h3) + 45 * f(h3) - 9 * f(2 * h3) + f(3 * h3)) /
                (60 * h3)};
}

/// For one tensor (entries value[0, n), analytic gradient grad): the best estimator's
/// max(max|grad - fd| - atol, 0) / max(max|fd|, 1e-8). atol = 1e-12 max(1, |L|) is the
/// differencing noise floor (a gradient that is exactly 0, as with d_h = 1, normalised q, k and
/// every token clipped, would otherwise fail on 1e-14 of noise).
template <class L>
double tensor_error(double* value, const double* grad, Eigen::Index n, double atol, L&& loss) {
    std::array<double, 4> num{}, den{};
    for (Eigen::Index i = 0; i < n; ++i) {
        const double v0 = value[i];
        const auto fd = derivative_estimates([&](double delta) {
            value[i] = v0 + delta;
            const double r = loss();
            value[i] = v0;
            return r;
        });
        for (std::size_t e = 0; e < fd.size(); ++e) {
            num[e] = std::max(num[e], std::abs(grad[i] - fd[e]));
            den[e] = std::max(den[e], std::abs(fd[e]));
        }
    }
    double best = std::numeric_limits<double>::infinity();
    for (std::size_t e = 0; e < num.size(); ++e) {
        best = std::min(best, std::max(num[e] - atol, 0.0) / std::max(den[e], 1e-8));
    }
    return best;
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
    const double atol = 1e-12 * std::max(1.0, std::abs(loss()));
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
