// The backend seam, proved without a GPU: NeuralMemory<T, SimulatedDevice> (its parameters and
// states in an arena only its kernels can open, see backend/simulated_device.hpp) gives the
// CPU backend's outputs, reads, weights, momentum and diagnostics bit for bit, in every mode,
// streamed in random pieces, through transactions, copies and errors, and frees everything it
// allocated.
#include "test_common.hpp"

#include "backend/simulated_device.hpp"

#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

using namespace titans_test;
using titans_test::SimulatedDevice;

namespace {

template <class T>
using DeviceMemory = NeuralMemory<T, SimulatedDevice>;

/// Weights and momentum of every (sequence, head) of both objects' states, bit for bit.
template <class T>
bool same_memory(const NeuralMemory<T>& cpu, const typename NeuralMemory<T>::State& sc,
                 const DeviceMemory<T>& dev, const typename DeviceMemory<T>::State& sd) {
    if (sc.position() != sd.position() || sc.batch() != sd.batch()) return false;
    for (int b = 0; b < sc.batch(); ++b) {
        for (int h = 0; h < cpu.config().n_heads; ++h) {
            const auto wc = cpu.current_weights(sc, b, h), wd = dev.current_weights(sd, b, h);
            const auto mc = cpu.current_momentum(sc, b, h), md = dev.current_momentum(sd, b, h);
            for (std::size_t l = 0; l < wc.size(); ++l) {
                if (!identical(wc[l], wd[l]) || !identical(mc[l], md[l])) return false;
            }
        }
    }
    return true;
}

}  // namespace

TEMPLATE_TEST_CASE("backend: device memory", "[backend]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    const std::vector<Modes> primary = all_primary_modes();
    for (std::size_t combo = 0; combo < 2 * primary.size(); ++combo) {
        Rng rng(seed_for(std::string("backends/memory/") + type_name<T>(), combo));
        const Modes m = random_flags(primary[combo % primary.size()], rng);
        const Case c = make_case<T>(m, rng(), Limits{.max_tokens = 24, .max_batch = 3});
        INFO(c.describe());
        const MemoryParams<T> p = cast_params<T>(c.params);
        const NeuralMemory<T> cpu(c.cfg, p);
        const DeviceMemory<T> dev(c.cfg, p);
        const int B = c.batch, N = c.tokens;
        auto sc = cpu.make_state(B);
        auto sd = dev.make_state(B);
        const Matrix<T> x = c.x.cast<T>();
        int t0 = 0;
        for (int len : random_pieces(rng, N, 5)) {
            Matrix<T> piece(B * len, c.cfg.d_model);
            for (int b = 0; b < B; ++b) piece.middleRows(b * len, len) = x.middleRows(b * N + t0, len);
            Diagnostics<T> dc, dd;
            const Matrix<T> yc = cpu.forward(sc, piece, &dc);
            const Matrix<T> yd = dev.forward(sd, piece, &dd);
            REQUIRE(identical(yc, yd));
            CHECK(identical(dc.loss, dd.loss));
            CHECK(identical(dc.grad_norm, dd.grad_norm));
            t0 += len;
        }
        CHECK(sd.position() == N);
        CHECK(same_memory(cpu, sc, dev, sd));
        const Matrix<T> q = random_matrix(B * 2, c.cfg.d_model, rng).cast<T>();
        CHECK(identical(cpu.read(sc, q), dev.read(sd, q)));

        // A transaction rolled back, a copy advanced alone, an error mid-stream.
        auto copy = sd;
        REQUIRE(dev.begin(sd));
        (void)dev.forward(sd, q);
        dev.rollback(sd);
        CHECK(same_memory(cpu, sc, dev, sd));
        (void)dev.forward(copy, q);
        CHECK(copy.position() == N + 2);
        CHECK(same_memory(cpu, sc, dev, sd));
        Matrix<T> bad = q;
        bad(bad.rows() - 1, 0) = std::numeric_limits<T>::infinity();
        CHECK_THROWS_AS(dev.forward(sd, bad), titans::NonFiniteError);
        CHECK(same_memory(cpu, sc, dev, sd));
        CHECK(identical(cpu.forward(sc, q), dev.forward(sd, q)));
        CHECK(same_memory(cpu, sc, dev, sd));
    }
    CHECK(sim::Arena::instance().live() == live0);  // every upload and state freed
}

// The stateless layers on the device: RMSNorm (with an in-place call and a replaced weight) and
// FeedForward (both kinds), on plain matrices and views.
TEMPLATE_TEST_CASE("backend: device layers", "[backend]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    for (int i = 0; i < 4; ++i) {
        Rng rng(seed_for(std::string("backends/layers/") + type_name<T>(), static_cast<std::uint64_t>(i)));
        const int d = uniform_int(rng, 1, 24), rows = uniform_int(rng, 1, 19);
        const Matrix<T> x = random_matrix(rows, d + 3, rng, -3.0, 3.0).cast<T>();
        const auto xv = x.leftCols(d);
        const titans::RowVector<T> w = random_matrix(1, d, rng, 0.5, 1.5).cast<T>();
        titans::RMSNorm<T> cpu_norm(w, 1e-5);
        titans::RMSNorm<T, SimulatedDevice> dev_norm(w, 1e-5);
        CHECK(identical(cpu_norm.forward(xv), dev_norm.forward(xv)));
        Matrix<T> a = xv, b = xv;
        cpu_norm.forward(a, a);
        dev_norm.forward(b, b);
        CHECK(identical(a, b));
        const titans::RowVector<T> w2 = random_matrix(1, d, rng, 0.5, 1.5).cast<T>();
        cpu_norm.set_weight(w2);
        dev_norm.set_weight(w2);
        CHECK(identical(cpu_norm.forward(xv), dev_norm.forward(xv)));

        const titans::FeedForwardConfig fc{.d_model = d, .kind = i % 2 == 0
                                                                    ? titans::FeedForwardKind::SwiGLU
                                                                    : titans::FeedForwardKind::GELU};
        const auto fp = titans::FeedForwardParams<T>::random(fc, rng());
        const titans::FeedForward<T> cpu_ffn(fc, fp);
        const titans::FeedForward<T, SimulatedDevice> dev_ffn(fc, fp);
        CHECK(identical(cpu_ffn.forward(xv), dev_ffn.forward(xv)));
    }
    CHECK(sim::Arena::instance().live() == live0);
}

TEST_CASE("backend: device checks", "[backend]") {
    const MemoryConfig cfg{.d_model = 8, .n_heads = 2, .depth = 2, .chunk = 4};
    const DeviceMemory<double> dev(cfg, titans::MemoryParamsd::random(cfg, 3));
    // Copies of the object share its upload; a state made elsewhere is refused.
    const std::size_t live = sim::Arena::instance().live();
    const DeviceMemory<double> copy = dev;
    CHECK(sim::Arena::instance().live() == live);
    DeviceMemory<double>::State blank;
    CHECK_THROWS_AS(dev.forward(blank, Matrixd::Zero(2, 8)), titans::ConfigError);
    // A freed id is never reachable again, and freeing poisons.
    bool poisoned = false;
    std::uint64_t id = 0;
    {
        const sim::Handle<Matrixd> h(Matrixd::Ones(2, 2), [&poisoned](Matrixd&) { poisoned = true; });
        id = h.id();
        CHECK(sim::Arena::instance().at<Matrixd>(id)(1, 1) == 1.0);
        CHECK_THROWS_AS(sim::Arena::instance().at<titans::Matrixf>(id), std::logic_error);
    }
    CHECK(poisoned);
    CHECK_THROWS_AS(sim::Arena::instance().at<Matrixd>(id), std::logic_error);
}
