// The backward of prefix_window_attention (attention/kernel_backward.hpp): dq, dk_prefix,
// dv_prefix, dk_seq, dv_seq against central finite differences of L = Σ dout ⊙ out in double
// (many tiles and partial tiles, prefixes of 0-4 rows, windows from 1 to beyond n, nonzero first
// query, query strides 1-3), against a plain per-query reference on a problem large enough for
// the OpenMP path, the added-to semantics of the key / value gradients, the shape refusals, and
// saturated softmaxes (scores ~ 1e3).
#include "catch.hpp"
#include "test_common.hpp"
#include "training_pass.hpp"

#include <titans/titans.hpp>
#include <titans/attention/kernel_backward.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

using namespace titans_test;
using titans::ConfigError;
using titans::ShapeError;
using Index = Eigen::Index;

namespace {

/// One attention problem in double.
struct AttnCase {
    int H = 1, dh = 1, w = 1;
    Index f = 0, s = 1;  // first query, query stride
    Matrixd q, kp, vp, ks, vs, dout;

    [[nodiscard]] std::string describe() const {
        std::ostringstream os;
        os << "H=" << H << " d_h=" << dh << " n=" << q.rows() << " p=" << kp.rows()
           << " m=" << ks.rows() << " window=" << w << " first=" << f << " stride=" << s;
        return os.str();
    }
};

/// n queries, p prefix rows, m = first + s (n - 1) + 1 + extra sequence rows; q scaled by q_scale.
AttnCase make_case(Rng& rng, int H, int dh, Index n, Index p, int w, Index f, Index s,
                   double q_scale = 1.0) {
    AttnCase c;
    c.H = H;
    c.dh = dh;
    c.w = w;
    c.f = f;
    c.s = s;
    const Index D = static_cast<Index>(H) * dh;
    const Index m = f + s * (n - 1) + 1 + uniform_int(rng, 0, 2);
    c.q = random_matrix(n, D, rng) * q_scale;
    c.kp = random_matrix(p, D, rng);
    c.vp = random_matrix(p, D, rng);
    c.ks = random_matrix(m, D, rng);
    c.vs = random_matrix(m, D, rng);
    c.dout = random_matrix(n, D, rng);
    return c;
}

Matrixd forward(const AttnCase& c) {
    Matrixd out(c.q.rows(), c.q.cols());
    titans::prefix_window_attention<double>(c.q, c.kp, c.vp, c.ks, c.vs, c.H, c.dh, c.w, c.f, out,
                                            c.s);
    return out;
}

struct Grads {
    Matrixd dq, dkp, dvp, dks, dvs;
};

Grads zero_grads(const AttnCase& c) {
    return {Matrixd(), Matrixd::Zero(c.kp.rows(), c.kp.cols()),
            Matrixd::Zero(c.vp.rows(), c.vp.cols()), Matrixd::Zero(c.ks.rows(), c.ks.cols()),
            Matrixd::Zero(c.vs.rows(), c.vs.cols())};
}

void backward(const AttnCase& c, Grads& g) {
    titans::prefix_window_attention_backward(c.q, c.kp, c.vp, c.ks, c.vs, c.H, c.dh, c.w, c.f,
                                             c.dout, g.dq, g.dkp, g.dvp, g.dks, g.dvs, c.s);
}

Grads backward(const AttnCase& c) {
    Grads g = zero_grads(c);
    backward(c, g);
    return g;
}

/// The gradients one query at a time from the definition: visible keys listed explicitly.
Grads naive_backward(const AttnCase& c) {
    Grads g = zero_grads(c);
    g.dq = Matrixd::Zero(c.q.rows(), c.q.cols());
    const Index p = c.kp.rows();
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dh));
    for (int h = 0; h < c.H; ++h) {
        const Index c0 = static_cast<Index>(h) * c.dh;
        for (Index i = 0; i < c.q.rows(); ++i) {
            const Index pos = c.f + c.s * i, j0 = std::max<Index>(0, pos - c.w + 1);
            const Index nk = p + pos - j0 + 1;
            Matrixd K(nk, c.dh), V(nk, c.dh);
            for (Index r = 0; r < nk; ++r) {
                K.row(r) = r < p ? c.kp.block(r, c0, 1, c.dh) : c.ks.block(j0 + r - p, c0, 1, c.dh);
                V.row(r) = r < p ? c.vp.block(r, c0, 1, c.dh) : c.vs.block(j0 + r - p, c0, 1, c.dh);
            }
            const Matrixd qi = c.q.block(i, c0, 1, c.dh), doi = c.dout.block(i, c0, 1, c.dh);
            Matrixd sc = scale * qi * K.transpose();
            Matrixd P = (sc.array() - sc.maxCoeff()).exp().matrix();
            P /= P.sum();
            const Matrixd dP = doi * V.transpose();
            const double delta = dP.cwiseProduct(P).sum();
            const Matrixd dS = P.cwiseProduct((dP.array() - delta).matrix());
            g.dq.block(i, c0, 1, c.dh) = scale * dS * K;
            const Matrixd dK = scale * dS.transpose() * qi, dV = P.transpose() * doi;
            for (Index r = 0; r < nk; ++r) {
                (r < p ? g.dkp : g.dks).block(r < p ? r : j0 + r - p, c0, 1, c.dh) += dK.row(r);
                (r < p ? g.dvp : g.dvs).block(r < p ? r : j0 + r - p, c0, 1, c.dh) += dV.row(r);
            }
        }
    }
    return g;
}

/// The rows a finite-difference check perturbs: all of them up to 12, else the first two, the
/// last two, both sides of the first tile boundary (rows tile - 1, tile) and random others.
std::vector<Index> fd_rows(Index rows, Index tile, Rng& rng) {
    std::vector<Index> r;
    for (Index i = 0; i < rows; ++i) {
        if (rows <= 12 || i <= 1 || i >= rows - 2 || i == tile - 1 || i == tile) r.push_back(i);
    }
    while (static_cast<Index>(r.size()) < std::min<Index>(rows, 12)) {
        const Index i = uniform_int(rng, 0, static_cast<int>(rows) - 1);
        if (std::find(r.begin(), r.end(), i) == r.end()) r.push_back(i);
    }
    return r;
}

/// max|a - fd| / max(1, max|fd|) over the fd_rows of every gradient, central differences with
/// step h (central_diff on each row in place); returns the largest.
double check_against_fd(AttnCase& c, double h, double bound, Rng& rng) {
    INFO(c.describe());
    const Grads g = backward(c);
    const auto loss = [&] { return forward(c).cwiseProduct(c.dout).sum(); };
    const Index tile = titans::detail::attention_query_tile(c.w);
    double worst = 0.0;
    const auto one = [&](const char* name, const Matrixd& a, Matrixd& x) {
        INFO(name);
        for (Index r : fd_rows(x.rows(), tile, rng)) {
            INFO("row " << r);
            auto row = x.row(r);
            const double e = note_error<double>(std::string("attn bwd: ") + name,
                                                rel_error(a.row(r), central_diff(row, h, loss), 1.0));
            CHECK(e <= bound);
            worst = std::max(worst, e);
        }
    };
    one("dq", g.dq, c.q);
    one("dk_prefix", g.dkp, c.kp);
    one("dv_prefix", g.dvp, c.vp);
    one("dk_seq", g.dks, c.ks);
    one("dv_seq", g.dvs, c.vs);
    return worst;
}

}  // namespace

// Every gradient against central differences (step 1e-5; up to 12 rows of each matrix, the tile
// boundary included) over 40 random cases: n 1..70 (up to 5 tiles of 16, partial tiles), H 1..3, d_h {1, 3, 8}, p {0, 1, 4}, window {1, 2, 5, > n},
// first query 0..6, stride 1..3, q scaled up to 3 (peaked softmaxes).
TEST_CASE("attn bwd: vs central FD", "[attention][backward]") {
    for (int i = 0; i < 40; ++i) {
        Rng rng(seed_for("attn bwd: vs central FD", static_cast<std::uint64_t>(i)));
        const Index n = i < 4 ? std::vector<Index>{1, 16, 17, 33}[static_cast<std::size_t>(i)]
                              : uniform_int(rng, 1, 70);
        const int H = uniform_int(rng, 1, 3), dh = pick(rng, std::vector<int>{1, 3, 8});
        const Index p = pick(rng, std::vector<Index>{0, 1, 4});
        const int w = pick(rng, std::vector<int>{1, 2, 5, static_cast<int>(n) + 7});
        const Index f = uniform_int(rng, 0, 6), s = pick(rng, std::vector<Index>{1, 1, 2, 3});
        AttnCase c = make_case(rng, H, dh, n, p, w, f, s, uniform(rng, 0.5, 3.0));
        check_against_fd(c, 1e-5, 1e-6, rng);
    }
}

// Large problem (many tiles, the OpenMP path when built with it): equals the per-query reference.
TEST_CASE("attn bwd: many tiles, naive", "[attention][backward]") {
    for (int w : {3, 40, 1000}) {
        Rng rng(seed_for("attn bwd: many tiles", static_cast<std::uint64_t>(w)));
        const AttnCase c = make_case(rng, 3, 16, 300, 5, w, 4, w == 40 ? 2 : 1, 2.0);
        INFO(c.describe());
        const Grads g = backward(c), r = naive_backward(c);
        CHECK(rel_error(g.dq, r.dq) <= 1e-12);
        CHECK(rel_error(g.dkp, r.dkp) <= 1e-12);
        CHECK(rel_error(g.dvp, r.dvp) <= 1e-12);
        CHECK(rel_error(g.dks, r.dks) <= 1e-12);
        CHECK(rel_error(g.dvs, r.dvs) <= 1e-12);
    }
}

// Key / value gradients are added to (two calls give twice one call), dq is overwritten (resized
// from any shape, earlier contents ignored); rows no query sees stay as they were.
TEST_CASE("attn bwd: adds to k/v grads", "[attention][backward]") {
    Rng rng(seed_for("attn bwd: adds to k/v grads"));
    AttnCase c = make_case(rng, 2, 3, 20, 2, 4, 3, 1);
    c.ks = (Matrixd(c.ks.rows() + 2, 6) << c.ks, random_matrix(2, 6, rng)).finished();
    c.vs = (Matrixd(c.vs.rows() + 2, 6) << c.vs, random_matrix(2, 6, rng)).finished();
    const Grads once = backward(c);
    Grads twice = zero_grads(c);
    twice.dq = Matrixd::Constant(3, 5, 7.0);
    backward(c, twice);
    backward(c, twice);
    CHECK(identical(twice.dq, once.dq));
    CHECK(rel_error(twice.dkp, 2.0 * once.dkp) <= 1e-15);
    CHECK(rel_error(twice.dvp, 2.0 * once.dvp) <= 1e-15);
    CHECK(rel_error(twice.dks, 2.0 * once.dks) <= 1e-15);
    CHECK(rel_error(twice.dvs, 2.0 * once.dvs) <= 1e-15);
    // Rows of k_seq past the last query's position (f + n - 1 = 22) are never seen.
    Grads pre = zero_grads(c);
    pre.dks.setConstant(1.5);
    backward(c, pre);
    CHECK((pre.dks.bottomRows(c.ks.rows() - 23).array() == 1.5).all());
    CHECK(rel_error(pre.dks.topRows(23), (once.dks.array() + 1.5).matrix().topRows(23)) <= 1e-15);
}

// Wrong gradient shapes, bad inputs and aliased outputs throw (ShapeError / ConfigError) and
// change no output.
TEST_CASE("attn bwd: shape refusals", "[attention][backward]") {
    Rng rng(seed_for("attn bwd: shape refusals"));
    const AttnCase c = make_case(rng, 2, 3, 6, 2, 3, 1, 1);
    const Matrixd e;
    Grads g = zero_grads(c);
    g.dq = Matrixd::Constant(2, 2, 4.0);
    const Grads before = g;
    const auto call = [&](const Matrixd& q, const Matrixd& dout, Grads& x, int H = 2) {
        titans::prefix_window_attention_backward(q, c.kp, c.vp, c.ks, c.vs, H, 3, c.w, c.f, dout,
                                                 x.dq, x.dkp, x.dvp, x.dks, x.dvs);
    };
    Grads bad = g;
    bad.dkp = Matrixd::Zero(3, 6);
    REQUIRE_THROWS_NAMING(call(c.q, c.dout, bad), ShapeError, "dk_prefix is 3 x 6, expected 2 x 6");
    bad = g;
    bad.dvp = Matrixd::Zero(2, 5);
    REQUIRE_THROWS_NAMING(call(c.q, c.dout, bad), ShapeError, "dv_prefix");
    bad = g;
    bad.dks = Matrixd::Zero(c.ks.rows() - 1, 6);
    REQUIRE_THROWS_NAMING(call(c.q, c.dout, bad), ShapeError, "dk_seq");
    bad = g;
    bad.dvs = Matrixd();
    REQUIRE_THROWS_NAMING(call(c.q, c.dout, bad), ShapeError, "dv_seq");
    REQUIRE_THROWS_NAMING(call(c.q, c.dout.topRows(5), g), ShapeError, "dout is 5 x 6");
    REQUIRE_THROWS_NAMING(call(c.q.leftCols(5), c.dout, g), ShapeError, "q has 5 columns");
    REQUIRE_THROWS_NAMING(call(c.q, c.dout, g, 0), ConfigError, "n_heads");
    // An output that is an input, or two outputs that are one matrix.
    Grads alias = g;
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention_backward(
                              c.q, c.kp, c.vp, alias.dks, c.vs, 2, 3, c.w, c.f, c.dout, alias.dq,
                              alias.dkp, alias.dvp, alias.dks, alias.dvs),
                          ShapeError, "dk_seq shares its storage");
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention_backward(
                              c.q, c.kp, c.vp, c.ks, c.vs, 2, 3, c.w, c.f, c.dout, alias.dq,
                              alias.dkp, alias.dvp, alias.dks, alias.dks),
                          ShapeError, "dv_seq shares its storage");
    Matrixd q = c.q;
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention_backward(
                              q, c.kp, c.vp, c.ks, c.vs, 2, 3, c.w, c.f, c.dout, q, alias.dkp,
                              alias.dvp, alias.dks, alias.dvs),
                          ShapeError, "dq shares its storage");
    CHECK(identical(g.dq, before.dq));
    CHECK(identical(g.dks, before.dks));
    CHECK(identical(alias.dks, before.dks));
    CHECK(identical(q, c.q));
    // Empty prefix as 0 x 0 matrices and no queries are accepted.
    AttnCase none = make_case(rng, 2, 3, 4, 0, 2, 0, 1);
    none.kp = e;
    none.vp = e;
    Grads gn = zero_grads(none);
    REQUIRE_NOTHROW(backward(none, gn));
    CHECK(gn.dq.rows() == 4);
    none.q = Matrixd(0, 6);
    none.dout = Matrixd(0, 6);
    REQUIRE_NOTHROW(backward(none, gn));
    CHECK((gn.dq.rows() == 0 && gn.dq.cols() == 6));
}

// Scores ~ 1e3 (softmax saturated, stabilised by the row maximum): finite gradients that match
// central differences; near-ties (keys repeated with a small perturbation) keep the q / k
// gradients non-trivial. Scores ~ 1e5 still give finite gradients with dv = P^T dout one-hot.
TEST_CASE("attn bwd: saturated scores", "[attention][backward]") {
    for (int i = 0; i < 4; ++i) {
        Rng rng(seed_for("attn bwd: saturated scores", static_cast<std::uint64_t>(i)));
        AttnCase c = make_case(rng, 2, 4, 21, 2, 5, 3, 1);
        const double big = 30.0;  // scores q.k / 2 up to 3600, typically ~1e3
        c.q *= big;
        c.kp *= big;
        c.ks *= big;
        for (Index r = 1; r < c.ks.rows(); r += 2) {
            c.ks.row(r) = c.ks.row(r - 1) + 0.05 * random_matrix(1, c.ks.cols(), rng);
        }
        c.kp.row(1) = c.ks.row(4) + 0.05 * random_matrix(1, c.ks.cols(), rng);
        CHECK(check_against_fd(c, 1e-5, 1e-6, rng) <= 1e-6);
        const Grads gc = backward(c);
        CHECK(gc.dq.cwiseAbs().maxCoeff() >= 1e-4);  // the near-ties are seen
        CHECK(gc.dks.cwiseAbs().maxCoeff() >= 1e-2);
        // 100x the scale: every gradient finite; dq, dk essentially 0 unless tied.
        AttnCase huge = c;
        huge.q *= 10.0;
        huge.kp *= 10.0;
        huge.ks *= 10.0;
        const Grads g = backward(huge);
        CHECK((g.dq.allFinite() && g.dkp.allFinite() && g.dks.allFinite()));
        CHECK((g.dvp.allFinite() && g.dvs.allFinite()));
        // Σ_rows dV = Σ_rows dout per head (each P row sums to one).
        const Matrixd dv_sum = g.dvp.colwise().sum() + g.dvs.colwise().sum();
        CHECK(rel_error(dv_sum, Matrixd(huge.dout.colwise().sum())) <= 1e-12);
    }
}

// ---------------------------------------------------------------------------------------------
// Attention::backward, the layer (math §9): W_Q, W_K, W_V, W_O, x and the prefix rows against
// finite differences of the library's own forward, with and without RoPE, no prefix, a shared
// prefix and one per sequence, windows shorter and longer than the piece; the refusals.

namespace {

struct LayerCase {
    titans::AttentionConfig cfg;
    titans::AttentionParams<double> p;
    Matrixd x, dy, prefix;
    titans::PrefixSharing sharing = titans::PrefixSharing::Shared;
    int batch = 1;
};

LayerCase draw_layer_case(int i, Rng& rng) {
    LayerCase c;
    c.cfg.n_heads = uniform_int(rng, 1, 2);
    c.cfg.rope = i % 2 == 0;
    c.cfg.d_head = c.cfg.rope ? 2 * uniform_int(rng, 1, 2) : uniform_int(rng, 1, 3);
    c.cfg.d_model = uniform_int(rng, 2, 5);
    c.cfg.window = uniform_int(rng, 1, 6);
    c.cfg.rope_base = uniform(rng, 2.0, 100.0);  // visible angles over a few positions
    c.cfg.validate();
    c.p = titans::AttentionParams<double>::random(c.cfg, rng());
    c.batch = uniform_int(rng, 1, 2);
    const int N = uniform_int(rng, 1, 9);
    c.x = random_matrix(c.batch * N, c.cfg.d_model, rng);
    c.dy = random_matrix(c.batch * N, c.cfg.d_model, rng);
    const int kind = (i / 2) % 3;  // 0 none, 1 shared, 2 per sequence
    const int np = uniform_int(rng, 1, 3);
    if (kind == 1) c.prefix = random_matrix(np, c.cfg.d_model, rng);
    if (kind == 2) {
        c.prefix = random_matrix(c.batch * np, c.cfg.d_model, rng);
        c.sharing = titans::PrefixSharing::PerSequence;
    }
    return c;
}

double layer_loss(const LayerCase& c) {
    titans::Attention<double> attn(c.cfg, c.p);
    auto st = attn.make_state(c.batch);
    Matrixd y;
    attn.forward(st, c.x, y, c.prefix.rows() > 0 ? &c.prefix : nullptr, c.sharing);
    return c.dy.cwiseProduct(y).sum();
}

}  // namespace

TEST_CASE("attn bwd: layer vs FD", "[train][attention]") {
    const int i = GENERATE(range(0, 24));
    const std::uint64_t seed = seed_for("attn bwd: layer vs FD", static_cast<std::uint64_t>(i));
    Rng rng(seed);
    LayerCase c = draw_layer_case(i, rng);
    INFO("seed=" << seed << " case=" << i << " window=" << c.cfg.window << " rows=" << c.x.rows()
                 << " prefix=" << c.prefix.rows());
    titans::Attention<double> attn(c.cfg, c.p);
    auto st = attn.make_state(c.batch);
    titans::Attention<double>::Trace trace;
    Matrixd y, dx, dprefix;
    attn.forward(st, c.x, y, trace, c.prefix.rows() > 0 ? &c.prefix : nullptr, c.sharing);
    auto g = titans::AttentionParams<double>::zeros(c.cfg);
    attn.backward(trace, c.dy, dx, g, &dprefix);
    const auto loss = [&]() { return layer_loss(c); };
    const double atol = fd_floor(loss());
    std::vector<const double*> grads;
    titans::AttentionParams<double>::tensors(g, c.cfg, [&](const std::string&, const auto& m) {
        grads.push_back(m.data());
    });
    std::size_t k = 0;
    titans::AttentionParams<double>::tensors(c.p, c.cfg, [&](const std::string& name, auto& m) {
        INFO(name);
        CHECK(note_error<double>("attention layer backward",
                                 tensor_error(m.data(), grads[k++], m.size(), atol, loss)) <= 1e-6);
    });
    CHECK(note_error<double>("attention layer backward",
                             tensor_error(c.x.data(), dx.data(), c.x.size(), atol, loss)) <= 1e-6);
    REQUIRE(dprefix.rows() == c.prefix.rows());
    if (c.prefix.rows() > 0) {
        CHECK(note_error<double>("attention layer backward",
                                 tensor_error(c.prefix.data(), dprefix.data(), c.prefix.size(),
                                              atol, loss)) <= 1e-6);
    }
}

TEST_CASE("attn bwd: layer refusals", "[train][attention]") {
    Rng rng(seed_for("attn bwd: layer refusals"));
    LayerCase c = draw_layer_case(2, rng);  // RoPE, a shared prefix
    titans::Attention<double> attn(c.cfg, c.p);
    auto s1 = attn.make_state(c.batch), s2 = attn.make_state(c.batch);
    titans::Attention<double>::Trace trace;
    Matrixd y1, y2;
    attn.forward(s1, c.x, y1, &c.prefix, c.sharing);
    attn.forward(s2, c.x, y2, trace, &c.prefix, c.sharing);
    CHECK(identical(y1, y2));  // the training forward is forward
    auto g = titans::AttentionParams<double>::zeros(c.cfg);
    Matrixd dx;
    attn.backward(trace, c.dy, dx, g);
    const auto once = g;
    attn.backward(trace, c.dy, dx, g);  // gradients add up
    CHECK(identical(g.w_q, (2 * once.w_q).eval()));
    Matrixd y3 = y1;
    // A batch that does not divide x's rows: refused, nothing written.
    auto s3 = attn.make_state(static_cast<int>(c.x.rows()) + 1);
    CHECK_THROWS_AS(attn.forward(s3, c.x, y3, trace, &c.prefix, c.sharing), titans::ShapeError);
    CHECK(identical(y3, y1));
    CHECK(trace.rows() == c.x.rows());
    titans::Attention<double>::Trace empty;
    CHECK_THROWS_AS(attn.backward(empty, c.dy, dx, g), titans::ShapeError);
    const Matrixd short_dy = c.dy.topRows(c.dy.rows() - 1);
    CHECK_THROWS_AS(attn.backward(trace, short_dy, dx, g), titans::ShapeError);
    auto wrong = g;
    wrong.w_o.resize(1, 1);
    CHECK_THROWS_AS(attn.backward(trace, c.dy, dx, wrong), titans::ShapeError);
    CHECK(identical(g.w_q, (2 * once.w_q).eval()));
    titans::AttentionConfig other = c.cfg;
    other.window += 1;
    titans::Attention<double> attn2(other, c.p);
    CHECK_THROWS_AS(attn2.backward(trace, c.dy, dx, g), titans::ConfigError);
}

// Chained pieces (math §9): a stream cut into pieces of any length (empty ones, single tokens,
// pieces longer than the window), forward in order from one state and backward last first,
// each given the next one's d_state_in as its d_state_out: the same dx, gradients and dprefix
// as one call, to rounding. The kept keys are rotated, so RoPE positions must carry over.
// Random and constant streams.
TEST_CASE("attn bwd: chained pieces", "[train][attention]") {
    for (int i = 0; i < 24; ++i) {
        Rng rng(seed_for("attn bwd: chained pieces", static_cast<std::uint64_t>(i)));
        LayerCase c = draw_layer_case(i, rng);
        const int B = c.batch;
        const int N = uniform_int(rng, 3, 14);
        c.x = random_matrix(B * N, c.cfg.d_model, rng);
        if (i % 4 == 3) {  // a constant stream: every token of a sequence the same row
            for (int b = 0; b < B; ++b) {
                c.x.middleRows(b * N, N).rowwise() = c.x.row(b * N);
            }
        }
        c.dy = random_matrix(B * N, c.cfg.d_model, rng);
        const std::vector<int> lens = random_pieces(rng, N, c.cfg.window);
        INFO("case " << i << " window " << c.cfg.window << " rows " << N << " pieces "
                     << lens.size() << " prefix " << c.prefix.rows());
        titans::Attention<double> attn(c.cfg, c.p);
        const Matrixd* prefix = c.prefix.rows() > 0 ? &c.prefix : nullptr;
        auto s_all = attn.make_state(B);
        titans::Attention<double>::Trace t_all;
        Matrixd y, dx_all, dp_all;
        attn.forward(s_all, c.x, y, t_all, prefix, c.sharing);
        auto g_all = titans::AttentionParams<double>::zeros(c.cfg);
        attn.backward(t_all, c.dy, dx_all, g_all, &dp_all);

        auto st = attn.make_state(B);
        std::vector<titans::Attention<double>::Trace> traces(lens.size());
        std::vector<Eigen::Index> t0{0};
        for (std::size_t k = 0; k < lens.size(); ++k) {
            t0.push_back(t0.back() + lens[k]);
            attn.forward(st, take_tokens(c.x, B, N, t0[k], t0[k + 1]), y, traces[k], prefix,
                         c.sharing);
        }
        auto g = titans::AttentionParams<double>::zeros(c.cfg);
        Matrixd dx(c.x.rows(), c.x.cols()), dp = Matrixd::Zero(c.prefix.rows(), c.cfg.d_model);
        titans::AttentionStateGradient<double> d_next;
        for (std::size_t k = traces.size(); k-- > 0;) {
            Matrixd dxk, dpk;
            titans::AttentionStateGradient<double> d_in;
            attn.backward(traces[k], take_tokens(c.dy, B, N, t0[k], t0[k + 1]), dxk, g, &dpk,
                          &d_in, &d_next);
            put_tokens(dx, dxk, B, N, t0[k], t0[k + 1]);
            if (prefix != nullptr) dp += dpk;
            d_next = std::move(d_in);
        }
        REQUIRE(d_next.keys.size() == static_cast<std::size_t>(B));
        CHECK(d_next.keys[0].rows() == 0);  // the first piece started from a fresh state
        // Each tensor relative to its own largest entry or chained_floor: a constant stream
        // without RoPE sees equal keys, so dL/dq is 0 and the W_Q and W_K gradients are
        // rounding noise of terms that cancel (as in the block test).
        const double floor = std::max(1e-6, chained_floor(g_all, c.cfg, dx_all));
        CHECK(note_error<double>("attention chained pieces", rel_error(dx, dx_all, floor)) <= 1e-12);
        CHECK(note_error<double>("attention chained pieces", rel_error(dp, dp_all, floor)) <= 1e-12);
        titans::AttentionParams<double>::tensors(g, c.cfg, [&](const std::string& name,
                                                                 const auto& t) {
            titans::AttentionParams<double>::tensors(
                g_all, c.cfg, [&](const std::string& n2, const auto& t2) {
                    if (n2 != name) return;
                    INFO(name);
                    CHECK(note_error<double>("attention chained pieces",
                                             rel_error(Matrixd(t), Matrixd(t2), floor)) <= 1e-12);
                });
        });
    }
}

TEST_CASE("attn bwd: state gradient refusals", "[train][attention]") {
    Rng rng(seed_for("attn bwd: state gradient refusals"));
    LayerCase c = draw_layer_case(0, rng);
    c.cfg.window = 3;
    const int B = c.batch;
    const Eigen::Index N = c.x.rows() / B;
    c.x = random_matrix(B * (N + 4), c.cfg.d_model, rng);
    c.dy = random_matrix(B * (N + 4), c.cfg.d_model, rng);
    titans::Attention<double> attn(c.cfg, c.p);
    auto st = attn.make_state(B);
    titans::Attention<double>::Trace t1, t2;
    Matrixd y, dx;
    attn.forward(st, take_tokens(c.x, B, N + 4, 0, 4), y, t1);
    attn.forward(st, take_tokens(c.x, B, N + 4, 4, N + 4), y, t2);
    auto g = titans::AttentionParams<double>::zeros(c.cfg);
    titans::AttentionStateGradient<double> d;
    attn.backward(t2, take_tokens(c.dy, B, N + 4, 4, N + 4), dx, g, nullptr, &d);
    REQUIRE(d.keys.size() == static_cast<std::size_t>(B));
    REQUIRE(d.keys[0].rows() == 2);  // min(w - 1, 4) kept rows
    const auto before = g;
    const Matrixd dy1 = take_tokens(c.dy, B, N + 4, 0, 4);
    auto bad = d;
    bad.keys.push_back(bad.keys.back());  // one sequence too many
    REQUIRE_THROWS_NAMING(attn.backward(t1, dy1, dx, g, nullptr, nullptr, &bad),
                          titans::ShapeError, "keys.size()");
    bad = d;
    bad.values[0].resize(1, c.cfg.inner_dim());
    REQUIRE_THROWS_NAMING(attn.backward(t1, dy1, dx, g, nullptr, nullptr, &bad),
                          titans::ShapeError, "d_state_out.values");
    bad = d;
    bad.keys[0](0, 0) = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_NAMING(attn.backward(t1, dy1, dx, g, nullptr, nullptr, &bad),
                          titans::NonFiniteError, "d_state_out");
    CHECK(identical(g.w_q, before.w_q));
    // The state gradient of t2's start, given as t2's own end adjoint: t2 ends at N + 4, where
    // the window also keeps 2 rows, so the shapes agree and it is accepted.
    attn.backward(t2, take_tokens(c.dy, B, N + 4, 4, N + 4), dx, g, nullptr, nullptr, &d);
}

TEST_CASE("attn bwd: zero state gradient", "[train][attention]") {
    for (int i = 0; i < 6; ++i) {
        Rng rng(seed_for("attn bwd: zero state gradient", static_cast<std::uint64_t>(i)));
        LayerCase c = draw_layer_case(i, rng);
        const int B = c.batch, N = uniform_int(rng, 2, 12), cut = uniform_int(rng, 1, N - 1);
        c.x = random_matrix(B * N, c.cfg.d_model, rng);
        c.dy = random_matrix(B * N, c.cfg.d_model, rng);
        titans::Attention<double> attn(c.cfg, c.p);
        auto st = attn.make_state(B);
        titans::Attention<double>::Trace t1, t2;
        Matrixd y, dx_none, dx_zero, dx2;
        attn.forward(st, take_tokens(c.x, B, N, 0, cut), y, t1);
        attn.forward(st, take_tokens(c.x, B, N, cut, N), y, t2);
        auto g = titans::AttentionParams<double>::zeros(c.cfg);
        titans::AttentionStateGradient<double> d_mid;
        attn.backward(t2, take_tokens(c.dy, B, N, cut, N), dx2, g, nullptr, &d_mid);
        const auto z = titans::AttentionStateGradient<double>::zeros(c.cfg, B, cut);
        INFO("case " << i << " window " << c.cfg.window << " cut " << cut);
        REQUIRE(z.keys.size() == d_mid.keys.size());
        CHECK(z.keys[0].rows() == d_mid.keys[0].rows());
        CHECK(z.values[0].cols() == d_mid.values[0].cols());
        CHECK(z.keys[0].isZero(0.0));
        auto g_none = titans::AttentionParams<double>::zeros(c.cfg), g_zero = g_none;
        attn.backward(t1, take_tokens(c.dy, B, N, 0, cut), dx_none, g_none);
        attn.backward(t1, take_tokens(c.dy, B, N, 0, cut), dx_zero, g_zero, nullptr, nullptr, &z);
        CHECK(identical(dx_none, dx_zero));
        CHECK(identical(g_none.w_k, g_zero.w_k));
    }
    titans::AttentionConfig cfg;
    REQUIRE_THROWS_NAMING(titans::AttentionStateGradient<double>::zeros(cfg, 1, -1),
                          titans::ConfigError, "position");
}
