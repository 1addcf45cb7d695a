// RMSNorm and FeedForward on the CUDA backend against the CPU (math §7, and the backward passes
// of math §9): forward, training forward and backward (dx and the parameter gradients, added
// to what the caller holds), widths across block-size boundaries, 0 rows, float and double;
// the glue kernels between layers (copy, add, gate, the first non-finite row, gather, the
// head's product, and the training glue: the gate's adjoint, fill, row blocks, the head's
// transposed products, the scatter-add) on strided device views against the CPU's.

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

/// A row of x at T's extremes: kind 0 huge (1e38 / 1e308: the sum of squares overflows), 1
/// near the largest value (1 / rms subnormal), 2 huge and tiny entries mixed, 3 tiny (1e-30 /
/// 1e-300), 4 zeros, 5 ordinary.
template <class T>
void extreme_row(int kind, Eigen::Ref<Matrix<T>> row, Rng& rng) {
    const bool f = std::is_same_v<T, float>;
    const double big = f ? 1e38 : 1e308, tiny = f ? 1e-30 : 1e-300;
    const double top = static_cast<double>(std::numeric_limits<T>::max());
    for (Eigen::Index j = 0; j < row.cols(); ++j) {
        const double u = uniform(rng);
        const double v[] = {u * big, (u < 0 ? -top : top) * uniform(rng, 0.5, 1.0),
                            u * (j % 2 == 0 ? big : tiny), u * tiny, 0.0, u};
        row(0, j) = static_cast<T>(v[kind]);
    }
}

/// RMSNorm on rows of every extreme kind: the CUDA forward, training forward and backward
/// against the CPU's (right on such rows: tests/robustness/test_training_numerics.cpp), row by
/// row; dx relative to its terms 1 / rms max |dy ⊙ w|.
template <class T>
void norm_extreme_case(int d, Rng& rng) {
    const titans::RowVector<T> w = random_matrix(1, d, rng, 0.5, 1.5).template cast<T>();
    const titans::RMSNorm<T> cpu(w);
    const titans::RMSNorm<T, Cuda> gpu(w);
    Matrix<T> x(12, d);
    for (Eigen::Index r = 0; r < x.rows(); ++r) extreme_row<T>(static_cast<int>(r % 6), x.row(r), rng);
    const Matrix<T> dy = random_t<T>(x.rows(), d, rng);
    typename titans::RMSNorm<T>::Trace tc;
    typename titans::RMSNorm<T, Cuda>::Trace tg;
    Matrix<T> yc, yg, dxc, dxg;
    cpu.forward(x, yc, tc);
    gpu.forward(x, yg, tg);
    const Matrix<T> yf = gpu.forward(x);
    titans::RowVector<T> gc = titans::RowVector<T>::Zero(d), gg = gc;
    cpu.backward(tc, dy, dxc, gc);
    gpu.backward(tg, dy, dxg, gg);
    const double floor = 2.0 * static_cast<double>(std::numeric_limits<T>::denorm_min()) / tol<T>();
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
        INFO("d " << d << " row " << r << " kind " << r % 6 << " " << type_name<T>());
        const double rms = std::hypot(x.row(r).template cast<double>().stableNorm() / std::sqrt(d),
                                      std::sqrt(1e-6));  // no overflow
        const double terms = dy.row(r).cwiseProduct(w).cwiseAbs().maxCoeff() / rms;
        CHECK(rel_error(yg.row(r), yc.row(r), floor) <= tol<T>());
        CHECK(rel_error(yf.row(r), yc.row(r), floor) <= tol<T>());
        CHECK(rel_error(dxg.row(r), dxc.row(r), std::max(terms, floor)) <= tol<T>());
    }
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

/// A rows x cols view of a device buffer whose rows are `pad` entries wider (a strided view;
/// the padding holds NaN, which no glue kernel may read).
template <class T>
struct Strided {
    typename titans::backend::Transfer<Cuda, T>::Buffer buf;
    titans::View<T> view;
    Strided(const Matrix<T>& host, Eigen::Index pad) {
        Matrix<T> wide = Matrix<T>::Constant(host.rows(), host.cols() + pad,
                                             std::numeric_limits<T>::quiet_NaN());
        wide.leftCols(host.cols()) = host;
        buf = titans::backend::Transfer<Cuda, T>::upload(titans::view_of(std::as_const(wide)));
        view = titans::backend::Transfer<Cuda, T>::view(buf);
        view.cols = host.cols();
    }
    Matrix<T> host() const {
        Matrix<T> m(view.rows, view.cols);
        titans::backend::Transfer<Cuda, T>::download(view, titans::view_of(m));
        return m;
    }
};

/// RMSNorm::forward_sum (s = a + s, y = RMSNorm(s) in one kernel) on strided views against
/// the two calls it fuses (Glue::add, then forward), bit for bit: rows of every extreme kind
/// halved into a and s (their sums the extreme rows, exactly), a sum that overflows to an
/// infinity, a the same view as s; a y that shares s's storage is refused.
template <class T>
void norm_sum_case(int d, Rng& rng) {
    using Gpu = titans::backend::GlueKernels<Cuda, T>;
    const titans::RowVector<T> w = random_matrix(1, d, rng, 0.5, 1.5).template cast<T>();
    const titans::RMSNorm<T, Cuda> gpu(w);
    Matrix<T> x(13, d);
    for (Eigen::Index r = 0; r < 12; ++r) extreme_row<T>(static_cast<int>(r % 6), x.row(r), rng);
    Matrix<T> a = x / T(2), s = x - a;
    a.row(12).setConstant(std::numeric_limits<T>::max());  // their sum overflows
    s.row(12) = a.row(12);
    INFO("d " << d << " " << type_name<T>());
    Strided<T> ga(a, 1), fused(s, 2), plain(s, 3), yf(Matrix<T>::Zero(13, d), 1),
        yp(Matrix<T>::Zero(13, d), 2);
    gpu.forward_sum(ga.view, fused.view, yf.view);
    Gpu::add(ga.view, plain.view, plain.view);
    gpu.forward(plain.view, yp.view);
    CHECK(identical_or_nan(fused.host(), plain.host()));
    CHECK(identical_or_nan(yf.host(), yp.host()));
    gpu.forward_sum(fused.view, fused.view, yf.view);  // s = s + s
    Gpu::add(plain.view, plain.view, plain.view);
    gpu.forward(plain.view, yp.view);
    CHECK(identical_or_nan(fused.host(), plain.host()));
    CHECK(identical_or_nan(yf.host(), yp.host()));
    titans::View<T> shifted = fused.view;
    shifted.data += 1;
    REQUIRE_THROWS_NAMING(gpu.forward_sum(ga.view, fused.view, shifted), titans::ShapeError,
                          "RMSNorm::forward_sum");
}

/// RMSNorm::forward_gated (MAG's o = RMSNorm_o(o) ⊙ σ(RMSNorm_m(m)) in one kernel) on strided
/// views against the three launches it fuses, bit for bit, and against the CPU's norms and
/// gate: o's and m's rows of every extreme kind (paired crosswise), m left as it was; a gate
/// norm of another width is refused.
template <class T>
void norm_gated_case(int d, Rng& rng) {
    using Gpu = titans::backend::GlueKernels<Cuda, T>;
    using Cpu = titans::backend::GlueKernels<titans::backend::Cpu, T>;
    const titans::RowVector<T> wo = random_matrix(1, d, rng, 0.5, 1.5).template cast<T>(),
                               wm = random_matrix(1, d, rng, -1.5, 1.5).template cast<T>();
    const titans::RMSNorm<T, Cuda> no(wo, 1e-6), nm(wm, 1e-5);
    Matrix<T> o(12, d), m(12, d);
    for (Eigen::Index r = 0; r < 12; ++r) {
        extreme_row<T>(static_cast<int>(r % 6), o.row(r), rng);
        extreme_row<T>(static_cast<int>((r / 2) % 6), m.row(r), rng);
    }
    INFO("d " << d << " " << type_name<T>());
    Strided<T> fo(o, 1), fm(m, 2), po(o, 3), pm(m, 1);
    no.forward_gated(nm, fo.view, fm.view);
    nm.forward(pm.view, pm.view);
    no.forward(po.view, po.view);
    Gpu::gate(po.view, pm.view, po.view);
    CHECK(identical_or_nan(fo.host(), po.host()));
    CHECK(identical(fm.host(), m));
    Matrix<T> yo = titans::RMSNorm<T>(wo, 1e-6).forward(o), ym = titans::RMSNorm<T>(wm, 1e-5).forward(m);
    Cpu::gate(titans::view_of(std::as_const(yo)), titans::view_of(std::as_const(ym)),
              titans::view_of(yo));
    const double floor = 2.0 * static_cast<double>(std::numeric_limits<T>::denorm_min()) / tol<T>();
    CHECK(rel_error(fo.host(), yo, floor) <= tol<T>());
    const titans::RMSNorm<T, Cuda> other(d + 1);
    REQUIRE_THROWS_NAMING(no.forward_gated(other, fo.view, fm.view), titans::ShapeError,
                          "gate_norm");
    // Inside a deferring scope the kernel checks its inputs: finite ones raise nothing, a NaN
    // in m or an infinity in o raises the scope's flag.
    for (int c = 0; c < 3; ++c) {
        Matrix<T> oc = o, mc = m;
        if (c == 1) mc(7, d - 1) = std::numeric_limits<T>::quiet_NaN();
        if (c == 2) oc(3, 0) = -std::numeric_limits<T>::infinity();
        Strided<T> go(oc, 1), gm(mc, 2);
        titans::backend::cuda::CallScope scope;
        no.forward_gated(nm, go.view, gm.view);
        CHECK(scope.flagged() == (c > 0));
    }
}

/// The sum and the check in one (backend::add_nonfinite_row: GlueKernels::add_checked) against
/// Glue::add and the CPU's first non-finite row: a + b, a + bad (its first non-finite row r0),
/// and a sum of finite entries that overflows; inside a CallScope -1 back and the scope's flag
/// raised exactly when a sum is not finite. The sums bit for bit the add kernel's.
template <class T>
void add_checked_case(const Matrix<T>& a, const Matrix<T>& bad, Eigen::Index r0) {
    using Gpu = titans::backend::GlueKernels<Cuda, T>;
    using Cpu = titans::backend::GlueKernels<titans::backend::Cpu, T>;
    Matrix<T> over = a;
    over.row(r0).setConstant(std::numeric_limits<T>::max());
    const Matrix<T>* cases[][2] = {{&a, &a}, {&a, &bad}, {&over, &over}};
    for (int scoped = 0; scoped < 2; ++scoped) {
        for (int c = 0; c < 3; ++c) {
            INFO("case " << c << (scoped ? " in a CallScope" : ""));
            const Strided<T> da(*cases[c][0], 1), db(*cases[c][1], 2);
            Strided<T> out(Matrix<T>::Zero(a.rows(), a.cols()), 3), want(out.host(), 1);
            Gpu::add(da.view, db.view, want.view);
            Matrix<T> sum = *cases[c][0] + *cases[c][1];
            const std::ptrdiff_t cpu_row = Cpu::nonfinite_row(titans::view_of(std::as_const(sum)));
            CHECK(cpu_row == (c == 0 ? -1 : r0));
            std::ptrdiff_t row = 0;
            bool flagged = false;
            if (scoped == 1) {
                titans::backend::cuda::CallScope scope;
                row = titans::backend::add_nonfinite_row<Gpu, T>(da.view, db.view, out.view);
                flagged = scope.flagged();
            } else {
                row = titans::backend::add_nonfinite_row<Gpu, T>(da.view, db.view, out.view);
            }
            CHECK(row == (scoped == 1 ? -1 : cpu_row));
            CHECK(flagged == (scoped == 1 && c > 0));
            CHECK(identical_or_nan(out.host(), want.host()));
        }
    }
}

template <class T>
void glue_case(Eigen::Index rows, Eigen::Index cols, Rng& rng) {
    using Gpu = titans::backend::GlueKernels<Cuda, T>;
    using Cpu = titans::backend::GlueKernels<titans::backend::Cpu, T>;
    INFO("rows " << rows << " cols " << cols << " " << type_name<T>());
    const Matrix<T> a = random_t<T>(rows, cols, rng), b = random_t<T>(rows, cols, rng);
    Matrix<T> want(rows, cols);
    Strided<T> da(a, 3), db(b, 1), out(Matrix<T>::Zero(rows, cols), 2);
    Gpu::copy(da.view, out.view);
    CHECK(identical(out.host(), a));
    Cpu::add(titans::view_of(a), titans::view_of(b), titans::view_of(want));
    Gpu::add(da.view, db.view, da.view);  // in place
    CHECK(rel_error(da.host(), want) <= tol<T>());
    Cpu::gate(titans::view_of(a), titans::view_of(b), titans::view_of(want));
    Gpu::copy(titans::View<const T>(out.view), da.view);  // a again
    Gpu::gate(da.view, db.view, out.view);
    CHECK(rel_error(out.host(), want) <= tol<T>());
    // The first non-finite row: none, then a NaN and an infinity planted (the padding's NaN
    // never counts).
    CHECK(Gpu::nonfinite_row(da.view) == -1);
    if (rows > 0) {
        Matrix<T> bad = a;
        const auto r1 = static_cast<Eigen::Index>(uniform_int(rng, 0, static_cast<int>(rows) - 1));
        const auto r0 = static_cast<Eigen::Index>(uniform_int(rng, 0, static_cast<int>(r1)));
        bad(r1, cols - 1) = std::numeric_limits<T>::quiet_NaN();
        bad(r0, 0) = -std::numeric_limits<T>::infinity();
        const Strided<T> dbad(bad, 2);
        CHECK(Gpu::nonfinite_row(dbad.view) == r0);
        CHECK(Cpu::nonfinite_row(titans::view_of(bad)) == r0);
        add_checked_case<T>(a, bad, r0);
    }
    // The gather of table rows and the head's product.
    const Eigen::Index vocab = 1 + rows % 7;
    const Matrix<T> table = random_t<T>(vocab, cols, rng);
    std::vector<int> ids(static_cast<std::size_t>(rows));
    for (int& id : ids) id = uniform_int(rng, 0, static_cast<int>(vocab) - 1);
    const Strided<T> dt(table, 1);
    Gpu::gather(dt.view, Gpu::upload_ids(ids), out.view);
    Cpu::gather(titans::view_of(table), ids, titans::view_of(want));
    CHECK(identical(out.host(), want));
    const Matrix<T> w = random_t<T>(cols, 5, rng);
    Matrix<T> pc(rows, 5);
    Strided<T> dw(w, 2), pg(Matrix<T>::Zero(rows, 5), 1);
    Cpu::product(titans::view_of(a), titans::view_of(w), titans::view_of(pc));
    Gpu::product(da.view, dw.view, pg.view);
    CHECK(rel_error(pg.host(), pc) <= tol<T>());
}

/// The training glue on strided views against the CPU's: MAG's gate adjoint, fill, row blocks
/// ([P; u] assembled per sequence, stripped, P's adjoint summed over sequences), the head's
/// transposed products and the embedding's scatter-add with repeated ids.
template <class T>
void training_glue_case(int B, Eigen::Index n, Eigen::Index p, Eigen::Index cols, Rng& rng) {
    using Gpu = titans::backend::GlueKernels<Cuda, T>;
    using Cpu = titans::backend::GlueKernels<titans::backend::Cpu, T>;
    using titans::view_of;
    INFO("B " << B << " n " << n << " p " << p << " cols " << cols << " " << type_name<T>());
    const Eigen::Index rows = B * n, full = B * (n + p);
    const Matrix<T> d = random_t<T>(rows, cols, rng), a = random_t<T>(rows, cols, rng),
                    m = random_t<T>(rows, cols, rng);
    Matrix<T> da(rows, cols), dm(rows, cols);
    Cpu::gate_backward(view_of(d), view_of(a), view_of(m), view_of(da), view_of(dm));
    const Strided<T> gd(d, 1), ga(a, 2), gm(m, 3);
    Strided<T> gda(Matrix<T>::Zero(rows, cols), 1), gdm(Matrix<T>::Zero(rows, cols), 2);
    Gpu::gate_backward(gd.view, ga.view, gm.view, gda.view, gdm.view);
    CHECK(rel_error(gda.host(), da) <= tol<T>());
    CHECK(rel_error(gdm.host(), dm) <= tol<T>());
    // [P; u] per sequence, then stripped back to u, then P's rows summed into dP (to_step 0).
    const Matrix<T> P = random_t<T>(p, cols, rng);
    const titans::backend::RowBlocks pre{B, p, 0, 0, n + p, 0}, body{B, n, n, 0, n + p, p},
        strip{B, n, n + p, p, n, 0}, sum{B, p, n + p, 0, 0, 0};
    Matrix<T> want(full, cols);
    Cpu::fill(view_of(want), T(0.5));
    Cpu::copy_rows(view_of(P), view_of(want), pre);
    Cpu::copy_rows(view_of(d), view_of(want), body);
    const Strided<T> gP(P, 1);
    Strided<T> gfull(Matrix<T>::Zero(full, cols), 1), gback(Matrix<T>::Zero(rows, cols), 3);
    Gpu::fill(gfull.view, T(0.5));
    Gpu::copy_rows(gP.view, gfull.view, pre);
    Gpu::copy_rows(gd.view, gfull.view, body);
    CHECK(identical(gfull.host(), want));
    Gpu::copy_rows(gfull.view, gback.view, strip);
    CHECK(identical(gback.host(), d));
    Matrix<T> dP = random_t<T>(p, cols, rng);
    Strided<T> gdP(dP, 2);
    Cpu::add_rows(view_of(want), view_of(dP), sum);
    Gpu::add_rows(gfull.view, gdP.view, sum);
    CHECK(rel_error(gdP.host(), dP) <= tol<T>());
    // The head's gradient aᵀ b, its input gradient b wᵀ, and the scatter-add.
    const Eigen::Index V = 1 + rows % 5;
    const Matrix<T> dout = random_t<T>(rows, V, rng), w = random_t<T>(cols, V, rng);
    Matrix<T> gw(cols, V), dz(rows, cols);
    Cpu::product_at(view_of(a), view_of(dout), view_of(gw));
    Cpu::product_bt(view_of(dout), view_of(w), view_of(dz));
    const Strided<T> gdo(dout, 1), gw_(w, 2);
    Strided<T> ggw(Matrix<T>::Zero(cols, V), 1), gdz(Matrix<T>::Zero(rows, cols), 2);
    Gpu::product_at(ga.view, gdo.view, ggw.view);
    Gpu::product_bt(gdo.view, gw_.view, gdz.view);
    CHECK(rel_error(ggw.host(), gw) <= tol<T>());
    CHECK(rel_error(gdz.host(), dz) <= tol<T>());
    // MAC's prefix product (P W, P few rows) against the host product in double.
    const Matrix<T> pw = random_t<T>(cols, V, rng);
    const Strided<T> gpw(pw, 3);
    Strided<T> gpp(Matrix<T>::Zero(p, V), 2);
    Gpu::product_plain(gP.view, gpw.view, gpp.view);
    const Matrix<double> want_pp = P.template cast<double>() * pw.template cast<double>();
    CHECK(rel_error(gpp.host(), want_pp) <= tol<T>());
    std::vector<int> ids(static_cast<std::size_t>(rows));
    for (int& id : ids) id = uniform_int(rng, 0, 2);  // repeats
    Matrix<T> table = random_t<T>(3, cols, rng);
    Strided<T> gt(table, 1);
    Cpu::scatter_add(view_of(a), ids, view_of(table));
    Gpu::scatter_add(ga.view, Gpu::upload_ids(ids), gt.view);
    CHECK(rel_error(gt.host(), table) <= tol<T>());
    // The cross-entropy of dout's rows (logits, V wide) against labels, some ignored.
    std::vector<int> labels(static_cast<std::size_t>(rows));
    for (int& l : labels) l = uniform_int(rng, -1, static_cast<int>(V) - 1);
    Matrix<T> dl(rows, V);
    auto sc = Cpu::make_scalars();
    Cpu::cross_entropy(view_of(dout), labels, view_of(dl), sc, 1);
    const double lc = Cpu::read(sc)[1];
    Strided<T> gdl(Matrix<T>::Constant(rows, V, T(7)), 2);
    auto sg = Gpu::make_scalars();
    Gpu::cross_entropy(gdo.view, labels, gdl.view, sg, 2);
    const titans::backend::ScalarValues lgs = Gpu::read(sg);
    const double lg = lgs[2];
    CHECK(lgs[0] == 0.0);  // the other slots untouched
    CHECK(lgs[1] == 0.0);
    CHECK(std::abs(lg - lc) <= tol<T>() * std::max(1.0, std::abs(lc)));
    CHECK(rel_error(gdl.host(), dl) <= tol<T>());
}

/// A gradient buffer's glue against the CPU's: clip's norm over several chunks and parts
/// and its clipping (a NaN and an infinity propagating, nothing scaled then), scale,
/// Transfer::accumulate (host rows added) and AdamW's step (adamw, its verdict in a slot).
template <class T>
void gradient_glue_case(Eigen::Index n, Rng& rng) {
    using Gpu = titans::backend::GlueKernels<Cuda, T>;
    using Cpu = titans::backend::GlueKernels<titans::backend::Cpu, T>;
    using titans::view_of;
    INFO("n " << n << " " << type_name<T>());
    Matrix<T> x = random_t<T>(1, n, rng);
    x(0, n / 2) = T(1e3);  // the scale sits in the middle
    const std::vector<std::ptrdiff_t> parts{n / 3, n - n / 3};
    auto sc = Cpu::make_scalars();
    auto sg = Gpu::make_scalars();
    Cpu::clip(view_of(x), parts, 0.0, sc, 0);  // the norm alone
    Strided<T> g(x, 0);
    Gpu::clip(g.view, parts, 0.0, sg, 3);
    const double want = Cpu::read(sc)[0];
    CHECK(std::abs(Gpu::read(sg)[3] - want) <= 1e-13 * want);
    CHECK(identical(g.host(), x));
    for (const double max_norm : {2 * want, 0.5 * want}) {  // above the norm: nothing scaled
        Cpu::clip(view_of(x), parts, max_norm, sc, 1);
        Gpu::clip(g.view, parts, max_norm, sg, 1);
        CHECK(std::abs(Gpu::read(sg)[1] - Cpu::read(sc)[1]) <= 1e-13 * want);
        CHECK(rel_error(g.host(), x) <= tol<T>());
    }
    CHECK(std::abs(Cpu::read(sc)[1] - want) <= 1e-13 * want);  // the norm before clipping
    g = Strided<T>(x, 0);  // the CPU's entries again
    Cpu::scale(view_of(x), T(0.25));
    Gpu::scale(g.view, T(0.25));
    CHECK(identical(g.host(), x));
    const Matrix<T> add = random_t<T>(1, n, rng);
    titans::backend::Transfer<Cuda, T>::accumulate(view_of(add), g.view);
    CHECK(identical(g.host(), Matrix<T>(x + add)));
    // One AdamW step on the entries (ModelAdamW's kernel) as two tensors, one decayed, in
    // either order; then a gradient whose square overflows: both say so.
    Matrix<T> gr = random_t<T>(1, n, rng);
    const Matrix<T> m0 = random_t<T>(1, n, rng), v0 = random_t<T>(1, n, rng).cwiseAbs();
    const titans::detail::AdamWStep<T> f{3, T(0.9), T(0.99), T(1e-8), T(0.01), T(0.17), T(0.999)};
    for (int c = 0; c < 3; ++c) {
        if (c == 2) gr(0, n - 1) = std::numeric_limits<T>::max();
        const std::vector<titans::detail::AdamWPart> parts{{n / 3, c == 0}, {n - n / 3, c != 0}};
        Matrix<T> p1(1, n), m1(1, n), v1(1, n);
        Cpu::adamw(f, parts, view_of(x), view_of(gr), view_of(m0), view_of(v0), view_of(p1),
                   view_of(m1), view_of(v1), sc, 2);
        const bool fc = Cpu::read(sc)[2] == 1.0;
        Strided<T> dp(x, 0), dg(gr, 0), dm(m0, 0), dv(v0, 0);
        Strided<T> op(Matrix<T>::Zero(1, n), 0), om(Matrix<T>::Zero(1, n), 0),
            ov(Matrix<T>::Zero(1, n), 0);
        const auto on_device = Gpu::upload_parts(parts);
        Gpu::adamw(f, on_device, dp.view, dg.view, dm.view, dv.view, op.view, om.view, ov.view,
                   sg, 2);
        const bool fg = Gpu::read(sg)[2] == 1.0;
        CHECK(fc == (c != 2));
        CHECK(fg == fc);
        if (c == 2) {  // the same parts again with a finite gradient: the flag starts clear
            const Matrix<T> small = random_t<T>(1, n, rng);
            Strided<T> ds(small, 0);
            Gpu::adamw(f, on_device, dp.view, ds.view, dm.view, dv.view, op.view, om.view,
                       ov.view, sg, 2);
            CHECK(Gpu::read(sg)[2] == 1.0);
            continue;
        }
        CHECK(rel_error(op.host(), p1) <= tol<T>());
        CHECK(rel_error(om.host(), m1) <= tol<T>());
        CHECK(rel_error(ov.host(), v1) <= tol<T>());
    }
    for (const T bad : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity()}) {
        Matrix<T> y = x;
        y(0, n / 3) = bad;  // finite entries after it: it must stick
        Strided<T> gy(y, 0);
        Gpu::clip(gy.view, parts, 1.0, sg, 0);
        const double s = Gpu::read(sg)[0];
        CHECK((std::isnan(bad) ? std::isnan(s) : s == std::numeric_limits<double>::infinity()));
        const Matrix<T> back = gy.host();  // nothing scaled (the NaN compares unequal)
        CHECK(((back.array() == y.array()) || (back.array() != back.array() &&
                                               y.array() != y.array())).all());
    }
}

}  // namespace

TEMPLATE_TEST_CASE("cuda layers: glue kernels", "[cuda]", float, double) {
    Rng rng(seed_for("cuda layers: glue kernels"));
    for (Eigen::Index rows : {0, 1, 5, 37}) {
        for (Eigen::Index cols : {1, 7, 130}) {
            glue_case<TestType>(rows, cols, rng);
        }
    }
    for (int B : {1, 3}) {
        for (Eigen::Index n : {1, 6}) {
            training_glue_case<TestType>(B, n, n == 1 ? 0 : 4, B == 1 ? 5 : 33, rng);
        }
    }
    for (Eigen::Index n : {1, 7, 4097, 9000}) {
        gradient_glue_case<TestType>(n, rng);
    }
}

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

TEMPLATE_TEST_CASE("cuda layers: norm extremes", "[cuda]", float, double) {
    Rng rng(seed_for("cuda layers: norm extremes"));
    for (int d : {2, 7, 256, 300}) {
        norm_extreme_case<TestType>(d, rng);
    }
}

TEMPLATE_TEST_CASE("cuda layers: fused norms", "[cuda]", float, double) {
    Rng rng(seed_for("cuda layers: fused norms"));
    for (int d : {2, 7, 256, 300}) {
        norm_sum_case<TestType>(d, rng);
        norm_gated_case<TestType>(d, rng);
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

/// The feed-forward of few rows switched on for a scope, then back as it was.
struct FusedFeedForward {
    bool was = titans::backend::cuda::fused_feed_forward();
    FusedFeedForward() { titans::backend::cuda::set_fused_feed_forward(true); }
    ~FusedFeedForward() { titans::backend::cuda::set_fused_feed_forward(was); }
};

// The feed-forward of a few rows in one launch (feed_forward_rows.cuh, set_fused_feed_forward)
// against the CPU: SwiGLU and GELU; hidden widths of one block (5, 40) and of several (200,
// 344: not multiples of 64, the partials summed by the block that finishes last); 1 to 16 rows
// (17: the cuBLAS path again); inputs drawn, x 1e3 and x 1e-6; strided views. Where it applies,
// one kernel and no product a call, and the same bits call after call (the counter is back at
// zero after each launch, whatever the number of blocks before).
TEMPLATE_TEST_CASE("cuda layers: few-row FFN", "[cuda]", float, double) {
    using T = TestType;
    const FusedFeedForward on;
    Rng rng(seed_for("cuda layers: few-row FFN"));
    const std::pair<int, int> shapes[] = {{7, 5}, {24, 40}, {37, 200}, {64, 344}};
    for (auto kind : {titans::FeedForwardKind::SwiGLU, titans::FeedForwardKind::GELU}) {
        for (const auto& [d, h] : shapes) {
            const titans::FeedForwardConfig cfg{.d_model = d, .kind = kind, .hidden = h};
            const auto p = titans::FeedForwardParams<T>::random(cfg, rng());
            const titans::FeedForward<T> cpu(cfg, p);
            const titans::FeedForward<T, Cuda> gpu(cfg, p);
            for (int rows : {1, 3, 16, 17}) {
                const double scale = rows == 3 ? 1e3 : rows == 16 ? 1e-6 : 1.0;
                const Matrix<T> x = (random_matrix(rows, d, rng) * scale).template cast<T>();
                INFO("kind " << static_cast<int>(kind) << " d " << d << " h " << h << " rows "
                              << rows << " " << type_name<T>());
#if TITANS_CUDA_EMULATION
                const long k0 = cuda_emulation::total_launches(), g0 = cuda_emulation::gemm_calls();
#endif
                const Matrix<T> y = gpu.forward(x);
#if TITANS_CUDA_EMULATION
                CHECK(cuda_emulation::gemm_calls() - g0 == (rows <= 16 ? 0 : 2));
                if (rows <= 16) {
                    CHECK(cuda_emulation::total_launches() - k0 == 1);
                }
#endif
                CHECK(rel_error(y, cpu.forward(x)) <= tol<T>());
                CHECK(gpu.forward(x) == y);
                Strided<T> xs(x, 3), ys(Matrix<T>::Zero(rows, d), 2);
                gpu.forward(titans::View<const T>(xs.view), ys.view);
                CHECK(ys.host() == y);
            }
        }
    }
}

namespace {

/// The few-row product switched on for a scope, then back as it was.
struct RowsProductOn {
    bool was = titans::backend::cuda::rows_product();
    RowsProductOn() { titans::backend::cuda::set_rows_product(true); }
    ~RowsProductOn() { titans::backend::cuda::set_rows_product(was); }
};

/// Z products C_z = alpha A_z B_z + beta C_z through cuda::gemm (m x k by k x n; the batch
/// stacked in strided views padded with NaN) against the products in double on the host; with
/// the few-row product on, m <= 8 makes no cuBLAS call and one launch, and the same bits a
/// second time into a fresh C (its counters back at zero).
template <class T>
void rows_product_case(int m, int n, int k, int Z, T alpha, T beta, Rng& rng) {
    namespace cu = titans::backend::cuda;
    const double scale = m == 3 ? 1e3 : m == 8 ? 1e-6 : 1.0;
    const Matrix<T> a = (random_matrix(Z * m, k, rng) * scale).template cast<T>(),
                    b = random_t<T>(Z * k, n, rng);
    Matrix<T> c0 = random_t<T>(Z * m, n, rng);
    if (beta == T(0)) c0.setConstant(std::numeric_limits<T>::quiet_NaN());  // never read
    Matrixd want(Z * m, n);
    for (int z = 0; z < Z; ++z) {
        want.middleRows(z * m, m) =
            double(alpha) * a.middleRows(z * m, m).template cast<double>() *
            b.middleRows(z * k, k).template cast<double>();
        if (beta != T(0)) {
            want.middleRows(z * m, m) +=
                double(beta) * c0.middleRows(z * m, m).template cast<double>();
        }
    }
    Strided<T> da(a, 3), db(b, 1), dc(c0, 2), again(c0, 2);
    const auto ld = [](const Strided<T>& x) { return static_cast<int>(x.view.stride); };
    const auto product = [&](Strided<T>& dc) {
        const auto& cx = cu::thread_context();
        cu::gemm<T>(cx.blas(), false, false, m, n, k, alpha,
                    {da.view.data, ld(da), static_cast<long long>(m) * ld(da)},
                    {db.view.data, ld(db), static_cast<long long>(k) * ld(db)}, beta,
                    dc.view.data, ld(dc), static_cast<long long>(m) * ld(dc), Z);
        cx.synchronize();
    };
    INFO("m " << m << " n " << n << " k " << k << " Z " << Z << " beta " << beta << " "
              << type_name<T>());
#if TITANS_CUDA_EMULATION
    const long k0 = cuda_emulation::total_launches(), g0 = cuda_emulation::gemm_calls();
#endif
    product(dc);
#if TITANS_CUDA_EMULATION
    CHECK(cuda_emulation::gemm_calls() - g0 == (m <= cu::rows_product_max ? 0 : 1));
    if (m <= cu::rows_product_max) {
        CHECK(cuda_emulation::total_launches() - k0 == 1);
    }
#endif
    const Matrix<T> got = dc.host();
    CHECK(rel_error(got, want) <= tol<T>());
    if (beta == T(0)) {
        product(again);
        CHECK(again.host() == got);
    }
}

}  // namespace

// The few-row product (rows_product.cuh, set_rows_product) against the product in double:
// 1 to 8 rows (9: cuBLAS again), widths below, across and not a multiple of the block's 32
// columns, inner sizes below a warp's 16 loads, at a block's 128 and past it (the partials of
// several blocks summed by the one that finishes last), past 64 spans (each warp takes several
// passes); batches of 3 and 7 (each product its own counters); alpha and beta (0: C all NaN,
// not read; otherwise added); A x 1e3 and x 1e-6.
TEMPLATE_TEST_CASE("cuda layers: few-row product", "[cuda]", float, double) {
    using T = TestType;
    const RowsProductOn on;
    Rng rng(seed_for("cuda layers: few-row product"));
    for (int m : {1, 3, 8, 9}) {
        for (int n : {1, 33, 300}) {
            for (int k : {1, 15, 128, 129, 2000}) {
                rows_product_case<T>(m, n, k, 1, T(1), T(0), rng);
            }
        }
    }
    rows_product_case<T>(2, 45, 9000, 1, T(1), T(0), rng);
    rows_product_case<T>(5, 70, 300, 3, T(-0.5), T(1.5), rng);
    rows_product_case<T>(1, 64, 7, 7, T(2), T(-1), rng);
    rows_product_case<T>(4, 40, 260, 7, T(1), T(0), rng);
}

// FeedForward::forward_sums (a block's feed-forward with the sums and norms around it: s = a +
// s, u = pre(s), y = FFN(u), s = y + s, u' = next(s)) against pre.forward_sum, forward and
// next.forward_sum, bit for bit, with the feed-forward of few rows on: SwiGLU and GELU; hidden
// widths of one block and of several; d above the block's 256 threads; 1, 3, 16 rows (one
// launch: each block takes the first sums and norms itself, the block that writes y the
// second) and 17 (the three calls); a drawn, x 1e3, x 1e-6; s's rows of every extreme kind and
// one at the largest value; strided views. A norm of another width and views that share
// storage are refused, s left as it was.
TEMPLATE_TEST_CASE("cuda layers: few-row FFN and the sums around it", "[cuda]", float, double) {
    using T = TestType;
    const FusedFeedForward on;
    Rng rng(seed_for("cuda layers: few-row FFN and the sums around it"));
    const std::pair<int, int> shapes[] = {{7, 5}, {37, 200}, {300, 40}};
    for (auto kind : {titans::FeedForwardKind::SwiGLU, titans::FeedForwardKind::GELU}) {
        for (const auto& [d, h] : shapes) {
            const titans::FeedForwardConfig cfg{.d_model = d, .kind = kind, .hidden = h};
            const titans::FeedForward<T, Cuda> ffn(cfg,
                                                   titans::FeedForwardParams<T>::random(cfg, rng()));
            const titans::RMSNorm<T, Cuda> pre(
                random_matrix(1, d, rng, 0.5, 1.5).template cast<T>(), 1e-5),
                next(random_matrix(1, d, rng, -1.5, 1.5).template cast<T>(), 1e-6);
            for (int rows : {1, 3, 16, 17}) {
                const double scale = rows == 3 ? 1e3 : rows == 16 ? 1e-6 : 1.0;
                const Matrix<T> a = (random_matrix(rows, d, rng) * scale).template cast<T>();
                Matrix<T> s(rows, d);
                for (int r = 0; r < rows; ++r) extreme_row<T>(r % 6, s.row(r), rng);
                if (rows >= 3) s.row(1).setConstant(std::numeric_limits<T>::max());
                INFO("kind " << static_cast<int>(kind) << " d " << d << " h " << h << " rows "
                              << rows << " " << type_name<T>());
                const Matrix<T> zero = Matrix<T>::Zero(rows, d);
                Strided<T> as(a, 2), sf(s, 3), uf(zero, 1), yf(zero, 2), nf(zero, 1), sp(s, 1),
                    up(zero, 2), yp(zero, 3), np(zero, 2);
                const titans::View<const T> av(as.view);
#if TITANS_CUDA_EMULATION
                const long k0 = cuda_emulation::total_launches();
#endif
                ffn.forward_sums(pre, av, sf.view, uf.view, yf.view, next, nf.view);
#if TITANS_CUDA_EMULATION
                if (rows <= 16) {
                    CHECK(cuda_emulation::total_launches() - k0 == 1);
                }
#endif
                pre.forward_sum(av, sp.view, up.view);
                ffn.forward(titans::View<const T>(up.view), yp.view);
                next.forward_sum(titans::View<const T>(yp.view), sp.view, np.view);
                CHECK(identical_or_nan(sf.host(), sp.host()));
                CHECK(identical_or_nan(uf.host(), up.host()));
                CHECK(identical_or_nan(yf.host(), yp.host()));
                CHECK(identical_or_nan(nf.host(), np.host()));
            }
            const Matrix<T> a = random_matrix(2, d, rng).template cast<T>(),
                            s = random_matrix(2, d, rng).template cast<T>();
            Strided<T> as(a, 1), ss(s, 2), u(a, 1), y(a, 1), n(a, 1);
            const titans::View<const T> av(as.view);
            const titans::RMSNorm<T, Cuda> other(Matrix<T>::Ones(1, d + 1));
            REQUIRE_THROWS_NAMING(ffn.forward_sums(pre, av, ss.view, u.view, y.view, other, n.view),
                                  titans::ShapeError, "a norm's dim()");
            REQUIRE_THROWS_NAMING(ffn.forward_sums(pre, av, ss.view, u.view, y.view, next, u.view),
                                  titans::ShapeError, "FeedForward::forward_sums");
            CHECK(ss.host() == s);
        }
    }
}
