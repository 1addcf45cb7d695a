// RMSNorm and FeedForward on the CUDA backend against the CPU (math §7, and the backward passes
// of math §9): forward, training forward and backward (dx and the parameter gradients, added
// to what the caller holds), widths across block-size boundaries, 0 rows, float and double.

#include <titans/backend/cuda/cuda.cuh>

#include "test_common.hpp"

namespace {

using namespace titans_test;
using titans::backend::Cuda;

template <class T>
Matrix<T> random_t(Eigen::Index r, Eigen::Index c, Rng& rng) {
    return random_matrix(r, c, rng).template cast<T>();
}

template <class T>
void norm_case(int d, int rows, Rng& rng) {
    const titans::RowVector<T> w = random_t<T>(1, d, rng);
    const titans::RMSNorm<T> cpu(w);
    const titans::RMSNorm<T, Cuda> gpu(w);
    const Matrix<T> x = random_t<T>(rows, d, rng), dy = random_t<T>(rows, d, rng);
    INFO("d " << d << " rows " << rows << " " << type_name<T>());
    CHECK(rel_error(gpu.forward(x), cpu.forward(x)) <= tol<T>());
    typename titans::RMSNorm<T>::Trace tc;
    typename titans::RMSNorm<T, Cuda>::Trace tg;
    Matrix<T> yc, yg, dxc, dxg;
    cpu.forward(x, yc, tc);
    gpu.forward(x, yg, tg);
    CHECK(rel_error(yg, yc) <= tol<T>());
    titans::RowVector<T> gc = random_t<T>(1, d, rng), gg = gc;  // gradients add to these
    cpu.backward(tc, dy, dxc, gc);
    gpu.backward(tg, dy, dxg, gg);
    CHECK(rel_error(dxg, dxc) <= tol<T>());
    CHECK(rel_error(gg, gc) <= tol<T>());
}

template <class T>
void ffn_case(titans::FeedForwardKind kind, int d, int h, int rows, Rng& rng) {
    const titans::FeedForwardConfig cfg{.d_model = d, .kind = kind, .hidden = h};
    const auto p = titans::FeedForwardParams<T>::random(cfg, rng());
    const titans::FeedForward<T> cpu(cfg, p);
    const titans::FeedForward<T, Cuda> gpu(cfg, p);
    const Matrix<T> x = random_t<T>(rows, d, rng), dy = random_t<T>(rows, d, rng);
    INFO("kind " << static_cast<int>(kind) << " d " << d << " h " << h << " rows " << rows);
    CHECK(rel_error(gpu.forward(x), cpu.forward(x)) <= tol<T>());
    typename titans::FeedForward<T>::Trace tc;
    typename titans::FeedForward<T, Cuda>::Trace tg;
    Matrix<T> yc, yg, dxc, dxg;
    cpu.forward(x, yc, tc);
    gpu.forward(x, yg, tg);
    CHECK(rel_error(yg, yc) <= tol<T>());
    auto gc = titans::FeedForwardParams<T>::random(cfg, rng());  // gradients add to these
    auto gg = gc;
    cpu.backward(tc, dy, dxc, gc);
    gpu.backward(tg, dy, dxg, gg);
    CHECK(rel_error(dxg, dxc) <= tol<T>());
    CHECK(rel_error(gg.w1, gc.w1) <= tol<T>());
    CHECK(rel_error(gg.w2, gc.w2) <= tol<T>());
    CHECK(rel_error(gg.w3, gc.w3) <= tol<T>());
}

}  // namespace

TEMPLATE_TEST_CASE("cuda layers: RMSNorm", "[cuda]", float, double) {
    Rng rng(seed_for("cuda layers: RMSNorm"));
    // (d = 1 is left out: there dx = u r (1 - x^2 r^2) is all cancellation, so both
    // backends return rounding noise, not a comparable value.)
    for (int d : {2, 7, 256, 300, 1030}) {
        for (int rows : {0, 1, 5, 37}) {
            norm_case<TestType>(d, rows, rng);
        }
    }
}

TEMPLATE_TEST_CASE("cuda layers: FeedForward", "[cuda]", float, double) {
    Rng rng(seed_for("cuda layers: FeedForward"));
    for (auto kind : {titans::FeedForwardKind::SwiGLU, titans::FeedForwardKind::GELU}) {
        for (int rows : {0, 1, 9, 70}) {
            ffn_case<TestType>(kind, 24, 40, rows, rng);
        }
        ffn_case<TestType>(kind, 7, 5, 3, rng);
        ffn_case<TestType>(kind, 128, 344, 33, rng);
    }
}
