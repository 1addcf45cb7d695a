// The memory MLP and its associative loss (math §2): titans::associative_gradient against
// central finite differences of titans::associative_loss (double), and memory_forward /
// associative_loss / associative_gradient against the plain-loop reference.
#include "test_common.hpp"

#include <cstring>

using namespace titans_test;
namespace ref = titans::reference;

namespace {

struct MlpCase {
    std::vector<Matrixd> W;
    Matrixd k, v;
    int dh = 0;
};

/// Random weights d_h -> e d_h -> ... -> d_h (depth L), n key rows, n value rows.
MlpCase make_mlp_case(Rng& rng, int depth, int rows) {
    MlpCase c;
    c.dh = uniform_int(rng, 2, 5);
    const int hidden = depth >= 2 ? uniform_int(rng, 1, 3) * c.dh : c.dh;
    for (int l = 1; l <= depth; ++l) {
        const int in = l == 1 ? c.dh : hidden;
        const int out = l == depth ? c.dh : hidden;
        c.W.push_back(random_matrix(in, out, rng) * (1.5 / std::sqrt(static_cast<double>(in))));
    }
    c.k = random_matrix(rows, c.dh, rng);
    c.v = random_matrix(rows, c.dh, rng);
    return c;
}

const char* act_name(Activation a) { return titans::to_string(a); }

}  // namespace

// associative_gradient matches central finite differences of associative_loss for every layer
// (depth 1..3, SiLU and GELU, residual on/off, 1 and 3 rows)
TEST_CASE("mlp: gradient == finite diff", "[mlp][gradient]") {
    const int depth = GENERATE(1, 2, 3);
    const Activation act = GENERATE(Activation::SiLU, Activation::GELU);
    const bool residual = GENERATE(false, true);
    const int rows = GENERATE(1, 3);
    const int rep = GENERATE(range(0, 3));
    const std::uint64_t seed =
        seed_for("mlp-fd", static_cast<std::uint64_t>(((depth * 2 + (act == Activation::GELU)) * 2 +
                                                      residual) * 4 + rows) * 8 + static_cast<std::uint64_t>(rep));
    Rng rng(seed);
    MlpCase c = make_mlp_case(rng, depth, rows);
    INFO("seed=" << seed << " depth=" << depth << " act=" << act_name(act) << " residual=" << residual
                 << " rows=" << rows << " d_h=" << c.dh);

    const std::vector<Matrixd> g = titans::associative_gradient<double>(c.W, c.k, c.v, act, residual);
    REQUIRE(g.size() == c.W.size());
    const double h = 1e-5;
    for (std::size_t l = 0; l < c.W.size(); ++l) {
        INFO("layer " << l + 1);
        REQUIRE(g[l].rows() == c.W[l].rows());
        REQUIRE(g[l].cols() == c.W[l].cols());
        Matrixd fd(c.W[l].rows(), c.W[l].cols());
        for (Eigen::Index i = 0; i < c.W[l].rows(); ++i) {
            for (Eigen::Index j = 0; j < c.W[l].cols(); ++j) {
                std::vector<Matrixd> Wp = c.W, Wm = c.W;
                Wp[l](i, j) += h;
                Wm[l](i, j) -= h;
                fd(i, j) = (titans::associative_loss<double>(Wp, c.k, c.v, act, residual) -
                            titans::associative_loss<double>(Wm, c.k, c.v, act, residual)) /
                           (2 * h);
            }
        }
        // Truncation O(h^2) ~ 1e-10 and rounding eps/h ~ 1e-11, relative to the largest entry.
        CHECK(note_error<double>("gradient vs central differences", rel_error(g[l], fd)) <= 1e-7);
    }
}

// finite-difference check has teeth: a gradient with one layer scaled by 1.001 fails it
TEST_CASE("mlp: finite-diff check has teeth", "[mlp][gradient][sanity]") {
    Rng rng(seed_for("mlp-fd-teeth"));
    MlpCase c = make_mlp_case(rng, 2, 2);
    std::vector<Matrixd> g =
        titans::associative_gradient<double>(c.W, c.k, c.v, Activation::SiLU, false);
    g[0] *= 1.001;
    const double h = 1e-5;
    Matrixd fd(c.W[0].rows(), c.W[0].cols());
    for (Eigen::Index i = 0; i < fd.rows(); ++i)
        for (Eigen::Index j = 0; j < fd.cols(); ++j) {
            std::vector<Matrixd> Wp = c.W, Wm = c.W;
            Wp[0](i, j) += h;
            Wm[0](i, j) -= h;
            fd(i, j) = (titans::associative_loss<double>(Wp, c.k, c.v, Activation::SiLU, false) -
                        titans::associative_loss<double>(Wm, c.k, c.v, Activation::SiLU, false)) /
                       (2 * h);
        }
    CHECK(rel_error(g[0], fd) > 1e-7);
}

// memory_forward, associative_loss and associative_gradient agree with the reference (mlp_forward,
// assoc_loss, assoc_grad summed over rows)
TEST_CASE("mlp: functions == reference", "[mlp][reference]") {
    const int depth = GENERATE(1, 2, 3);
    const Activation act = GENERATE(Activation::SiLU, Activation::GELU);
    const bool residual = GENERATE(false, true);
    const int rep = GENERATE(range(0, 3));
    const std::uint64_t seed = seed_for(
        "mlp-vs-ref", static_cast<std::uint64_t>(((depth * 2 + (act == Activation::GELU)) * 2 + residual) * 4 + rep));
    Rng rng(seed);
    const int rows = uniform_int(rng, 1, 5);
    MlpCase c = make_mlp_case(rng, depth, rows);
    INFO("seed=" << seed << " depth=" << depth << " act=" << act_name(act) << " residual=" << residual
                 << " rows=" << rows);

    const Matrixd out = titans::memory_forward<double>(c.W, c.k, act, residual);
    const double loss = titans::associative_loss<double>(c.W, c.k, c.v, act, residual);
    const std::vector<Matrixd> g = titans::associative_gradient<double>(c.W, c.k, c.v, act, residual);

    Matrixd out_ref(rows, c.dh);
    double loss_ref = 0.0;
    std::vector<Matrixd> g_ref;
    for (const Matrixd& w : c.W) g_ref.push_back(Matrixd::Zero(w.rows(), w.cols()));
    for (int i = 0; i < rows; ++i) {
        const Matrixd ki = c.k.row(i), vi = c.v.row(i);
        out_ref.row(i) = ref::mlp_forward(c.W, ki, act, residual);
        loss_ref += ref::assoc_loss(c.W, ki, vi, act, residual);
        const std::vector<Matrixd> gi = ref::assoc_grad(c.W, ki, vi, act, residual);
        for (std::size_t l = 0; l < g_ref.size(); ++l) g_ref[l] += gi[l];
    }
    CHECK(note_error<double>("memory_forward vs reference", rel_error(out, out_ref)) <= tol<double>());
    CHECK(note_error<double>("associative_loss vs reference", std::abs(loss - loss_ref) / loss_ref) <=
          tol<double>());
    CHECK(note_error<double>("associative_gradient vs reference", rel_error(g, g_ref)) <= tol<double>());

    // The float instantiation computes the same functions.
    const auto Wf = cast_layers<float>(c.W);
    const Matrix<float> kf = c.k.cast<float>(), vf = c.v.cast<float>();
    const std::vector<Matrix<float>> gf = titans::associative_gradient<float>(Wf, kf, vf, act, residual);
    const std::vector<Matrixd> g_ref_f = [&] {
        std::vector<Matrixd> r;
        const auto Wr = cast_layers<double>(Wf);
        const Matrixd kr = kf.cast<double>(), vr = vf.cast<double>();
        return titans::associative_gradient<double>(Wr, kr, vr, act, residual);
    }();
    CHECK(note_error<float>("associative_gradient vs double", rel_error(gf, g_ref_f)) <= tol<float>());
    const Matrix<float> outf = titans::memory_forward<float>(Wf, kf, act, residual);
    CHECK(rel_error(outf, titans::memory_forward<double>(cast_layers<double>(Wf), kf.cast<double>().eval(),
                                                         act, residual)) <= tol<float>());
}

// memory gradient of a linear memory is the outer product k^T (k W - v) (residual: k^T (k + k W -
// v))
TEST_CASE("mlp: linear memory gradient", "[mlp][gradient]") {
    Rng rng(seed_for("linear-memory-gradient"));
    for (int rep = 0; rep < 4; ++rep) {
        const int dh = uniform_int(rng, 2, 6), n = uniform_int(rng, 1, 4);
        const std::vector<Matrixd> W{random_matrix(dh, dh, rng)};
        const Matrixd k = random_matrix(n, dh, rng), v = random_matrix(n, dh, rng);
        for (bool residual : {false, true}) {
            const auto g = titans::associative_gradient<double>(W, k, v, Activation::SiLU, residual);
            Matrixd err = k * W[0] - v;
            if (residual) err += k;
            const Matrixd expect = k.transpose() * err;
            CHECK(rel_error(g[0], expect) <= tol<double>());
        }
    }
}

// The backward of the gradient (math §9, second order): ∂φ/∂W, ∂φ/∂k, ∂φ/∂v of
// φ = Σ_l <G_l, associative_gradient_l(W, k, v)> against central differences of φ (depth 1..3,
// SiLU, GELU and Identity, residual on/off, 1 and 3 rows), relative error <= 1e-6.
TEST_CASE("mlp: gradient backward vs FD", "[mlp][gradient][backward]") {
    const int depth = GENERATE(1, 2, 3);
    const Activation act = GENERATE(Activation::SiLU, Activation::GELU, Activation::Identity);
    const bool residual = GENERATE(false, true);
    const int rows = GENERATE(1, 3);
    const std::uint64_t seed = seed_for(
        "mlp-grad-bwd", static_cast<std::uint64_t>(((depth * 3 + static_cast<int>(act)) * 2 + residual) * 4 + rows));
    Rng rng(seed);
    MlpCase c = make_mlp_case(rng, depth, rows);
    std::vector<Matrixd> G;
    for (const Matrixd& w : c.W) G.push_back(random_matrix(w.rows(), w.cols(), rng));
    INFO("seed=" << seed << " depth=" << depth << " act=" << act_name(act) << " residual=" << residual
                 << " rows=" << rows);
    const auto phi = [&]() {
        const auto g = titans::associative_gradient<double>(c.W, c.k, c.v, act, residual);
        double s = 0.0;
        for (std::size_t l = 0; l < g.size(); ++l) s += g[l].cwiseProduct(G[l]).sum();
        return s;
    };
    const auto fd = [&](Matrixd& m) { return central_diff(m, 1e-5, phi); };
    const auto b = titans::associative_gradient_backward<double>(c.W, c.k, c.v, act, residual, G);
    REQUIRE(b.dW.size() == c.W.size());
    for (std::size_t l = 0; l < c.W.size(); ++l) {
        INFO("layer " << l + 1);
        CHECK(note_error<double>("gradient backward dW", rel_error(b.dW[l], fd(c.W[l]))) <= 1e-6);
    }
    CHECK(note_error<double>("gradient backward dk", rel_error(b.dk, fd(c.k))) <= 1e-6);
    CHECK(note_error<double>("gradient backward dv", rel_error(b.dv, fd(c.v))) <= 1e-6);
    std::vector<Matrixd> bad = G;
    bad.pop_back();
    CHECK_THROWS_AS(titans::associative_gradient_backward<double>(c.W, c.k, c.v, act, residual, bad),
                    titans::ShapeError);
}

// detail::activate_with_grad (the fused CUDA kernel's key pass) gives activate and activate_grad
// bit for bit, on random, huge, tiny and signed-zero inputs, in double and float
TEST_CASE("mlp: value and grad in one call", "[mlp][activation]") {
    Rng rng(seed_for("activate-with-grad"));
    std::vector<double> zs = {0.0, -0.0, 1e-300, -1e-300, 1e-30, -1e-30, 40.0, -40.0, 700.0, -700.0,
                              1e30, -1e30, std::numeric_limits<double>::infinity(),
                              -std::numeric_limits<double>::infinity()};
    for (int i = 0; i < 200; ++i) zs.push_back(std::ldexp(uniform(rng, -1.0, 1.0), uniform_int(rng, -40, 12)));
    const auto same = [](auto x, auto y) { return std::memcmp(&x, &y, sizeof x) == 0 || (x != x && y != y); };
    for (const Activation act : {Activation::SiLU, Activation::GELU, Activation::Identity}) {
        for (const double z : zs) {
            INFO("act=" << act_name(act) << " z=" << z);
            const auto vd = titans::detail::activate_with_grad(act, z);
            CHECK(same(vd.value, titans::detail::activate(act, z)));
            CHECK(same(vd.grad, titans::detail::activate_grad(act, z)));
            const float zf = static_cast<float>(z);
            const auto vf = titans::detail::activate_with_grad(act, zf);
            CHECK(same(vf.value, titans::detail::activate(act, zf)));
            CHECK(same(vf.grad, titans::detail::activate_grad(act, zf)));
        }
    }
}
