#pragma once
// tests/segment_backward_case.hpp: random cases of MAC's segment attention backward
// (Attention::segment_backward, attention/segment_backward.hpp) and a run on any backend
// (inputs uploaded, outputs brought back as double), shared by the simulated device's test
// and the CUDA parity test against the CPU.
#include "block_cases.hpp"

#include <utility>

namespace titans_test {

/// One part of a segment: the configuration, parameters, batch B, segment C, offset o, rows m,
/// position, the inputs (u, h, dy: (B*m) x d; kept rows (B*2o) x D; P N_p x d), the later
/// rows' adjoint (B*2(o+m)) x D (0 rows: none) and what the gradients start from (added to).
struct SegmentBackwardCase {
    titans::AttentionConfig cfg;
    titans::AttentionParams<double> p;
    int B = 1, C = 1, o = 0, m = 1;
    std::int64_t pos = 0;
    Matrixd u, h, dy, kept_k, kept_v, P, after_k, after_v, g0, dP0;
};

/// Case i, every entry rounded through float (a float run and its double reference see the
/// same numbers): heads 1-3, head widths 1-6 (even with RoPE), C 1-7, every offset, N_p 0-3,
/// batches 1-3, the later adjoint in three cases of four, constant or periodic rows in some.
/// long_parts: C 24-48, offsets 0-6, each part running to the segment's end (18 rows or more).
inline SegmentBackwardCase segment_backward_case(Rng& rng, int i, bool long_parts = false) {
    const auto r = [](const Matrixd& m) { return round_through<float>(m); };
    SegmentBackwardCase c;
    c.cfg.n_heads = uniform_int(rng, 1, 3);
    c.cfg.rope = i % 2 == 0;
    c.cfg.d_head = c.cfg.rope ? 2 * uniform_int(rng, 1, 3) : uniform_int(rng, 1, 6);
    c.cfg.d_model = uniform_int(rng, 2, 9);
    c.cfg.window = 4;
    c.cfg.rope_base = uniform(rng, 2.0, 100.0);
    c.cfg.validate();
    const auto p = titans::AttentionParams<double>::random(c.cfg, rng());
    c.p.w_q = r(p.w_q);
    c.p.w_k = r(p.w_k);
    c.p.w_v = r(p.w_v);
    c.p.w_o = r(p.w_o);
    c.B = uniform_int(rng, 1, 3);
    c.C = long_parts ? uniform_int(rng, 24, 48) : uniform_int(rng, 1, 7);
    c.o = uniform_int(rng, 0, long_parts ? 6 : c.C - 1);
    c.m = long_parts ? c.C - c.o : uniform_int(rng, 1, c.C - c.o);
    c.pos = static_cast<std::int64_t>(c.C) * uniform_int(rng, 0, 9) + c.o;
    const long long d = c.cfg.d_model, D = c.cfg.inner_dim(), n = 2LL * (c.o + c.m);
    const int np = i % 3 == 0 ? 0 : uniform_int(rng, 1, 3);
    c.u = r(stream_kind(random_matrix(c.B * c.m, d, rng, -2.0, 2.0), c.B, i % 5 == 3 ? 0 : i));
    c.h = r(random_matrix(c.B * c.m, d, rng));
    c.dy = r(random_matrix(c.B * c.m, d, rng));
    c.kept_k = r(random_matrix(c.B * 2 * c.o, D, rng));
    c.kept_v = r(random_matrix(c.B * 2 * c.o, D, rng));
    c.P = r(random_matrix(np, d, rng));
    const bool later = i % 4 != 1;
    c.after_k = later ? r(random_matrix(c.B * n, D, rng)) : Matrixd(0, D);
    c.after_v = later ? r(random_matrix(c.B * n, D, rng)) : Matrixd(0, D);
    c.g0 = r(random_matrix(1, 4 * d * D, rng));
    c.dP0 = r(random_matrix(np, d, rng));
    return c;
}

/// What segment_backward gives, as double: du, dh, the kept rows' adjoint, the attention's
/// flat gradient and P's (both from g0, dP0).
struct SegmentBackwardResult {
    Matrixd du, dh, dkept_k, dkept_v, grads, dP;
};

/// m in T on backend Bk.
template <class T, class Bk>
typename titans::backend::Transfer<Bk, T>::Buffer upload_as(const Matrixd& m) {
    const titans::Matrix<T> t = m.cast<T>();
    return titans::backend::Transfer<Bk, T>::upload(titans::view_of(t));
}

/// A buffer of backend Bk brought back as double.
template <class T, class Bk>
Matrixd download_as(const typename titans::backend::Transfer<Bk, T>::Buffer& b) {
    using Transfer = titans::backend::Transfer<Bk, T>;
    const titans::View<const T> v = Transfer::view(b);
    titans::Matrix<T> t(v.rows, v.cols);
    Transfer::download(v, titans::view_of(t));
    return Matrixd(t.template cast<double>());
}

/// What MAC's segment attention forward (Attention::segment) gives for case c's part: y and
/// the segment buffers after the part's keys and values went in, as double.
struct SegmentForwardResult {
    Matrixd y, seg_k, seg_v;
};

/// Case c's part forward on backend Bk in precision T: u, h, the prefix P W_K, P W_V (host
/// products in T), each sequence's segment buffers (2C rows) holding the kept rows first.
template <class T, class Bk>
SegmentForwardResult run_segment_forward(const SegmentBackwardCase& c) {
    using Transfer = titans::backend::Transfer<Bk, T>;
    const titans::Attention<T, Bk> attn(c.cfg, cast_attention<T>(c.p));
    const long long d = c.cfg.d_model, D = c.cfg.inner_dim(), C2 = 2LL * c.C;
    Matrixd sk = Matrixd::Zero(c.B * C2, D), sv = Matrixd::Zero(c.B * C2, D);
    for (int b = 0; b < c.B; ++b) {
        sk.middleRows(b * C2, 2 * c.o) = c.kept_k.middleRows(2LL * b * c.o, 2 * c.o);
        sv.middleRows(b * C2, 2 * c.o) = c.kept_v.middleRows(2LL * b * c.o, 2 * c.o);
    }
    const Matrixd kp = round_through<T>(c.P * c.p.w_k), vp = round_through<T>(c.P * c.p.w_v);
    const auto u = upload_as<T, Bk>(c.u), h = upload_as<T, Bk>(c.h), kpb = upload_as<T, Bk>(kp),
               vpb = upload_as<T, Bk>(vp);
    auto segk = upload_as<T, Bk>(sk), segv = upload_as<T, Bk>(sv);
    auto y = Transfer::allocate(static_cast<long long>(c.B) * c.m, d);
    attn.segment(titans::SegmentCall<T>{
        Transfer::view(u), Transfer::view(h), Transfer::view(segk), Transfer::view(segv),
        titans::PrefixView<T>{Transfer::view(kpb), Transfer::view(vpb)}, Transfer::view(y), c.B,
        c.C, c.o, c.m, c.pos});
    return {download_as<T, Bk>(y), download_as<T, Bk>(segk), download_as<T, Bk>(segv)};
}

/// Case c on backend Bk in precision T: the inputs and P W_K, P W_V (host products in T)
/// uploaded, the outputs downloaded.
template <class T, class Bk>
SegmentBackwardResult run_segment_backward(const SegmentBackwardCase& c) {
    using Transfer = titans::backend::Transfer<Bk, T>;
    using Buffer = typename Transfer::Buffer;
    using titans::Matrix;
    const auto up = [](const Matrixd& m) { return upload_as<T, Bk>(m); };
    const auto down = [](const Buffer& b) { return download_as<T, Bk>(b); };
    const titans::Attention<T, Bk> attn(c.cfg, cast_attention<T>(c.p));
    const Matrix<T> Pt = c.P.cast<T>();
    const Matrix<T> kp = Pt * c.p.w_k.cast<T>(), vp = Pt * c.p.w_v.cast<T>();
    const Buffer u = up(c.u), h = up(c.h), dy = up(c.dy), kk = up(c.kept_k), kv = up(c.kept_v),
                 ak = up(c.after_k), av = up(c.after_v), P = up(c.P),
                 kpb = Transfer::upload(titans::view_of(kp)),
                 vpb = Transfer::upload(titans::view_of(vp));
    const long long d = c.cfg.d_model, D = c.cfg.inner_dim(), rows = c.B * c.m;
    Buffer du = Transfer::allocate(rows, d), dh = Transfer::allocate(rows, d),
           dkk = Transfer::allocate(c.B * 2 * c.o, D), dkv = Transfer::allocate(c.B * 2 * c.o, D),
           g = up(c.g0), dP = up(c.dP0);
    const auto cv = [](const Buffer& b) { return Transfer::view(b); };
    attn.segment_backward(titans::SegmentBackwardCall<T>{
        cv(u), cv(h), cv(dy), cv(kk), cv(kv), cv(ak), cv(av),
        titans::PrefixView<T>{cv(kpb), cv(vpb)}, cv(P), Transfer::view(du), Transfer::view(dh),
        Transfer::view(dkk), Transfer::view(dkv), Transfer::view(g), Transfer::view(dP), c.B,
        c.C, c.o, c.m, c.pos});
    return {down(du), down(dh), down(dkk), down(dkv), down(g), down(dP)};
}

/// The largest rel_error of a's outputs against b's (each relative to its own largest entry,
/// at least floor).
inline double segment_backward_error(const SegmentBackwardResult& a,
                                     const SegmentBackwardResult& b, double floor) {
    return std::max({rel_error(a.du, b.du, floor), rel_error(a.dh, b.dh, floor),
                     rel_error(a.dkept_k, b.dkept_k, floor), rel_error(a.dkept_v, b.dkept_v, floor),
                     rel_error(a.grads, b.grads, floor), rel_error(a.dP, b.dP, floor)});
}

}  // namespace titans_test
