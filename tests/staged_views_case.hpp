#pragma once
// tests/staged_views_case.hpp: the memory's staged training API on views
// (NeuralMemory::forward_part, read_snapshot_backward and Reverse on views in the backend's
// memory) against the same API on host matrices, on any backend: a trace filled in two parts,
// a read of the memory between them through its snapshot, the backward in two stages with the
// read's adjoint tapped between (MAC's pattern, math §9). Shared by the simulated device's
// test (the CPU's bits) and the CUDA parity test.
#include "test_common.hpp"

#include <titans/detail/tensor_slots.hpp>

#include <utility>
#include <vector>

namespace titans_test {

/// A case: config, parameters, B streams of N tokens split at t1 (0 < t1 < N), the input x
/// (B*N) x d sequence-major, dy = dL/dy of the memory's outputs and dh = dL/dh of the read
/// (B*(N-t1)) x d of the rows after t1 through the memory after t1 tokens.
struct StagedCase {
    titans::MemoryConfig cfg;
    titans::MemoryParams<double> p;
    int B = 1, N = 2, t1 = 1;
    Matrixd x, dy, dh;
};

/// Case i: every primary mode in turn, random flags and shapes, inputs rounded through float.
inline StagedCase staged_case(Rng& rng, int i) {
    const std::vector<Modes> modes = all_primary_modes();
    StagedCase c;
    Limits lim;
    lim.min_head_dim = 3;
    c.cfg = random_config(random_flags(modes[static_cast<std::size_t>(i) % modes.size()], rng),
                          rng, lim);
    c.p = titans::MemoryParams<double>::random(c.cfg, rng());
    titans::MemoryParams<double>::tensors(c.p, c.cfg, [](const std::string&, auto& t) {
        t = round_through<float>(Matrixd(t));
    });
    c.B = uniform_int(rng, 1, 3);
    c.N = uniform_int(rng, 2, 12);
    c.t1 = uniform_int(rng, 1, c.N - 1);
    const auto d = c.cfg.d_model;
    c.x = round_through<float>(random_matrix(c.B * c.N, d, rng));
    c.dy = round_through<float>(random_matrix(c.B * c.N, d, rng));
    c.dh = round_through<float>(random_matrix(c.B * (c.N - c.t1), d, rng));
    return c;
}

/// What the staged backward gives, as double: dx of rows [t1, N) and [0, t1) (B * rows x d),
/// the read's dx, the memory's flat gradient and the snapshot's adjoint (pair-major layers).
struct StagedResult {
    Matrixd dx_hi, dx_lo, dx_read, grads;
    std::vector<std::vector<Matrixd>> dW;
};

/// Rows [t0, t1) of every stream of x (B*N rows).
inline Matrixd stream_rows(const Matrixd& x, int B, int N, int t0, int t1) {
    Matrixd out(B * (t1 - t0), x.cols());
    for (int b = 0; b < B; ++b) out.middleRows(b * (t1 - t0), t1 - t0) = x.middleRows(b * N + t0, t1 - t0);
    return out;
}

template <class T>
std::vector<std::vector<Matrixd>> layers_to_double(const std::vector<std::vector<titans::Matrix<T>>>& w) {
    std::vector<std::vector<Matrixd>> out;
    for (const auto& pair : w) {
        out.emplace_back();
        for (const auto& l : pair) out.back().push_back(l.template cast<double>());
    }
    return out;
}

/// The memory's parameters cast to T.
template <class T>
titans::MemoryParams<T> cast_memory(const titans::MemoryConfig& cfg, const titans::MemoryParams<double>& p) {
    titans::MemoryParams<T> out = titans::MemoryParams<T>::zeros(cfg);
    titans::MemoryParams<double>::tensors(p, cfg, [&](const std::string& name, const auto& t) {
        titans::MemoryParams<T>::tensors(out, cfg, [&](const std::string& n2, auto& o) {
            if (n2 == name) o = t.template cast<T>();
        });
    });
    return out;
}

/// Case c through the host-matrix staged API on backend Bk.
template <class T, class Bk>
StagedResult staged_host(const StagedCase& c) {
    using M = titans::Matrix<T>;
    const titans::NeuralMemory<T, Bk> mem(c.cfg, cast_memory<T>(c.cfg, c.p));
    auto st = mem.make_state(c.B);
    typename titans::NeuralMemory<T, Bk>::Trace tr;
    mem.begin_trace(st, c.N, tr);
    M y1, y2;
    const M x1 = stream_rows(c.x, c.B, c.N, 0, c.t1).cast<T>(),
            x2 = stream_rows(c.x, c.B, c.N, c.t1, c.N).cast<T>();
    mem.forward_part(st, x1, y1, tr);
    const auto W = mem.current_weights(st);
    mem.forward_part(st, x2, y2, tr);
    typename titans::NeuralMemory<T, Bk>::Reverse rev(mem, tr, M(c.dy.cast<T>()));
    M hi, lo, dxr;
    rev.down_to(c.t1, hi);
    std::vector<std::vector<M>> dW;
    auto g = titans::MemoryParams<T>::zeros(c.cfg);
    mem.read_weights_backward(W, x2, c.B, M(c.dh.cast<T>()), dxr, dW, g);
    rev.tap(dW);
    rev.down_to(0, lo);
    rev.finish(g);
    M flat(1, mem.parameter_count());
    titans::detail::flatten_tensors(g, c.cfg, flat.data());
    return {hi.template cast<double>(), lo.template cast<double>(), dxr.template cast<double>(),
            flat.template cast<double>(), layers_to_double<T>(dW)};
}

/// Case c through the staged API on views in Bk's memory (inputs uploaded, outputs downloaded).
template <class T, class Bk>
StagedResult staged_views(const StagedCase& c) {
    using M = titans::Matrix<T>;
    using Tr = titans::backend::Transfer<Bk, T>;
    using Buf = typename Tr::Buffer;
    const auto up = [](const Matrixd& m) {
        const M t = m.cast<T>();
        return Tr::upload(titans::view_of(t));
    };
    const auto down = [](const Buf& b) {
        const titans::View<const T> v = Tr::view(b);
        M t(v.rows, v.cols);
        Tr::download(v, titans::view_of(t));
        return Matrixd(t.template cast<double>());
    };
    const titans::NeuralMemory<T, Bk> mem(c.cfg, cast_memory<T>(c.cfg, c.p));
    auto st = mem.make_state(c.B);
    typename titans::NeuralMemory<T, Bk>::Trace tr;
    mem.begin_trace(st, c.N, tr);
    const long long d = c.cfg.d_model, lo_rows = c.B * c.t1, hi_rows = c.B * (c.N - c.t1);
    const Buf x1 = up(stream_rows(c.x, c.B, c.N, 0, c.t1)), x2 = up(stream_rows(c.x, c.B, c.N, c.t1, c.N)),
              dy = up(c.dy), dh = up(c.dh);
    Buf y1 = Tr::allocate(lo_rows, d), y2 = Tr::allocate(hi_rows, d), h = Tr::allocate(hi_rows, d),
        hi = Tr::allocate(hi_rows, d), lo = Tr::allocate(lo_rows, d), dxr = Tr::allocate(hi_rows, d),
        g = up(Matrixd::Zero(1, mem.parameter_count()));
    mem.forward_part(st, Tr::view(x1), Tr::view(y1), tr);
    typename titans::NeuralMemory<T, Bk>::Snapshot s, dS;
    mem.snapshot(st, s);
    mem.read_snapshot(s, Tr::view(x2), c.B, Tr::view(h));
    mem.forward_part(st, Tr::view(x2), Tr::view(y2), tr);
    typename titans::NeuralMemory<T, Bk>::Reverse rev(mem, tr, Tr::view(dy));
    rev.down_to(c.t1, Tr::view(hi));
    mem.read_snapshot_backward(s, Tr::view(x2), c.B, Tr::view(dh), Tr::view(dxr), dS, Tr::view(g));
    rev.tap(dS);
    rev.down_to(0, Tr::view(lo));
    rev.finish(Tr::view(g));
    return {down(hi), down(lo), down(dxr), down(g), layers_to_double<T>(mem.snapshot_weights(dS))};
}

/// The largest rel_error of a's outputs against b's (floor 1e-6).
inline double staged_error(const StagedResult& a, const StagedResult& b) {
    double e = std::max({rel_error(a.dx_hi, b.dx_hi, 1e-6), rel_error(a.dx_lo, b.dx_lo, 1e-6),
                         rel_error(a.dx_read, b.dx_read, 1e-6), rel_error(a.grads, b.grads, 1e-6)});
    if (a.dW.size() != b.dW.size()) return 1e300;
    for (std::size_t i = 0; i < a.dW.size(); ++i) e = std::max(e, rel_error(a.dW[i], b.dW[i], 1e-6));
    return e;
}

}  // namespace titans_test
