// The backend seam, proved without a GPU: every layer family on the simulated device (its
// parameters and states in an arena only its kernels can open, see backend/simulated_device.hpp)
// gives the CPU backend's results bit for bit: NeuralMemory (outputs, reads, weights, momentum,
// diagnostics, every mode), Attention (with shared, per-sequence and pre-projected prefixes),
// RMSNorm and FeedForward, every Block kind and mixed Models, streamed in random pieces, through
// transactions, copies and errors, with states compared through their transfer (tensors()), and
// everything it allocated freed; blocks of every kind train there as on the CPU, bit for
// bit. tests/io/test_checkpoint_backends.cpp moves checkpoints across.
#include "block_cases.hpp"
#include "segment_backward_case.hpp"
#include "staged_views_case.hpp"
#include "trainer_common.hpp"
#include "training_pass.hpp"

#include "backend/simulated_device.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

using namespace titans_test;
using titans_test::SimulatedDevice;

namespace {

template <class T>
using DeviceMemory = NeuralMemory<T, SimulatedDevice>;

/// Weights and momentum of every (sequence, head) of both objects' states, bit for bit, and
/// every pair's weights at once (current_weights(state)) the same as pair by pair.
template <class T>
bool same_memory(const NeuralMemory<T>& cpu, const typename NeuralMemory<T>::State& sc,
                 const DeviceMemory<T>& dev, const typename DeviceMemory<T>::State& sd) {
    if (sc.position() != sd.position() || sc.batch() != sd.batch()) return false;
    const int H = cpu.config().n_heads;
    const auto all_c = cpu.current_weights(sc), all_d = dev.current_weights(sd);
    if (all_c.size() != static_cast<std::size_t>(sc.batch() * H) || all_d.size() != all_c.size()) {
        return false;
    }
    for (int b = 0; b < sc.batch(); ++b) {
        for (int h = 0; h < H; ++h) {
            const auto wc = cpu.current_weights(sc, b, h), wd = dev.current_weights(sd, b, h);
            const auto mc = cpu.current_momentum(sc, b, h), md = dev.current_momentum(sd, b, h);
            const auto& ac = all_c[static_cast<std::size_t>(b * H + h)];
            const auto& ad = all_d[static_cast<std::size_t>(b * H + h)];
            if (ac.size() != wc.size() || ad.size() != wc.size()) return false;
            for (std::size_t l = 0; l < wc.size(); ++l) {
                if (!identical(wc[l], wd[l]) || !identical(mc[l], md[l])) return false;
                if (!identical(ac[l], wc[l]) || !identical(ad[l], wc[l])) return false;
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

namespace {

/// A host matrix in the simulated device's arena, and back.
template <class T>
using Dev = titans::backend::Transfer<SimulatedDevice, T>;
template <class T>
Matrix<T> to_host(const typename Dev<T>::Buffer& b) {
    const titans::View<const T> v = Dev<T>::view(b);
    Matrix<T> m(v.rows, v.cols);
    Dev<T>::download(v, titans::view_of(m));
    return m;
}

/// A stateless layer's training forward: forward(x, y, trace).
struct Stateless {
    template <class Layer, class X, class Y, class Trace>
    void operator()(const Layer& l, const X& x, Y&& y, Trace& t) const {
        l.forward(x, y, t);
    }
};
/// A stateful layer's training forward from a fresh state of `batch` streams.
struct FromFresh {
    int batch = 1;
    template <class Layer, class X, class Y, class Trace>
    void operator()(const Layer& l, const X& x, Y&& y, Trace& t) const {
        auto st = l.make_state(batch);
        l.forward(st, x, y, t);
    }
};

/// A layer's gradients g (host tensors: a norm's weight, or a struct of the layer's
/// configuration) flat, in tensors() order, 1 x n: what its backward on views adds to.
template <class T, class Layer, class Grads>
Matrix<T> flat_of(const Layer& layer, const Grads& g) {
    if constexpr (std::is_same_v<Grads, titans::RowVector<T>>) {
        return g;
    } else {
        const auto slots = titans::detail::tensor_slots(g, layer.config());
        std::vector<T> all;
        for (const auto& s : slots) all.insert(all.end(), s.data, s.data + s.size());
        return Eigen::Map<const Matrix<T>>(all.data(), 1, static_cast<Eigen::Index>(all.size()));
    }
}
/// The inverse of flat_of: f's entries back into g's tensors.
template <class T, class Layer, class Grads>
void unflatten(const Layer& layer, const Matrix<T>& f, Grads& g) {
    if constexpr (std::is_same_v<Grads, titans::RowVector<T>>) {
        g = f;
    } else {
        const T* at = f.data();
        for (const auto& s : titans::detail::tensor_slots(g, layer.config())) {
            std::copy(at, at + s.size(), s.data);
            at += s.size();
        }
    }
}

/// A layer's training calls on device views (forward with a trace through `fwd`, backward
/// adding to a device copy of the host gradients gd, flat, copied back into gd) against the
/// CPU layer's host calls (adding to gc, equal to gd before): y and dx bit for bit (the
/// gradients are the caller's to compare); then a dx that is dy, a dy one row short and a flat
/// gradient one entry short are refused, the gradients unchanged.
template <class T, class CpuLayer, class DevLayer, class Grads, class Fwd = Stateless>
void train_on_views(const CpuLayer& cpu, const DevLayer& dev, const Matrix<T>& x,
                    const Matrix<T>& dy, Grads& gc, Grads& gd, Fwd fwd = {}) {
    typename CpuLayer::Trace tc;
    typename DevLayer::Trace td;
    Matrix<T> yc, dxc;
    fwd(cpu, x, yc, tc);
    cpu.backward(tc, dy, dxc, gc);
    const auto xb = Dev<T>::upload(titans::view_of(x));
    const auto dyb = Dev<T>::upload(titans::view_of(dy));
    const Matrix<T> flat = flat_of<T>(dev, gd);
    auto gb = Dev<T>::upload(titans::view_of(flat));
    auto yb = Dev<T>::allocate(x.rows(), x.cols());
    auto dxb = Dev<T>::allocate(x.rows(), x.cols());
    fwd(dev, Dev<T>::view(xb), Dev<T>::view(yb), td);
    const titans::View<T> g = Dev<T>::view(gb);
    dev.backward(td, Dev<T>::view(dyb), Dev<T>::view(dxb), g);
    CHECK(identical(to_host<T>(yb), yc));
    CHECK(identical(to_host<T>(dxb), dxc));
    const Matrix<T> added = to_host<T>(gb);
    const titans::View<T> dxv = Dev<T>::view(dxb);
    CHECK_THROWS_AS(dev.backward(td, dxv, dxv, g), titans::ShapeError);
    const Matrix<T> short_dy = dy.topRows(dy.rows() - 1);
    const auto sdy = Dev<T>::upload(titans::view_of(short_dy));
    auto sdx = Dev<T>::allocate(short_dy.rows(), short_dy.cols());
    CHECK_THROWS_AS(dev.backward(td, Dev<T>::view(sdy), Dev<T>::view(sdx), g),
                    titans::ShapeError);
    const titans::View<T> g_short{g.data, 1, g.cols - 1, g.cols - 1};
    CHECK_THROWS_AS(dev.backward(td, Dev<T>::view(dyb), Dev<T>::view(dxb), g_short),
                    titans::ShapeError);
    CHECK(identical(to_host<T>(gb), added));
    unflatten<T>(dev, added, gd);
}

}  // namespace

// The layers' backend-level training calls (RMSNorm, FeedForward of both kinds) on device
// views equal the CPU's host calls bit for bit, gradients included (added to non-zero ones;
// the refused calls change none).
TEMPLATE_TEST_CASE("backend: training views", "[backend][train]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    for (int i = 0; i < 4; ++i) {
        Rng rng(seed_for(std::string("backends/layer views/") + type_name<T>(),
                         static_cast<std::uint64_t>(i)));
        const int d = uniform_int(rng, 1, 24), rows = uniform_int(rng, 2, 19);
        const Matrix<T> x = random_matrix(rows, d, rng, -3.0, 3.0).cast<T>();
        const Matrix<T> dy = random_matrix(rows, d, rng).cast<T>();
        const titans::RowVector<T> w = random_matrix(1, d, rng, 0.5, 1.5).cast<T>();
        titans::RowVector<T> nc = random_matrix(1, d, rng).cast<T>(), nd = nc;
        train_on_views<T>(titans::RMSNorm<T>(w, 1e-5), titans::RMSNorm<T, SimulatedDevice>(w, 1e-5),
                          x, dy, nc, nd);
        CHECK(identical(nd, nc));
        const titans::FeedForwardConfig fc{
            .d_model = d,
            .kind = i % 2 == 0 ? titans::FeedForwardKind::SwiGLU : titans::FeedForwardKind::GELU};
        const auto fp = titans::FeedForwardParams<T>::random(fc, rng());
        auto gc = titans::FeedForwardParams<T>::random(fc, rng()), gd = gc;
        train_on_views<T>(titans::FeedForward<T>(fc, fp),
                          titans::FeedForward<T, SimulatedDevice>(fc, fp), x, dy, gc, gd);
        CHECK(identical(gd.w1, gc.w1));
        CHECK(identical(gd.w2, gc.w2));
        CHECK(identical(gd.w3, gc.w3));
    }
    CHECK(sim::Arena::instance().live() == live0);
}

// The stateful layers' and the blocks' backend-level training calls (the memory, the
// attention, a block of every kind from a fresh state) on device views equal the CPU's host
// calls bit for bit, gradients included; refused calls change none.
TEMPLATE_TEST_CASE("backend: stateful views", "[backend][train]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    int i = 0;
    for (BlockKind kind : {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL,
                           BlockKind::SWA}) {
        Rng rng(seed_for(std::string("backends/stateful views/") + type_name<T>(),
                         static_cast<std::uint64_t>(i)));
        const BlockTrainCase tc = block_train_case<T>(kind, i++, 12, rng);
        const BlockParams<T> p = cast_block<T>(tc.params);
        const Matrix<T> x = tc.x.cast<T>(), dy = tc.dy.cast<T>();
        INFO(titans::to_string(kind) << " B=" << tc.B << " N=" << tc.N);
        const FromFresh fresh{tc.B};
        auto gc = BlockParams<T>::random(tc.cfg, rng()), gd = gc;  // non-zero to add to
        train_on_views<T>(titans::Block<T>(tc.cfg, p), titans::Block<T, SimulatedDevice>(tc.cfg, p),
                          x, dy, gc, gd, fresh);
        CHECK(same_param_bits(cast_block<double>(gc), cast_block<double>(gd), tc.cfg));
        if (kind != BlockKind::SWA) {
            train_on_views<T>(titans::NeuralMemory<T>(tc.cfg.memory, p.memory),
                              titans::NeuralMemory<T, SimulatedDevice>(tc.cfg.memory, p.memory),
                              x, dy, gc.memory, gd.memory, fresh);
        }
        if (kind != BlockKind::LMM) {
            train_on_views<T>(titans::Attention<T>(tc.cfg.attention, p.attention),
                              titans::Attention<T, SimulatedDevice>(tc.cfg.attention, p.attention),
                              x, dy, gc.attention, gd.attention, fresh);
        }
        CHECK(same_param_bits(cast_block<double>(gc), cast_block<double>(gd), tc.cfg));
    }
    CHECK(sim::Arena::instance().live() == live0);
}

namespace {

/// A memory's backward (host call, then view call) after a training forward from a fresh
/// state, on backend B: both refused with NonFiniteError and the gradients they were to add
/// to, g0 (host) and its flat copy (B's memory), left as they were.
template <class T, class B>
void overflow_refused(const NeuralMemory<T, B>& mem, const Matrix<T>& x, const Matrix<T>& dy,
                      const titans::MemoryParams<T>& g0, int batch) {
    using X = titans::backend::Transfer<B, T>;
    typename NeuralMemory<T, B>::Trace tr;
    Matrix<T> y, dx;
    FromFresh{batch}(mem, x, y, tr);
    auto g = g0;
    REQUIRE_THROWS_AS(mem.backward(tr, dy, dx, g), titans::NonFiniteError);
    CHECK(identical(flat_of<T>(mem, g), flat_of<T>(mem, g0)));
    const Matrix<T> flat = flat_of<T>(mem, g0);
    auto gb = X::upload(titans::view_of(flat));
    const auto dyb = X::upload(titans::view_of(dy));
    auto dxb = X::allocate(dy.rows(), dy.cols());
    REQUIRE_THROWS_AS(mem.backward(tr, X::view(dyb), X::view(dxb), X::view(gb)),
                      titans::NonFiniteError);
    Matrix<T> after(1, flat.cols());
    X::download(X::view(std::as_const(gb)), titans::view_of(after));
    CHECK(identical(after, flat));
}

}  // namespace

// A memory backward whose gradients overflow (dy finite, half the largest value of T) is
// refused on the CPU and on the simulated device, by the host call and the view call alike,
// the gradients it was to add to unchanged: the kernels add to the flat buffer only what they
// have found finite (the view call does not check dx, so the kernels' own check decides).
TEMPLATE_TEST_CASE("backend: memory overflow", "[backend][train]", float, double) {
    using T = TestType;
    for (int i = 0; i < 2; ++i) {
        Rng rng(seed_for(std::string("backends/memory overflow/") + type_name<T>(),
                         static_cast<std::uint64_t>(i)));
        const BlockTrainCase tc = block_train_case<T>(BlockKind::LMM, i, 12, rng);
        const titans::MemoryConfig& mc = tc.cfg.memory;
        const auto p = cast_block<T>(tc.params).memory;
        const Matrix<T> x = tc.x.cast<T>();
        const Matrix<T> dy =
            Matrix<T>::Constant(x.rows(), x.cols(), std::numeric_limits<T>::max() / 2);
        const auto g0 = titans::MemoryParams<T>::random(mc, rng());
        INFO("case " << i << " B=" << tc.B << " N=" << tc.N);
        overflow_refused<T>(NeuralMemory<T>(mc, p), x, dy, g0, tc.B);
        overflow_refused<T>(DeviceMemory<T>(mc, p), x, dy, g0, tc.B);
    }
}

TEMPLATE_TEST_CASE("backend: views, transfer", "[backend]", float, double) {
    using T = TestType;
    namespace tb = titans::backend;
    Rng rng(seed_for(std::string("backends/views/") + type_name<T>(), 0));
    const Matrix<T> m = random_matrix(7, 5, rng).cast<T>();
    const Matrix<T> blk = m.block(2, 1, 4, 3);
    // A block's view: its first entry, its shape, the parent's row stride; no copy.
    const titans::MatrixRef<T> ref = m.block(2, 1, 4, 3);
    const titans::View<const T> v = titans::view_of(ref);
    CHECK(v.data == &m(2, 1));
    CHECK((v.rows == 4 && v.cols == 3 && v.stride == 5));
    const titans::View<const T> tail = v.middle_rows(1, 2);
    CHECK((tail.data == &m(3, 1) && tail.rows == 2 && tail.stride == 5));
    CHECK(identical(Matrix<T>(tb::cpu::as_eigen(v)), blk));

    // The CPU's transfer copies; the device's buffers live in the arena, born NaN.
    static_assert(tb::TransferBackend<tb::Cpu, T>);
    static_assert(tb::TransferBackend<SimulatedDevice, T>);
    using CpuT = tb::Transfer<tb::Cpu, T>;
    using DevT = tb::Transfer<SimulatedDevice, T>;
    CHECK(identical(CpuT::upload(v), blk));
    const std::size_t live0 = sim::Arena::instance().live();
    {
        auto buf = DevT::upload(v);
        const titans::View<T> dv = DevT::view(buf);
        CHECK((dv.rows == 4 && dv.cols == 3 && dv.stride == 3));
        CHECK_NOTHROW(sim::require_device(dv, "buffer"));
        CHECK_NOTHROW(sim::require_device(dv.middle_rows(2, 2), "rows of a buffer"));
        CHECK_THROWS_AS(sim::require_device(v, "host rows"), std::logic_error);
        // Downloaded into a block of a wider host matrix; the rest is untouched.
        Matrix<T> host = Matrix<T>::Zero(6, 5);
        const titans::View<T> into{&host(1, 2), 4, 3, 5};
        DevT::download(dv, into);
        CHECK(identical(Matrix<T>(host.block(1, 2, 4, 3)), blk));
        CHECK(host.leftCols(2).isZero(0));
        CHECK(host.row(0).isZero(0));
        // Host memory is not downloadable (it is not device memory).
        CHECK_THROWS_AS(DevT::download(v, into), std::logic_error);
        auto fresh = DevT::allocate(2, 3);
        CHECK(fresh.get().array().isNaN().all());
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

namespace {

/// Every entry a state's tensors() visits (through the device's transfer for device states),
/// as doubles (exact for float), in visiting order.
template <class State>
std::vector<std::pair<std::string, Matrixd>> state_entries(const State& st) {
    std::vector<std::pair<std::string, Matrixd>> out;
    State::tensors(st, [&out](const std::string& name, const auto& x) {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_integral_v<X>) {
            out.emplace_back(name, Matrixd::Constant(1, 1, static_cast<double>(x)));
        } else {
            out.emplace_back(name, x.template cast<double>());
        }
    });
    return out;
}

/// Same entries, and the same host-readable metadata (what callers read without the kernels).
template <class A, class B>
bool same_states(const A& a, const B& b) {
    if constexpr (requires { a.position(); }) {
        if (a.position() != b.position() || a.batch() != b.batch()) return false;
    }
    if constexpr (requires { a.window_rows(0); }) {
        if (a.well_formed() != b.well_formed()) return false;
        for (int s = 0; s < a.batch(); ++s) {
            if (a.window_rows(s) != b.window_rows(s)) return false;
        }
    }
    const auto ea = state_entries(a), eb = state_entries(b);
    if (ea.size() != eb.size()) return false;
    for (std::size_t i = 0; i < ea.size(); ++i) {
        if (ea[i].first != eb[i].first || !identical(ea[i].second, eb[i].second)) {
            UNSCOPED_INFO("state entry differs: " << ea[i].first);
            return false;
        }
    }
    return true;
}

/// Feeds x ((B*N) x d) to both objects in the same random pieces; true if every output is
/// bit-identical and the states are equal at the end.
template <class Cpu, class Dev, class T>
bool same_stream(const Cpu& cpu, typename Cpu::State& sc, const Dev& dev,
                 typename Dev::State& sd, const Matrix<T>& x, int B, Rng& rng, int span) {
    const int N = static_cast<int>(x.rows()) / B;
    int t0 = 0;
    for (int len : random_pieces(rng, N, span)) {
        const Matrix<T> piece = take_tokens(x, B, N, t0, t0 + len);
        if (!identical(cpu.forward(sc, piece), dev.forward(sd, piece))) return false;
        t0 += len;
    }
    return same_states(sc, sd);
}

}  // namespace

TEMPLATE_TEST_CASE("backend: device attention", "[backend]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    for (int i = 0; i < 6; ++i) {
        Rng rng(seed_for(std::string("backends/attention/") + type_name<T>(), static_cast<std::uint64_t>(i)));
        titans::AttentionConfig cfg{.d_model = uniform_int(rng, 4, 16),
                                    .n_heads = uniform_int(rng, 1, 3),
                                    .window = uniform_int(rng, 1, 7),
                                    .rope = i % 2 == 0};
        cfg.d_head = uniform_int(rng, 0, 1) == 0 ? 0 : uniform_int(rng, 1, 3) * 2;
        if (cfg.d_head == 0 && cfg.d_model % cfg.n_heads != 0) cfg.n_heads = 1;
        if (cfg.rope && cfg.head_dim() % 2 != 0) cfg.rope = false;
        const auto params = titans::AttentionParams<T>::random(cfg, rng());
        const titans::Attention<T> cpu(cfg, params);
        const titans::Attention<T, SimulatedDevice> dev(cfg, params);
        const int B = uniform_int(rng, 1, 3), N = uniform_int(rng, 1, 20), np = uniform_int(rng, 0, 3);
        INFO("case " << i << " B=" << B << " N=" << N << " window=" << cfg.window);
        const Matrix<T> x = random_matrix(B * N, cfg.d_model, rng).cast<T>();
        const Matrix<T> shared = random_matrix(np, cfg.d_model, rng).cast<T>();
        const Matrix<T> per_seq = random_matrix(B * np, cfg.d_model, rng).cast<T>();
        auto sc = cpu.make_state(B);
        auto sd = dev.make_state(B);
        const auto pre_c = cpu.project_prefix(shared);
        const auto pre_d = dev.project_prefix(shared);
        int t0 = 0, call = 0;
        for (int len : random_pieces(rng, N, cfg.window)) {
            const Matrix<T> piece = take_tokens(x, B, N, t0, t0 + len);
            Matrix<T> yc, yd;
            switch (call++ % 3) {
                case 0:
                    yc = cpu.forward(sc, piece, &shared);
                    yd = dev.forward(sd, piece, &shared);
                    break;
                case 1:
                    yc = cpu.forward(sc, piece, &per_seq, titans::PrefixSharing::PerSequence);
                    yd = dev.forward(sd, piece, &per_seq, titans::PrefixSharing::PerSequence);
                    break;
                default:
                    cpu.forward(sc, piece, yc, pre_c);
                    dev.forward(sd, piece, yd, pre_d);
                    break;
            }
            REQUIRE(identical(yc, yd));
            t0 += len;
        }
        CHECK(same_states(sc, sd));
        // A transaction rolled back over several calls, then a refused call: nothing changed.
        REQUIRE(dev.begin(sd));
        for (int k = 0; k < 3; ++k) (void)dev.forward(sd, take_tokens(x, B, N, 0, N));
        dev.rollback(sd);
        CHECK(same_states(sc, sd));
        if (B > 1) {
            const Matrix<T> odd = random_matrix(B * np + 1, cfg.d_model, rng).cast<T>();
            CHECK_THROWS_AS(dev.forward(sd, x, &odd, titans::PrefixSharing::PerSequence),
                            titans::ShapeError);
        }
        CHECK(same_states(sc, sd));
        CHECK(identical(cpu.forward(sc, x, &shared), dev.forward(sd, x, &shared)));
        CHECK(same_states(sc, sd));
    }
    CHECK(sim::Arena::instance().live() == live0);
}

// MAC's segment attention reversed (Attention::segment_backward) on the simulated device: every
// view in device memory (the kernel checks each), the CPU's bits, nothing leaked.
TEMPLATE_TEST_CASE("backend: segment backward", "[backend][train]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    for (int i = 0; i < 8; ++i) {
        Rng rng(seed_for("backends/segment backward", static_cast<std::uint64_t>(i)));
        const SegmentBackwardCase c = segment_backward_case(rng, i);
        INFO("case " << i << " B " << c.B << " C " << c.C << " o " << c.o << " m " << c.m);
        const SegmentBackwardResult cpu = run_segment_backward<T, titans::backend::Cpu>(c);
        const SegmentBackwardResult dev = run_segment_backward<T, SimulatedDevice>(c);
        CHECK(segment_backward_error(dev, cpu, 1e-300) == 0.0);
    }
    CHECK(sim::Arena::instance().live() == live0);
}

// The memory's staged training API on views (forward_part, read_snapshot_backward, Reverse's
// down_to / tap / finish into a flat gradient) gives the host-matrix API's bits on the CPU and,
// every view in device memory, on the simulated device: every primary mode, two parts, a
// read through the snapshot between them tapped into the sweep.
TEMPLATE_TEST_CASE("backend: staged views", "[backend][train]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    for (int i = 0; i < 12; ++i) {
        Rng rng(seed_for("backends/staged views", static_cast<std::uint64_t>(i)));
        const StagedCase c = staged_case(rng, i);
        INFO("case " << i << " B " << c.B << " N " << c.N << " t1 " << c.t1 << " chunk "
                     << c.cfg.effective_chunk());
        const StagedResult host = staged_host<T, titans::backend::Cpu>(c);
        CHECK(staged_error(staged_views<T, titans::backend::Cpu>(c), host) == 0.0);
        CHECK(staged_error(staged_views<T, SimulatedDevice>(c), host) == 0.0);
        if (i == 0) {  // the comparison sees a changed input
            StagedCase off = c;
            off.dh(0, 0) += 0.5;
            CHECK(staged_error(staged_views<T, titans::backend::Cpu>(off), host) > 1e-6);
        }
    }
    CHECK(sim::Arena::instance().live() == live0);
}

TEMPLATE_TEST_CASE("backend: persistent tokens", "[backend]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    for (int np : {0, 1, 4}) {
        Rng rng(seed_for(std::string("backends/persistent/") + type_name<T>(), static_cast<std::uint64_t>(np)));
        const titans::AttentionConfig cfg{.d_model = 8, .n_heads = 2, .window = 3, .rope = true};
        const auto params = titans::AttentionParams<T>::random(cfg, rng());
        const titans::Attention<T> cpu(cfg, params);
        const titans::Attention<T, SimulatedDevice> dev(cfg, params);
        const auto P = titans::PersistentMemory<T>::random(np, cfg.d_model, rng());
        const titans::PersistentMemory<T, SimulatedDevice> Pd(P.tokens());
        const auto kv = P.project_for(cpu);   // projected once, on each backend
        const auto kvd = Pd.project_for(dev);
        CHECK(kv.rows() == np);
        const int B = 2, N = 7;
        const Matrix<T> x = random_matrix(B * N, cfg.d_model, rng).cast<T>();
        auto s1 = cpu.make_state(B);
        auto s2 = cpu.make_state(B);
        auto s3 = dev.make_state(B);
        for (int t0 = 0; t0 < N; t0 += 3) {
            const Matrix<T> piece = take_tokens(x, B, N, t0, std::min(N, t0 + 3));
            const Matrix<T> want = cpu.forward(s1, piece, &P.tokens());
            Matrix<T> y2, y3;
            cpu.forward(s2, piece, y2, kv);
            dev.forward(s3, piece, y3, kvd);
            CHECK(identical(want, y2));
            CHECK(identical(want, y3));
        }
        const titans::PersistentMemory<T> narrow = titans::PersistentMemory<T>::random(2, 4, 1);
        CHECK_THROWS_AS(narrow.project_for(cpu), titans::ShapeError);
    }
    CHECK(sim::Arena::instance().live() == live0);
}

TEMPLATE_TEST_CASE("backend: device blocks", "[backend]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    for (BlockKind kind : titans::all_block_kinds) {
        for (int i = 0; i < 3; ++i) {
            Rng rng(seed_for(std::string("backends/blocks/") + type_name<T>() + titans::to_string(kind),
                             static_cast<std::uint64_t>(i)));
            BlockOptions o;
            o.kind = kind;
            o.use_ffn = i != 1;
            o.n_persistent = uniform_int(rng, 0, 3);
            o.retrieval = kind == BlockKind::MAC || i == 2 ? titans::Retrieval::InChunk
                                                           : titans::Retrieval::Lagged;
            const BlockConfig cfg = random_block_config<T>(o, rng);
            const BlockParams<T> params = cast_block<T>(random_block_params<T>(cfg, rng));
            const titans::Block<T> cpu(cfg, params);
            const titans::Block<T, SimulatedDevice> dev(cfg, params);
            const int B = uniform_int(rng, 1, 3), N = uniform_int(rng, 5, 24);
            INFO(titans::to_string(kind) << " case " << i << " B=" << B << " N=" << N);
            auto sc = cpu.make_state(B);
            auto sd = dev.make_state(B);
            CHECK(same_states(sc, sd));  // MAG / MAL: P already streamed on both
            const Matrix<T> x = random_matrix(B * N, cfg.d_model, rng, -2.0, 2.0).cast<T>();
            REQUIRE(same_stream<titans::Block<T>, titans::Block<T, SimulatedDevice>, T>(
                cpu, sc, dev, sd, x, B, rng, cfg.segment));
            // The mixer alone, a rolled-back transaction, a copy advanced alone.
            const Matrix<T> u = take_tokens(x, B, N, 0, 3);
            CHECK(identical(cpu.mix(sc, u), dev.mix(sd, u)));
            auto copy = sd;
            REQUIRE(dev.begin(sd));
            (void)dev.forward(sd, x);
            (void)dev.mix(sd, u);
            dev.rollback(sd);
            CHECK(same_states(sc, sd));
            (void)dev.forward(copy, x);
            CHECK(copy.position() == sd.position() + N);
            CHECK(same_states(sc, sd));
            CHECK(identical(cpu.forward(sc, x), dev.forward(sd, x)));
            CHECK(same_states(sc, sd));
        }
    }
    CHECK(sim::Arena::instance().live() == live0);
}

TEMPLATE_TEST_CASE("backend: device model", "[backend]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAC, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::LMM}};
    for (std::size_t s = 0; s < 2; ++s) {
        Rng rng(seed_for(std::string("backends/model/") + type_name<T>(), s));
        const int vocab = 13, B = uniform_int(rng, 1, 2), N = uniform_int(rng, 6, 18);
        const ModelCase mc = make_model_case<T>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
        const auto params = cast_model<T>(mc.params);
        const titans::Model<T> cpu(mc.cfg, params);
        const titans::Model<T, SimulatedDevice> dev(mc.cfg, params);
        auto sc = cpu.make_state(B);
        auto sd = dev.make_state(B);
        const std::vector<int> ids = random_ids(rng, B * N, vocab);
        CHECK(identical(cpu.forward_tokens(sc, ids), dev.forward_tokens(sd, ids)));
        CHECK(same_states(sc, sd));
        const Matrix<T> x = random_matrix(B * N, 8, rng).cast<T>();
        REQUIRE(same_stream<titans::Model<T>, titans::Model<T, SimulatedDevice>, T>(
            cpu, sc, dev, sd, x, B, rng, 4));
        CHECK_THROWS_AS(dev.forward_tokens(sd, std::vector<int>{vocab}), titans::ShapeError);
        CHECK(same_states(sc, sd));
    }
    CHECK(sim::Arena::instance().live() == live0);
}

// Transfers counted: a fresh state makes none, and a model's forward keeps its activations on
// the device. Every call (a
// model on token ids or on vectors, a block) makes one upload (the ids or the vectors) and one
// download (the output), whatever the stack of blocks (MAC's segment buffers, its snapshot and
// its segment attention on the device too), streamed in pieces cut anywhere (inside MAC's
// segments); the outputs equal the CPU's bit for bit.
TEMPLATE_TEST_CASE("backend: transfer counts", "[backend]", float, double) {
    using T = TestType;
    auto& traffic = sim::Traffic::instance();
    const auto counted = [&](auto&& call) {
        const long up0 = traffic.uploads, down0 = traffic.downloads;
        auto out = call();
        return std::tuple{std::move(out), traffic.uploads - up0, traffic.downloads - down0};
    };
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::LMM, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::SWA},
                                                      {BlockKind::SWA, BlockKind::LMM},
                                                      {BlockKind::MAG, BlockKind::MAL},
                                                      {BlockKind::MAG, BlockKind::MAC},
                                                      {BlockKind::MAC, BlockKind::LMM}};
    for (std::size_t s = 0; s < std::size(stacks); ++s) {
        Rng rng(seed_for(std::string("backends/transfers/") + type_name<T>(), s));
        const int vocab = 11, B = uniform_int(rng, 1, 3);
        const ModelCase mc = make_model_case<T>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
        const auto params = cast_model<T>(mc.params);
        const titans::Model<T> cpu(mc.cfg, params);
        const titans::Model<T, SimulatedDevice> dev(mc.cfg, params);
        INFO(titans::to_string(stacks[s].first) << " + " << titans::to_string(stacks[s].second)
                                                << " B=" << B);
        auto sc = cpu.make_state(B);
        // A fresh state makes none: MAG's and MAL's memory (and MAL's window) take P there.
        auto [sd, up0, down0] = counted([&] { return dev.make_state(B); });
        CHECK(up0 == 0);
        CHECK(down0 == 0);
        CHECK(same_states(sc, sd));
        auto bc = cpu.blocks()[1].make_state(B);  // a block alone, its own stream
        auto bd = dev.blocks()[1].make_state(B);
        for (int piece = 0; piece < 3; ++piece) {  // chained pieces of random lengths
            const int N = uniform_int(rng, 1, 9);
            const std::vector<int> ids = random_ids(rng, B * N, vocab);
            auto [logits, up, down] = counted([&] { return dev.forward_tokens(sd, ids); });
            CHECK(up == 1);
            CHECK(down == 1);
            CHECK(identical(cpu.forward_tokens(sc, ids), logits));
            const Matrix<T> x = random_matrix(B * N, 8, rng).cast<T>();
            auto [out, up2, down2] = counted([&] { return dev.forward(sd, x); });
            CHECK(up2 == 1);
            CHECK(down2 == 1);
            CHECK(identical(cpu.forward(sc, x), out));
            auto [h, up3, down3] = counted([&] { return dev.blocks()[1].forward(bd, x); });
            CHECK(up3 == 1);
            CHECK(down3 == 1);
            CHECK(identical(cpu.blocks()[1].forward(bc, x), h));
        }
        CHECK(same_states(sc, sd));
        CHECK(same_states(bc, bd));
    }
}

// Block training on the simulated device (every kind; MAC's through the memory's staged API):
// the training forward over pieces cut where the memory is at a chunk boundary and the
// backward chained through d_state_in / d_state_out give the CPU's outputs, dx and every
// gradient bit for bit; everything allocated is freed.
TEMPLATE_TEST_CASE("backend: device training", "[backend][train]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    for (BlockKind kind : {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL,
                           BlockKind::SWA}) {
        for (int i = 0; i < 3; ++i) {
            Rng rng(seed_for(std::string("backends/block training/") + type_name<T>() +
                                 titans::to_string(kind),
                             static_cast<std::uint64_t>(i)));
            const BlockTrainCase tc = block_train_case<T>(kind, i, 14, rng);
            const BlockParams<T> params = cast_block<T>(tc.params);
            const titans::Block<T> cpu(tc.cfg, params);
            const titans::Block<T, SimulatedDevice> dev(tc.cfg, params);
            INFO(titans::to_string(kind) << " case " << i << " B=" << tc.B << " N=" << tc.N
                                         << " pieces " << tc.cuts.size() - 1);
            const BlockPieces c = block_pieces(cpu, tc.B, tc.x, tc.dy, tc.cuts);
            const BlockPieces d = block_pieces(dev, tc.B, tc.x, tc.dy, tc.cuts);
            CHECK(identical(c.y, d.y));
            CHECK(identical(c.dx, d.dx));
            CHECK(same_param_bits(c.g, d.g, tc.cfg));
        }
    }
    CHECK(sim::Arena::instance().live() == live0);
}

// Transfers counted in block training: the training forward and the backward keep their
// activations and traces on the device (the [P; u] rows assembled and taken apart there). A
// forward piece makes one upload (x) and one download (y); a backward piece one upload (dy),
// one download (dx) and one download of the block's flat gradient (the host call adds it to
// host tensors): every sub-layer's kernels add their gradients (P's too) to the flat buffer on
// the device. Outputs, dx and gradients equal the CPU's bit for bit. MAC's training pass
// (segment buffers, snapshots, segment attention and its reverse) stays on the device too; only
// its segment state's adjoint, host matrices as every state adjoint, crosses where it is given
// or asked for: down, the kept rows' keys and values and the incoming snapshot's adjoint when the
// piece starts mid-segment; given, the later snapshot's adjoint down and up (added there), and
// the kept rows' adjoint up when the piece ends mid-segment.
TEMPLATE_TEST_CASE("backend: training transfers", "[backend][train]", float, double) {
    using T = TestType;
    auto& traffic = sim::Traffic::instance();
    for (BlockKind kind : {BlockKind::LMM, BlockKind::MAG, BlockKind::MAL, BlockKind::SWA,
                           BlockKind::MAC}) {
        for (int i = 0; i < 3; ++i) {
            Rng rng(seed_for(std::string("backends/training transfers/") + type_name<T>() +
                                 titans::to_string(kind),
                             static_cast<std::uint64_t>(i)));
            const BlockTrainCase tc = block_train_case<T>(kind, i, 12, rng);
            const BlockParams<T> params = cast_block<T>(tc.params);
            const titans::Block<T> cpu(tc.cfg, params);
            const titans::Block<T, SimulatedDevice> dev(tc.cfg, params);
            INFO(titans::to_string(kind) << " case " << i << " B=" << tc.B << " N=" << tc.N);
            auto sc = cpu.make_state(tc.B);
            auto sd = dev.make_state(tc.B);
            const std::size_t K = tc.cuts.size() - 1;
            std::vector<typename titans::Block<T>::Trace> tcpu(K);
            std::vector<typename titans::Block<T, SimulatedDevice>::Trace> tdev(K);
            for (std::size_t k = 0; k < K; ++k) {
                const Matrix<T> xk =
                    take_tokens(tc.x, tc.B, tc.N, tc.cuts[k], tc.cuts[k + 1]).template cast<T>();
                Matrix<T> yc, yd;
                cpu.forward(sc, xk, yc, tcpu[k]);
                const long up0 = traffic.uploads, down0 = traffic.downloads;
                dev.forward(sd, xk, yd, tdev[k]);
                CHECK(traffic.uploads - up0 == 1);
                CHECK(traffic.downloads - down0 == 1);
                CHECK(identical(yc, yd));
            }
            auto gc = titans::BlockParams<T>::zeros(tc.cfg);
            auto gd = gc;
            titans::BlockStateGradient<T> nc, nd;
            for (std::size_t k = K; k-- > 0;) {
                const Matrix<T> dyk =
                    take_tokens(tc.dy, tc.B, tc.N, tc.cuts[k], tc.cuts[k + 1]).template cast<T>();
                Matrix<T> dxc, dxd;
                titans::BlockStateGradient<T> ic, id;
                cpu.backward(tcpu[k], dyk, dxc, gc, &ic, &nc);
                long up = 1, down = 2;
                if (kind == BlockKind::MAC && tc.cuts[k + 1] > tc.cuts[k]) {
                    const int C = tc.cfg.segment;
                    down += tc.cuts[k] % C != 0 ? 3 : 0;
                    if (!nd.mac.empty()) {
                        ++down;
                        ++up;
                        up += tc.cuts[k + 1] % C != 0 ? 2 : 0;
                    }
                }
                const long up0 = traffic.uploads, down0 = traffic.downloads;
                dev.backward(tdev[k], dyk, dxd, gd, &id, &nd);
                CHECK(traffic.uploads - up0 == up);
                CHECK(traffic.downloads - down0 == down);
                CHECK(identical(dxc, dxd));
                nc = std::move(ic);
                nd = std::move(id);
            }
            CHECK(same_param_bits(cast_block<double>(gc), cast_block<double>(gd), tc.cfg));
        }
    }
}

// Transfers counted in model training: a training forward on token ids uploads the ids once
// (gathered on the device) and downloads the logits once, on vectors the same; the backward
// uploads dL/dlogits once and downloads dx once (when asked); its gradients gather in one flat
// buffer on the device (every sub-layer's kernels add theirs there), downloaded once into host
// tensors, or (ModelGradients) not at all; the embedding's scatter reads the ids the forward
// took up. forward_loss takes the ids and labels up and brings the loss down (one scalar),
// backward_loss then uploads nothing; the gradient buffer's norm and clipping bring two scalars
// down. Logits, losses, dx, norms and
// gradients equal the CPU's bit for bit.
TEMPLATE_TEST_CASE("backend: model transfers", "[backend][train]", float, double) {
    using T = TestType;
    auto& traffic = sim::Traffic::instance();
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::LMM, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::SWA},
                                                      {BlockKind::MAG, BlockKind::MAL},
                                                      {BlockKind::MAC, BlockKind::LMM}};
    for (std::size_t s = 0; s < std::size(stacks); ++s) {
        for (const bool tokens : {true, false}) {
            Rng rng(seed_for(std::string("backends/model transfers/") + type_name<T>(),
                             2 * s + (tokens ? 1 : 0)));
            const int vocab = 11, B = uniform_int(rng, 1, 3), N = uniform_int(rng, 1, 9);
            const ModelCase mc =
                make_model_case<T>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
            const auto params = cast_model<T>(mc.params);
            const titans::Model<T> cpu(mc.cfg, params);
            const titans::Model<T, SimulatedDevice> dev(mc.cfg, params);
            INFO(titans::to_string(stacks[s].first) << " + " << titans::to_string(stacks[s].second)
                                                    << " B=" << B << " N=" << N);
            auto sc = cpu.make_state(B);
            auto sd = dev.make_state(B);
            typename titans::Model<T>::Trace tc;
            typename titans::Model<T, SimulatedDevice>::Trace td;
            Matrix<T> oc, od;
            const std::vector<int> ids = random_ids(rng, B * N, vocab);
            const Matrix<T> x = random_matrix(B * N, 8, rng).cast<T>();
            long up0 = traffic.uploads, down0 = traffic.downloads;  // the CPU's calls count none
            if (tokens) {
                cpu.forward_tokens(sc, ids, oc, tc);
                dev.forward_tokens(sd, ids, od, td);
            } else {
                cpu.forward(sc, x, oc, tc);
                dev.forward(sd, x, od, td);
            }
            CHECK(traffic.uploads - up0 == 1);
            CHECK(traffic.downloads - down0 == 1);
            CHECK(identical(oc, od));
            const Matrix<T> dout = random_matrix(B * N, vocab, rng).cast<T>();
            auto gc = titans::ModelParams<T>::zeros(mc.cfg), gd = gc;
            Matrix<T> dxc, dxd;
            cpu.backward(tc, dout, gc, &dxc);
            up0 = traffic.uploads;
            down0 = traffic.downloads;
            dev.backward(td, dout, gd, &dxd);
            CHECK(traffic.uploads - up0 == 1);
            CHECK(traffic.downloads - down0 == 2);
            CHECK(identical(dxc, dxd));
            CHECK(same_param_bits(cast_model<double>(gc), cast_model<double>(gd), mc.cfg));
            if (!tokens) continue;
            // The loss on the device: ids and labels up, the loss (one scalar) down; its
            // backward as backward's with dL/dlogits already there.
            std::vector<int> labels = random_ids(rng, B * N, vocab);
            labels[0] = -1;  // not scored
            auto s2 = dev.make_state(B);
            typename titans::Model<T, SimulatedDevice>::Trace t2;
            Matrix<T> dlogits;
            const double want = titans::cross_entropy_loss<T>(oc, labels, dlogits);
            up0 = traffic.uploads;
            down0 = traffic.downloads;
            const double loss = dev.forward_loss(s2, ids, labels, t2);
            CHECK(traffic.uploads - up0 == 2);
            CHECK(traffic.downloads - down0 == 1);
            CHECK(loss == want);
            auto g2 = titans::ModelParams<T>::zeros(mc.cfg), g3 = g2;
            cpu.backward(tc, dlogits, g2);
            up0 = traffic.uploads;
            down0 = traffic.downloads;
            dev.backward_loss(t2, g3);
            CHECK(traffic.uploads - up0 == 0);
            CHECK(traffic.downloads - down0 == 1);
            CHECK(same_param_bits(cast_model<double>(g2), cast_model<double>(g3), mc.cfg));
            CHECK_THROWS_AS(dev.backward_loss(td, g3), titans::ConfigError);  // no loss there
            // Into a gradient buffer on the device: nothing comes down until asked for.
            titans::ModelGradients<T, SimulatedDevice> buf(dev);
            up0 = traffic.uploads;
            down0 = traffic.downloads;
            dev.backward_loss(t2, buf);
            CHECK(traffic.uploads - up0 == 0);
            CHECK(traffic.downloads - down0 == 0);
            const double norm = buf.norm();
            CHECK(norm == titans::gradient_norm(g2, mc.cfg));
            CHECK(traffic.downloads - down0 == 1);
            CHECK(same_param_bits(cast_model<double>(g2), cast_model<double>(buf.to_params()),
                                  mc.cfg));
            CHECK(traffic.downloads - down0 == 2);
            const double clipped = titans::clip_gradient_norm(g2, mc.cfg, norm / 3);
            CHECK(buf.clip(norm / 3) == clipped);
            CHECK(same_param_bits(cast_model<double>(g2), cast_model<double>(buf.to_params()),
                                  mc.cfg));
        }
    }
}

// Model training in chained pieces on the simulated device (token ids, batch 1-3, every kind
// in two-block stacks, MAC cut inside segments, one stack cut anywhere): the logits, dx and every gradient equal the
// CPU's bit for bit.
TEMPLATE_TEST_CASE("backend: model pieces", "[backend][train]", float, double) {
    using T = TestType;
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAC, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::LMM},
                                                      {BlockKind::SWA, BlockKind::MAC}};
    for (std::size_t s = 0; s < std::size(stacks); ++s) {
        Rng rng(seed_for(std::string("backends/model pieces/") + type_name<T>(), s));
        const int vocab = 9, B = uniform_int(rng, 1, 3), N = uniform_int(rng, 6, 12);
        const ModelCase mc = make_model_case<T>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
        const auto params = cast_model<T>(mc.params);
        const std::vector<int> ids = random_ids(rng, B * N, vocab);
        const titans::Matrixd dout = random_matrix(B * N, vocab, rng);
        // The memory trains from mid-chunk here as on the CPU: one stack cut anywhere.
        const std::vector<Eigen::Index> cuts =
            s == 1 ? any_cuts(N, rng) : chunk_cuts(mc.cfg.blocks, N, rng);
        INFO(titans::to_string(stacks[s].first) << " + " << titans::to_string(stacks[s].second)
                                                << " B=" << B << " pieces " << cuts.size() - 1);
        const ModelPieces c = model_pieces(titans::Model<T>(mc.cfg, params), B, ids, dout, cuts);
        const ModelPieces d =
            model_pieces(titans::Model<T, SimulatedDevice>(mc.cfg, params), B, ids, dout, cuts);
        CHECK(identical(c.out, d.out));
        CHECK(identical(c.dx, d.dx));
        CHECK(same_param_bits(c.g, d.g, mc.cfg));
    }
}

// The Trainer on the simulated device (its gradients in one buffer there, clipped there, AdamW
// stepping its parameter buffer there, the stepped parameters down once) equals the CPU's
// trainer bit for bit: losses, gradient norms, parameters and optimiser after three steps,
// every kind in two-block stacks (MAC cut inside segments by the sequence length), clipping on
// and off.
TEMPLATE_TEST_CASE("backend: trainer steps", "[backend][train]", float, double) {
    using T = TestType;
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAC, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::SWA},
                                                      {BlockKind::LMM, BlockKind::MAC}};
    for (std::size_t s = 0; s < std::size(stacks); ++s) {
        Rng rng(seed_for(std::string("backends/trainer steps/") + type_name<T>(), s));
        const int vocab = 9, B = uniform_int(rng, 1, 3), N = uniform_int(rng, 3, 10);
        const ModelCase mc = make_model_case<T>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
        const titans::TrainerConfig tcfg{.schedule = {.peak = 1e-2, .warmup = 1, .total = 10},
                                         .clip_norm = s == 1 ? 0.0 : 0.5};
        titans::Trainer<T> cpu(mc.cfg, cast_model<T>(mc.params), tcfg);
        titans::Trainer<T, SimulatedDevice> dev(mc.cfg, cast_model<T>(mc.params), tcfg);
        INFO(titans::to_string(stacks[s].first) << " + " << titans::to_string(stacks[s].second)
                                                << " B=" << B << " N=" << N);
        for (int step = 0; step < 3; ++step) {
            const std::vector<int> ids = random_ids(rng, B * N, vocab);
            std::vector<int> labels = random_ids(rng, B * N, vocab);
            labels[static_cast<std::size_t>(step)] = -1;
            // What the forward, the loss, the backward and the clipping download (a probe
            // model), then the step's.
            auto& traffic = sim::Traffic::instance();
            const titans::Model<T, SimulatedDevice> probe(mc.cfg, dev.params());
            titans::ModelGradients<T, SimulatedDevice> pg(probe);
            long down0 = traffic.downloads;
            auto ps = probe.make_state(B);
            typename titans::Model<T, SimulatedDevice>::Trace pt;
            (void)probe.forward_loss(ps, ids, labels, pt);
            probe.backward_loss(pt, pg);
            (void)pg.norm();
            const long gradients = traffic.downloads - down0;
            const double lc = cpu.step(ids, labels, B);
            down0 = traffic.downloads;
            const long up0 = traffic.uploads;
            CHECK(dev.step(ids, labels, B) == lc);
            // The step leaves the loss, the norm and AdamW's verdict on the device and brings
            // the three back at once: the probe's two scalars become one download. The
            // gradients stay on the device (MAC's training pass too), AdamW steps there
            // (ModelAdamW) and the model takes the new values there (MAC's P W_K, P W_V
            // too): the ids and labels up, one download, whatever the blocks.
            CHECK(gradients == 2);  // the probe's loss and norm
            CHECK(traffic.downloads - down0 == 1);
            CHECK(traffic.uploads - up0 == 2);
            CHECK(cpu.last_gradient_norm() == dev.last_gradient_norm());
        }
        CHECK(same_param_bits(cast_model<double>(cpu.params()), cast_model<double>(dev.params()),
                              mc.cfg));
        CHECK(same_optimizer(cpu.optimizer(), dev.optimizer()));
    }
}

// Model::set_parameters(flat): values in a device buffer taken there (no transfer) by a model
// that alone holds its parameters, with the outputs and the training of a model built from
// them, bit for bit; params() brings them back once (one download); a copy made before keeps
// its values; a wrong shape or a NaN is refused naming the tensor, nothing changing. Every
// block kind takes them without a transfer (MAC's P W_K and P W_V made on the device by the
// glue); shared parameters are taken on the host, the same bits.
TEMPLATE_TEST_CASE("backend: flat parameters", "[backend][train]", float, double) {
    using T = TestType;
    using DevModel = titans::Model<T, SimulatedDevice>;
    using Tr = titans::backend::Transfer<SimulatedDevice, T>;
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAG, BlockKind::SWA},
                                                      {BlockKind::MAL, BlockKind::LMM},
                                                      {BlockKind::MAC, BlockKind::MAG}};
    auto& traffic = sim::Traffic::instance();
    for (std::size_t s = 0; s < std::size(stacks); ++s) {
        Rng rng(seed_for(std::string("backends/parameters on device/") + type_name<T>(), s));
        const int vocab = 11, B = uniform_int(rng, 1, 3), N = uniform_int(rng, 3, 9);
        const ModelCase a = make_model_case<T>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
        const auto pa = cast_model<T>(a.params);
        const auto pb = cast_model<T>(
            titans::ModelParams<double>::random(a.cfg, static_cast<unsigned>(uniform_int(rng, 1, 1 << 30))));
        INFO(titans::to_string(stacks[s].first) << " + " << titans::to_string(stacks[s].second));
        DevModel dev(a.cfg, pa);
        const DevModel built(a.cfg, pb);  // what dev must compute after taking pb
        Matrix<T> flat(1, dev.parameter_count());
        titans::detail::flatten_tensors(pb, a.cfg, flat.data());
        const auto on_dev = Tr::upload(titans::view_of(std::as_const(flat)));
        const titans::View<const T> fv = Tr::view(on_dev);
        // Refused, nothing changing: a wrong width, a NaN (named).
        CHECK_THROWS_AS(dev.set_parameters(titans::View<const T>{fv.data, 1, fv.cols - 1, fv.cols - 1}),
                        titans::ShapeError);
        Matrix<T> bad = flat;
        bad(0, bad.cols() - 1) = std::numeric_limits<T>::quiet_NaN();
        const auto bad_dev = Tr::upload(titans::view_of(std::as_const(bad)));
        CHECK_THROWS_WITH(dev.set_parameters(Tr::view(bad_dev)), Catch::Contains("'head'"));
        const DevModel before = dev;  // shares dev's parameters: dev now takes them on the host
        CHECK(same_param_bits(dev.params(), pa, a.cfg));
        {
            DevModel shared = before;
            shared.set_parameters(fv);
            CHECK(same_param_bits(shared.params(), pb, a.cfg));
        }
        CHECK(same_param_bits(before.params(), pa, a.cfg));
        DevModel own(a.cfg, pa);
        const long up0 = traffic.uploads, down0 = traffic.downloads;
        own.set_parameters(fv, DevModel::ValueCheck::known_finite);
        CHECK(traffic.uploads - up0 == 0);
        CHECK(traffic.downloads - down0 == 0);
        const std::vector<int> ids = random_ids(rng, B * N, vocab);
        std::vector<int> labels = random_ids(rng, B * N, vocab);
        auto so = own.make_state(B), sb = built.make_state(B);
        CHECK(identical(own.forward_tokens(so, ids), built.forward_tokens(sb, ids)));
        CHECK(same_states(so, sb));
        CHECK(same_training(own, built, B, ids, labels));
        // The host tensors come back once, on first read.
        const long down1 = traffic.downloads;
        CHECK(same_param_bits(own.params(), pb, a.cfg));
        CHECK(same_param_bits(own.blocks()[0].params(), pb.blocks[0], a.cfg.blocks[0]));
        CHECK(traffic.downloads - down1 == 1);
    }
}

// ModelGradients: its tensors are named and shaped as ModelParams::tensors, one buffer after
// the other; a buffer laid out for another model is refused by backward and backward_loss, a
// bad clipping bound by clip, nothing changing.
TEST_CASE("backend: model gradients", "[backend][train]") {
    Rng rng(seed_for("backends/model gradients", 0));
    const ModelCase mc = make_model_case<double>(BlockKind::MAG, BlockKind::LMM, 8, 7, 0, rng);
    const titans::Model<double, SimulatedDevice> dev(mc.cfg, mc.params);
    titans::ModelGradients<double, SimulatedDevice> g(dev);
    std::vector<std::string> names;
    Eigen::Index total = 0;
    const double* next = g.view().data;
    std::as_const(g).tensors([&](const std::string& name, titans::View<const double> v) {
        names.push_back(name);
        CHECK(v.data == next);
        next += v.rows * v.cols;
        total += v.rows * v.cols;
    });
    std::vector<std::string> want;
    const auto slots = titans::detail::tensor_slots(mc.params, mc.cfg);
    for (std::size_t i = 0; i < slots.size(); ++i) want.push_back(slots[i].name);
    CHECK(names == want);
    CHECK(total == g.size());
    CHECK(total == titans::detail::flat_size(mc.params, mc.cfg));
    CHECK(g.norm() == 0.0);
    // Another model's layout.
    const ModelCase other = make_model_case<double>(BlockKind::LMM, BlockKind::LMM, 8, 7, 0, rng);
    const titans::Model<double, SimulatedDevice> dev2(other.cfg, other.params);
    titans::ModelGradients<double, SimulatedDevice> g2(dev2);
    auto state = dev.make_state(1);
    typename titans::Model<double, SimulatedDevice>::Trace trace;
    const std::vector<int> ids = random_ids(rng, 5, 7);
    (void)dev.forward_loss(state, ids, ids, trace);
    CHECK_THROWS_AS(dev.backward_loss(trace, g2), titans::ShapeError);
    CHECK(g2.norm() == 0.0);
    const titans::Matrixd dout = random_matrix(5, 7, rng);
    CHECK_THROWS_AS(dev.backward(trace, dout, g2), titans::ShapeError);
    dev.backward_loss(trace, g);
    const double norm = g.norm();
    CHECK(norm > 0.0);
    CHECK_THROWS_AS(g.clip(0.0), titans::ConfigError);
    CHECK_THROWS_AS(g.clip(std::numeric_limits<double>::infinity()), titans::ConfigError);
    CHECK(g.norm() == norm);
    CHECK(g.clip(2 * norm) == norm);  // below the bound: unchanged
    CHECK(g.norm() == norm);
    g.zero();
    CHECK(g.norm() == 0.0);
    // A NaN followed by finite entries sticks: the norm is NaN and clipping refuses.
    g.view().data[1] = std::numeric_limits<double>::quiet_NaN();
    CHECK(std::isnan(g.norm()));
    CHECK_THROWS_AS(g.clip(1.0), titans::NonFiniteError);
}

namespace {

/// Random host gradients for `shapes`' tensors, of magnitude `scale`.
template <class T>
ModelParams<T> random_model_grads(const titans::ModelConfig& cfg, Rng& rng, double scale) {
    ModelParams<T> g = ModelParams<T>::zeros(cfg);
    ModelParams<T>::tensors(g, cfg, [&](const std::string&, auto& m) {
        m = (random_matrix(m.rows(), m.cols(), rng) * scale).template cast<T>();
    });
    return g;
}

/// ModelAdamW<T, B> against the host AdamW<T> over `steps` steps from `opt` (fresh or resumed):
/// the proposed and committed parameters and the moments bit for bit, every gradient in one
/// buffer of B's memory.
template <class T, class B>
void model_adamw_matches(const ModelCase& mc, AdamW<T> opt, int steps, Rng& rng) {
    ModelParams<T> p = cast_model<T>(mc.params);
    titans::ModelAdamW<T, B> dev(mc.cfg, p, opt);
    titans::ModelGradients<T, B> gb(mc.cfg, p);
    const titans::WarmupCosine lr{.peak = 0.05, .warmup = 1, .total = 5};
    for (int t = 1; t <= steps; ++t) {
        INFO("step " << t);
        const ModelParams<T> g = random_model_grads<T>(mc.cfg, rng, t == 2 ? 1e-6 : 1.0);
        gb.zero();
        titans::backend::add_flat<B>(g, mc.cfg, gb.view());
        const std::int64_t before = dev.steps();
        opt.step(p, g, mc.cfg, lr(opt.steps() + 1));
        dev.propose(std::as_const(gb).view(), lr(before + 1));
        CHECK(dev.steps() == before);  // nothing taken yet
        CHECK(same_param_bits(dev.proposed_params(mc.cfg), p, mc.cfg));
        dev.commit();
        CHECK(dev.steps() == opt.steps());
        REQUIRE(same_param_bits(dev.params_to_host(mc.cfg), p, mc.cfg));
        REQUIRE(same_optimizer(dev.to_host(), opt));
    }
}

}  // namespace

// ModelAdamW (AdamW on the parameter buffer, in the backend's memory) equals the host AdamW bit
// for bit on the CPU and on the simulated device: fresh and resumed, decaying vectors or not,
// tiny and large gradients; refusals (a bad rate, a gradient buffer of another size, a step
// whose second moment overflows float, a commit with nothing proposed) change nothing.
TEMPLATE_TEST_CASE("backend: model adamw", "[backend][train]", float, double) {
    using T = TestType;
    for (std::uint64_t s = 0; s < 3; ++s) {
        Rng rng(seed_for(std::string("backends/model adamw/") + type_name<T>(), s));
        const BlockKind kinds[] = {BlockKind::MAG, BlockKind::MAC, BlockKind::LMM};
        const ModelCase mc = make_model_case<T>(kinds[s], BlockKind::SWA, 8, 7, 0, rng);
        const titans::AdamWConfig oc{.beta1 = 0.8, .beta2 = 0.95, .eps = 1e-7,
                                     .weight_decay = 0.2, .decay_vectors = s == 1};
        AdamW<T> resumed(oc);  // two steps taken on the host first
        ModelParams<T> p0 = cast_model<T>(mc.params);
        for (int t = 1; t <= 2; ++t) resumed.step(p0, random_model_grads<T>(mc.cfg, rng, 0.5), mc.cfg, 0.01);
        INFO("case " << s);
        model_adamw_matches<T, titans::backend::Cpu>(mc, AdamW<T>(oc), 3, rng);
        model_adamw_matches<T, SimulatedDevice>(mc, AdamW<T>(oc), 3, rng);
        model_adamw_matches<T, SimulatedDevice>(mc, resumed, 2, rng);
    }
    // Refusals, nothing changed.
    Rng rng(seed_for(std::string("backends/model adamw refusals/") + type_name<T>(), 0));
    const ModelCase mc = make_model_case<T>(BlockKind::MAL, BlockKind::MAG, 8, 7, 0, rng);
    const ModelParams<T> p = cast_model<T>(mc.params);
    titans::ModelAdamW<T, SimulatedDevice> opt(mc.cfg, p, AdamW<T>());
    titans::ModelGradients<T, SimulatedDevice> g(mc.cfg, p);
    titans::backend::add_flat<SimulatedDevice>(random_model_grads<T>(mc.cfg, rng, 1.0), mc.cfg,
                                               g.view());
    const auto cg = std::as_const(g).view();
    CHECK_THROWS_AS(opt.commit(), titans::ConfigError);
    CHECK_THROWS_AS(opt.propose(cg, -1.0), titans::ConfigError);
    CHECK_THROWS_AS(opt.propose(cg, std::numeric_limits<double>::quiet_NaN()), titans::ConfigError);
    CHECK_THROWS_AS(opt.propose(titans::detail::flat_range(cg, 0, g.size() - 1), 0.1),
                    titans::ShapeError);
    if constexpr (std::is_same_v<T, float>) {
        // g² beyond the largest float in one entry of the head: the second moment overflows.
        titans::ModelGradients<T, SimulatedDevice> big(mc.cfg, p);
        ModelParams<T> hg = ModelParams<T>::zeros(mc.cfg);
        hg.head(0, 0) = 1e30f;
        titans::backend::add_flat<SimulatedDevice>(hg, mc.cfg, big.view());
        try {
            opt.propose(std::as_const(big).view(), 0.1);
            FAIL("the overflowing step was taken");
        } catch (const titans::NonFiniteError& e) {
            CHECK_THAT(e.what(), Catch::Matchers::Contains("second moment") &&
                                     Catch::Matchers::Contains("'head'"));
        }
        CHECK_THROWS_AS(opt.commit(), titans::ConfigError);  // a refused proposal is not taken
    }
    CHECK(opt.steps() == 0);
    CHECK(same_param_bits(opt.params_to_host(mc.cfg), p, mc.cfg));
    CHECK(opt.to_host().moments().empty());
    opt.propose(cg, 0.1);
    opt.commit();
    CHECK(opt.steps() == 1);
    CHECK(opt.to_host().moments().size() == titans::detail::tensor_slots(p, mc.cfg).size());
}

namespace {

/// The step's scalars left on backend B (BackendScalars): forward_loss's loss, clip's norm and
/// AdamW's verdict, each in its slot, the same bits as the calls that bring them back at once;
/// on the simulated device none comes back before read(). Bad slots and bounds are refused,
/// nothing changing; a non-finite norm names its cause; settle() takes only a verdict of 1.
template <class T, class B>
void step_scalars_case(const ModelCase& mc, Rng& rng) {
    using titans::backend::scalar_slots;
    auto& traffic = sim::Traffic::instance();
    const titans::Model<T, B> model(mc.cfg, cast_model<T>(mc.params));
    const int batch = 2, n = 5;
    const std::vector<int> ids = random_ids(rng, batch * n, mc.cfg.vocab_size);
    std::vector<int> labels = random_ids(rng, batch * n, mc.cfg.vocab_size);
    labels[1] = -1;
    titans::BackendScalars<T, B> s;
    auto state = model.make_state(batch);
    typename titans::Model<T, B>::Trace t1, t2;
    CHECK_THROWS_AS(model.forward_loss(state, ids, labels, t1, s, scalar_slots),
                    titans::ConfigError);
    CHECK(state.position == 0);
    const long down0 = traffic.downloads;
    model.forward_loss(state, ids, labels, t1, s, 2);
    CHECK(traffic.downloads == down0);  // nothing back yet
    auto fresh = model.make_state(batch);
    const double loss = model.forward_loss(fresh, ids, labels, t2);
    const titans::backend::ScalarValues got = s.read();
    CHECK(got[2] == loss);
    CHECK((got[0] == 0.0 && got[1] == 0.0 && got[3] == 0.0));
    CHECK(state.position == n);
    // The norm alone, then clipping: the same bits as clip(), and the norm before it.
    titans::ModelGradients<T, B> g(model), h(model);
    model.backward_loss(t1, g);
    model.backward_loss(t2, h);
    const double norm = h.norm();
    g.clip(0.0, s, 1);
    CHECK(s.read()[1] == norm);
    CHECK(same_param_bits(g.to_params(), h.to_params(), mc.cfg));  // nothing scaled
    CHECK_THROWS_AS(g.clip(-1.0, s, 1), titans::ConfigError);
    CHECK_THROWS_AS(g.clip(std::numeric_limits<double>::infinity(), s, 1), titans::ConfigError);
    CHECK_THROWS_AS(g.clip(1.0, s, scalar_slots), titans::ConfigError);
    g.clip(0.5 * norm, s, 0);
    CHECK(h.clip(0.5 * norm) == norm);
    CHECK(s.read()[0] == norm);
    CHECK(same_param_bits(g.to_params(), h.to_params(), mc.cfg));
    // AdamW's verdict in a slot, then settle.
    titans::ModelAdamW<T, B> a(mc.cfg, cast_model<T>(mc.params), AdamW<T>());
    titans::ModelAdamW<T, B> b(mc.cfg, cast_model<T>(mc.params), AdamW<T>());
    CHECK_THROWS_AS(a.settle(1.0), titans::ConfigError);  // nothing proposed
    a.propose(std::as_const(g).view(), 0.01, s, 3);
    CHECK(s.read()[3] == 1.0);
    CHECK_THROWS_AS(a.commit(), titans::ConfigError);  // not settled yet
    a.settle(s.read()[3]);
    CHECK_THROWS_AS(a.settle(1.0), titans::ConfigError);  // once
    a.commit();
    b.propose(std::as_const(h).view(), 0.01);
    b.commit();
    CHECK(same_param_bits(a.params_to_host(mc.cfg), b.params_to_host(mc.cfg), mc.cfg));
    // A NaN gradient: the verdict is 0, the norm NaN, and each refusal says so.
    g.view().data[3] = std::numeric_limits<T>::quiet_NaN();
    g.clip(1.0, s, 1);
    a.propose(std::as_const(g).view(), 0.01, s, 2);
    const titans::backend::ScalarValues bad = s.read();
    CHECK(std::isnan(bad[1]));
    CHECK(bad[2] == 0.0);
    CHECK_THROWS_WITH(g.require_finite_norm(bad[1], "here"),
                      Catch::Matchers::Contains("here: the gradients have a NaN or infinite"));
    CHECK_THROWS_AS(a.settle(bad[2]), titans::NonFiniteError);
    CHECK_THROWS_AS(a.commit(), titans::ConfigError);
    CHECK(a.steps() == 1);
    if constexpr (std::is_same_v<T, double>) {  // finite entries whose norm overflows a double
        titans::ModelGradients<T, B> huge(model);
        titans::backend::ScalarValues v{};
        ModelParams<T> hg = ModelParams<T>::zeros(mc.cfg);
        hg.head.setConstant(1e308);
        titans::backend::add_flat<B>(hg, mc.cfg, huge.view());
        huge.clip(1.0, s, 0);
        v = s.read();
        CHECK(v[0] == std::numeric_limits<double>::infinity());
        CHECK_THROWS_WITH(huge.require_finite_norm(v[0], "there"),
                          Catch::Matchers::Contains("there: the norm of the gradients exceeds"));
        CHECK_THROWS_AS(huge.clip(1.0), titans::NonFiniteError);
        CHECK(huge.to_params().head(0, 0) == 1e308);  // nothing scaled
    }
}

}  // namespace

TEMPLATE_TEST_CASE("backend: step scalars", "[backend][train]", float, double) {
    Rng rng(seed_for(std::string("backends/step scalars/") + type_name<TestType>(), 0));
    const ModelCase mc = make_model_case<TestType>(BlockKind::MAG, BlockKind::LMM, 8, 7, 0, rng);
    step_scalars_case<TestType, titans::backend::Cpu>(mc, rng);
    step_scalars_case<TestType, SimulatedDevice>(mc, rng);
}
