// Attention (math §6-7) and the basic layers: prefix_window_attention against a plain reference
// that builds the full masked score matrix, window edges, prefix visibility, causality, RoPE
// (against explicit 2x2 rotations, and its relative-position property), the Attention layer
// against the reference and streamed in pieces against one call, RMSNorm, FeedForward,
// PersistentMemory, and the error paths.
#include "backends.hpp"

#include "reference/reference_attention.hpp"

#include <climits>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

using namespace titans_test;
using titans::Attention;
using titans::AttentionConfig;
using titans::AttentionParams;
using titans::ConfigError;
using titans::FeedForward;
using titans::FeedForwardConfig;
using titans::FeedForwardKind;
using titans::FeedForwardParams;
using titans::NonFiniteError;
using titans::PersistentMemory;
using titans::PrefixSharing;
using titans::RMSNorm;
using titans::RowVector;
using titans::ShapeError;

namespace {

template <class T>
Matrix<T> to(const Matrixd& m) {
    return m.cast<T>();
}

/// Inputs of one prefix_window_attention call, already rounded through T.
struct CoreCase {
    int H = 1, dh = 1, w = 1;
    Eigen::Index n = 0, p = 0, f = 0, s = 1;  // s: query stride
    Matrixd q, kp, vp, ks, vs;

    [[nodiscard]] std::string describe() const {
        std::ostringstream os;
        os << "H=" << H << " d_h=" << dh << " n=" << n << " p=" << p << " window=" << w
           << " first_query=" << f << " query_stride=" << s << " m=" << ks.rows();
        return os.str();
    }
};

/// window_kind: 0 -> w = 1; 1 -> w >= f + n (full causal; sometimes INT_MAX); 2 -> in between.
template <class T>
CoreCase make_core_case(Rng& rng, int window_kind, double q_scale = 1.5, Eigen::Index stride = 1) {
    CoreCase c;
    c.s = stride;
    c.H = uniform_int(rng, 1, 3);
    c.dh = uniform_int(rng, 1, 6);
    switch (uniform_int(rng, 0, 4)) {
        case 0: c.n = 0; break;
        case 1: c.n = 1; break;
        default: c.n = uniform_int(rng, 2, 90); break;
    }
    c.p = uniform_int(rng, 0, 2) == 0 ? 0 : uniform_int(rng, 1, 6);
    c.f = uniform_int(rng, 0, 1) == 0 ? 0 : uniform_int(rng, 1, 12);
    // Rows past the last query's position f + s (n - 1) are never read.
    const Eigen::Index m = c.f + (c.n > 0 ? c.s * (c.n - 1) + 1 : 0) + uniform_int(rng, 0, 3);
    const int reach = static_cast<int>(c.f + c.s * c.n);
    if (window_kind == 0) {
        c.w = 1;
    } else if (window_kind == 1) {
        c.w = uniform_int(rng, 0, 3) == 0 ? INT_MAX : reach + uniform_int(rng, 0, 5);
        c.w = std::max(c.w, 1);
    } else {
        c.w = uniform_int(rng, 2, std::max(2, reach - 1));
    }
    const Eigen::Index D = static_cast<Eigen::Index>(c.H) * c.dh;
    c.q = round_through<T>(random_matrix(c.n, D, rng, -q_scale, q_scale));
    c.kp = round_through<T>(random_matrix(c.p, D, rng, -1.5, 1.5));
    c.vp = round_through<T>(random_matrix(c.p, D, rng));
    c.ks = round_through<T>(random_matrix(m, D, rng, -1.5, 1.5));
    c.vs = round_through<T>(random_matrix(m, D, rng));
    return c;
}

template <class T>
Matrix<T> run_core(const CoreCase& c) {
    if (c.s == 1) {
        return titans::prefix_window_attention(to<T>(c.q), to<T>(c.kp), to<T>(c.vp), to<T>(c.ks),
                                               to<T>(c.vs), c.H, c.dh, c.w, c.f);
    }
    Matrix<T> out(c.n, static_cast<Eigen::Index>(c.H) * c.dh);
    titans::prefix_window_attention<T>(to<T>(c.q), to<T>(c.kp), to<T>(c.vp), to<T>(c.ks),
                                       to<T>(c.vs), c.H, c.dh, c.w, c.f, out, c.s);
    return out;
}

Matrixd run_reference(const CoreCase& c) {
    return titans::reference::attention(c.q, c.kp, c.vp, c.ks, c.vs, c.H, c.dh, c.w, c.f, c.s);
}

/// Largest |a - b| over row r.
template <class A, class B>
double attention_row_diff(const A& a, const B& b, Eigen::Index r) {
    return (a.row(r).template cast<double>() - b.row(r).template cast<double>())
        .cwiseAbs()
        .maxCoeff();
}

/// A random attention configuration for the layer tests: H in 1..3, even d_h in 2..6, d_model
/// H * d_h or (explicit d_head) anything in 2..20.
AttentionConfig random_attention_config(Rng& rng, bool rope, int window) {
    AttentionConfig c;
    c.n_heads = uniform_int(rng, 1, 3);
    const int dh = 2 * uniform_int(rng, 1, 3);
    if (uniform_int(rng, 0, 2) == 0) {
        c.d_head = dh;
        c.d_model = uniform_int(rng, 2, 20);
    } else {
        c.d_model = c.n_heads * dh;
    }
    c.window = window;
    c.rope = rope;
    c.rope_base = pick(rng, std::vector<double>{10000.0, 100.0, 10.0});
    c.validate();
    return c;
}

template <class T>
AttentionParams<double> random_attention_params(const AttentionConfig& cfg, Rng& rng) {
    const auto p = AttentionParams<double>::random(cfg, rng());
    AttentionParams<double> r;
    r.w_q = round_through<T>(p.w_q);
    r.w_k = round_through<T>(p.w_k);
    r.w_v = round_through<T>(p.w_v);
    r.w_o = round_through<T>(p.w_o);
    return r;
}

template <class T>
AttentionParams<T> cast_attention_params(const AttentionParams<double>& p) {
    AttentionParams<T> r;
    r.w_q = to<T>(p.w_q);
    r.w_k = to<T>(p.w_k);
    r.w_v = to<T>(p.w_v);
    r.w_o = to<T>(p.w_o);
    return r;
}


}  // namespace

// ---------------------------------------------------------------------------------------------
// prefix_window_attention

// prefix_window_attention equals the full masked reference (window 1, window >= n, windows in
// between, empty and non-empty prefix, first_query > 0)
TEMPLATE_TEST_CASE("window attn: == reference", "[attention]", float, double) {
    using T = TestType;
    const std::string name = "pwa reference";
    int case_index = 0;
    for (int kind = 0; kind < 3; ++kind) {
        for (int rep = 0; rep < 25; ++rep) {
            Rng rng(seed_for(name, static_cast<std::uint64_t>(case_index++)));
            const CoreCase c = make_core_case<T>(rng, kind);
            INFO(c.describe());
            const Matrix<T> out = run_core<T>(c);
            const Matrixd ref = run_reference(c);
            REQUIRE(out.rows() == c.n);
            REQUIRE(out.cols() == c.H * c.dh);
            if (c.n > 0) {
                CHECK(note_error<T>("attention: prefix_window_attention vs reference",
                                    rel_error(out, ref)) <= tol<T>());
            }
        }
    }
}

// prefix_window_attention with a query stride of 2 or 3 equals the reference (queries at every s-th
// key position, as MAC's interleaved keys use)
TEMPLATE_TEST_CASE("window attn: query stride", "[attention]", float, double) {
    using T = TestType;
    int case_index = 0;
    for (Eigen::Index stride : {2, 3}) {
        for (int kind = 0; kind < 3; ++kind) {
            for (int rep = 0; rep < 15; ++rep) {
                Rng rng(seed_for("pwa stride", static_cast<std::uint64_t>(case_index++)));
                const CoreCase c = make_core_case<T>(rng, kind, 1.5, stride);
                INFO(c.describe());
                const Matrix<T> out = run_core<T>(c);
                REQUIRE(out.rows() == c.n);
                if (c.n > 0) {
                    CHECK(note_error<T>("attention: prefix_window_attention vs reference",
                                        rel_error(out, run_reference(c))) <= tol<T>());
                }
            }
        }
    }
    // The last query's position must be a key row; the stride must be >= 1.
    Rng rng(seed_for("pwa stride errors"));
    const Matrix<T> q = random_matrix(3, 4, rng).cast<T>(), k = random_matrix(5, 4, rng).cast<T>();
    const Matrix<T> none(0, 4);
    Matrix<T> out(3, 4);
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention<T>(q, none, none, k, k, 2, 2, 4, 0, out, 3),
                          titans::ShapeError, "k_seq.rows() = 5");
    REQUIRE_NOTHROW(titans::prefix_window_attention<T>(q, none, none, k, k, 2, 2, 4, 0, out, 2));
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention<T>(q, none, none, k, k, 2, 2, 4, 0, out, 0),
                          titans::ConfigError, "query_stride = 0");
}

// detail::attention_row (the per-(row, head) function the CUDA backend runs) over every row
// and head equals the full masked reference: windows, prefixes, query strides 1 to 3, large
// scores (the maximum's subtraction)
TEMPLATE_TEST_CASE("window attn: attention_row", "[attention]", float, double) {
    using T = TestType;
    int case_index = 0;
    for (Eigen::Index stride : {1, 2, 3}) {
        for (int kind = 0; kind < 3; ++kind) {
            for (int rep = 0; rep < 12; ++rep) {
                Rng rng(seed_for("attention_row", static_cast<std::uint64_t>(case_index++)));
                const CoreCase c = make_core_case<T>(rng, kind, rep % 4 == 0 ? 40.0 : 1.5, stride);
                INFO(c.describe());
                const Matrix<T> q = to<T>(c.q), kp = to<T>(c.kp), vp = to<T>(c.vp),
                                ks = to<T>(c.ks), vs = to<T>(c.vs);
                const Eigen::Index D = static_cast<Eigen::Index>(c.H) * c.dh;
                Matrix<T> out = Matrix<T>::Constant(c.n, D, std::numeric_limits<T>::quiet_NaN());
                const T scale = T(1) / std::sqrt(static_cast<T>(c.dh));
                for (Eigen::Index i = 0; i < c.n; ++i) {
                    const long long pos = c.f + c.s * i;
                    for (int h = 0; h < c.H; ++h) {
                        const long long col = static_cast<long long>(h) * c.dh;
                        const titans::detail::AttentionRowOperands<T> a{
                            q.data() + i * D + col, kp.data() + col, vp.data() + col, c.p, D, D,
                            ks.data() + col, vs.data() + col,
                            std::max<long long>(0, pos - c.w + 1), pos, D, c.dh, scale};
                        titans::detail::attention_row(a, out.data() + i * D + col);
                    }
                }
                if (c.n > 0) {
                    CHECK(note_error<T>("attention: attention_row vs reference",
                                        rel_error(out, run_reference(c))) <= tol<T>());
                }
            }
        }
    }
}

// prefix_window_attention on a larger problem (many tiles; the OpenMP path when built with OpenMP)
TEMPLATE_TEST_CASE("window attn: large problem", "[attention]", float, double) {
    using T = TestType;
    for (int w : {50, 1000}) {
        Rng rng(seed_for("pwa larger", static_cast<std::uint64_t>(w)));
        CoreCase c;
        c.H = 4;
        c.dh = 16;
        c.w = w;
        c.p = 4;
        c.f = 7;
        c.n = 300;
        const Eigen::Index D = 64;
        c.q = round_through<T>(random_matrix(c.n, D, rng, -1.5, 1.5));
        c.kp = round_through<T>(random_matrix(c.p, D, rng, -1.5, 1.5));
        c.vp = round_through<T>(random_matrix(c.p, D, rng));
        c.ks = round_through<T>(random_matrix(c.f + c.n, D, rng, -1.5, 1.5));
        c.vs = round_through<T>(random_matrix(c.f + c.n, D, rng));
        INFO(c.describe());
        CHECK(note_error<T>("attention: prefix_window_attention vs reference",
                            rel_error(run_core<T>(c), run_reference(c))) <= tol<T>());
    }
}

// prefix_window_attention on views (blocks of larger matrices) equals the Matrix overload
TEMPLATE_TEST_CASE("window attn: on views", "[attention]", float, double) {
    using T = TestType;
    Rng rng(seed_for("pwa views"));
    const CoreCase c = make_core_case<T>(rng, 2);
    const Eigen::Index D = c.q.cols(), n = c.n;
    // Embed every input at an offset inside a wider, taller matrix.
    auto embed = [&](const Matrixd& m) {
        Matrix<T> big = to<T>(random_matrix(m.rows() + 3, D + 5, rng));
        big.block(2, 3, m.rows(), D) = to<T>(m);
        return big;
    };
    const Matrix<T> q = embed(c.q), kp = embed(c.kp), vp = embed(c.vp), ks = embed(c.ks),
                    vs = embed(c.vs);
    Matrix<T> big_out = Matrix<T>::Constant(n + 4, D + 2, T(7));
    titans::prefix_window_attention<T>(q.block(2, 3, n, D), kp.block(2, 3, c.p, D),
                                       vp.block(2, 3, c.p, D), ks.block(2, 3, c.ks.rows(), D),
                                       vs.block(2, 3, c.vs.rows(), D), c.H, c.dh, c.w, c.f,
                                       big_out.block(1, 1, n, D));
    INFO(c.describe());
    CHECK(rel_error(big_out.block(1, 1, n, D), run_core<T>(c)) <= tol<T>());
    // Nothing outside the output block was written.
    CHECK((big_out.row(0).array() == T(7)).all());
    CHECK((big_out.col(0).array() == T(7)).all());
    CHECK((big_out.col(D + 1).array() == T(7)).all());
}

// prefix_window_attention is numerically stable for very large scores
TEMPLATE_TEST_CASE("window attn: large scores", "[attention]", float, double) {
    using T = TestType;
    for (int i = 0; i < 6; ++i) {
        Rng rng(seed_for("pwa large scores", static_cast<std::uint64_t>(i)));
        const CoreCase c = make_core_case<T>(rng, 2, /*q_scale=*/400.0);
        INFO(c.describe());
        const Matrix<T> out = run_core<T>(c);
        REQUIRE(out.allFinite());
        if (c.n > 0) {
            // Scores of order 1e3 amplify the rounding of q.k by exp: a looser bound.
            CHECK(rel_error(out, run_reference(c)) <= (std::is_same_v<T, float> ? 2e-3 : 1e-9));
        }
    }
}

// window edges: positions w-1, w, w+1 match the reference; the key at distance w is not seen, the
// key at distance w-1 is
TEMPLATE_TEST_CASE("window attn: window edges", "[attention]", float, double) {
    using T = TestType;
    for (int w : {1, 2, 5, 16, 17, 40}) {
        for (int p : {0, 2}) {
            Rng rng(seed_for("pwa window edges", static_cast<std::uint64_t>(w * 10 + p)));
            CoreCase c;
            c.H = 2;
            c.dh = 3;
            c.w = w;
            c.p = p;
            c.f = 0;
            c.n = w + 2 + 20;  // positions up to w + 21 (several tiles for small windows)
            const Eigen::Index D = 6;
            c.q = round_through<T>(random_matrix(c.n, D, rng, -1.5, 1.5));
            c.kp = round_through<T>(random_matrix(p, D, rng));
            c.vp = round_through<T>(random_matrix(p, D, rng));
            c.ks = round_through<T>(random_matrix(c.n, D, rng, -1.5, 1.5));
            c.vs = round_through<T>(random_matrix(c.n, D, rng));
            INFO(c.describe());
            const Matrix<T> out = run_core<T>(c);
            const Matrixd ref = run_reference(c);
            for (Eigen::Index t : {w - 1, w, w + 1}) {
                INFO("position " << t);
                CHECK(rel_error(out.row(t), ref.row(t)) <= tol<T>());
            }
            for (Eigen::Index t : {static_cast<Eigen::Index>(w), static_cast<Eigen::Index>(w) + 1,
                                   static_cast<Eigen::Index>(w) + 19}) {
                INFO("query at position " << t);
                // Distance exactly w: key/value j = t - w is outside the window.
                CoreCase far = c;
                far.ks.row(t - w).array() += 0.75;
                far.vs.row(t - w).array() -= 0.5;
                const Matrix<T> out_far = run_core<T>(far);
                CHECK(identical(out_far.row(t), out.row(t)));
                // Distance w - 1: key/value j = t - w + 1 is the oldest one inside.
                CoreCase near = c;
                near.ks.row(t - w + 1).array() += 0.75;
                near.vs.row(t - w + 1).array() -= 0.5;
                const Matrix<T> out_near = run_core<T>(near);
                CHECK(attention_row_diff(out_near, out, t) > 1e-4);
                CHECK(rel_error(out_near, run_reference(near)) <= tol<T>());
            }
        }
    }
}

// prefix keys are visible to every query; sequence keys only causally
TEMPLATE_TEST_CASE("window attn: prefix keys", "[attention]", float, double) {
    using T = TestType;
    for (int w : {1, 3, 1000}) {
        Rng rng(seed_for("pwa prefix and causality", static_cast<std::uint64_t>(w)));
        CoreCase c;
        c.H = 2;
        c.dh = 4;
        c.w = w;
        c.p = 3;
        c.f = 0;
        c.n = 70;
        const Eigen::Index D = 8;
        c.q = round_through<T>(random_matrix(c.n, D, rng));
        c.kp = round_through<T>(random_matrix(c.p, D, rng));
        c.vp = round_through<T>(random_matrix(c.p, D, rng));
        c.ks = round_through<T>(random_matrix(c.n, D, rng));
        c.vs = round_through<T>(random_matrix(c.n, D, rng));
        INFO(c.describe());
        const Matrix<T> out = run_core<T>(c);

        // A prefix key: every output row changes.
        CoreCase pk = c;
        pk.kp.row(1).array() += 0.5;
        const Matrix<T> out_pk = run_core<T>(pk);
        for (Eigen::Index i = 0; i < c.n; ++i) {
            INFO("row " << i);
            CHECK(attention_row_diff(out_pk, out, i) > 1e-5);
        }

        // Sequence token j: rows before j unchanged; rows j .. j + w - 1 change; later unchanged.
        for (Eigen::Index j : {0, 17, 40, 69}) {
            CoreCase sj = c;
            sj.ks.row(j).array() += 0.5;
            sj.vs.row(j).array() += 0.5;
            const Matrix<T> out_sj = run_core<T>(sj);
            for (Eigen::Index i = 0; i < c.n; ++i) {
                INFO("perturbed token " << j << ", row " << i);
                if (i < j || i >= j + w) {
                    CHECK(identical(out_sj.row(i), out.row(i)));
                } else {
                    CHECK(attention_row_diff(out_sj, out, i) > 1e-5);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE

// apply_rope equals explicit 2x2 rotations at absolute positions
TEMPLATE_TEST_CASE("RoPE: 2x2 rotations", "[attention]", float, double) {
    using T = TestType;
    for (int i = 0; i < 8; ++i) {
        Rng rng(seed_for("rope rotations", static_cast<std::uint64_t>(i)));
        const int H = uniform_int(rng, 1, 3), dh = 2 * uniform_int(rng, 1, 4);
        const Eigen::Index rows = uniform_int(rng, 0, 12);
        const std::int64_t pos = pick(rng, std::vector<std::int64_t>{0, 5, 1000, 123456});
        const double base = pick(rng, std::vector<double>{10000.0, 500.0, 2.0});
        const Matrixd x = round_through<T>(random_matrix(rows, H * dh, rng));
        Matrix<T> y = to<T>(x);
        titans::apply_rope(y, H, dh, pos, base);
        INFO("H=" << H << " d_h=" << dh << " rows=" << rows << " pos=" << pos << " base=" << base);
        CHECK(rel_error(y, titans::reference::rope(x, H, dh, pos, base)) <= tol<T>());
        // Norm of every pair is preserved; position 0 is the identity.
        if (pos == 0 && rows > 0) {
            CHECK(identical(y.row(0), to<T>(x).row(0)));
        }
    }
    // Position 0 of a single token, first pair: angle 0. Position 1, first pair: angle 1 rad.
    Matrix<T> x(2, 2);
    x << T(1), T(0), T(1), T(0);
    titans::apply_rope(x, 1, 2, 0, 10000.0);
    CHECK(x(0, 0) == T(1));
    CHECK(x(0, 1) == T(0));
    CHECK(std::abs(static_cast<double>(x(1, 0)) - std::cos(1.0)) <= tol<T>());
    CHECK(std::abs(static_cast<double>(x(1, 1)) - std::sin(1.0)) <= tol<T>());
}

// RoPE scores depend only on the relative position
TEMPLATE_TEST_CASE("RoPE: relative position", "[attention]", float, double) {
    using T = TestType;
    Rng rng(seed_for("rope relative"));
    const int H = 2, dh = 8;
    for (int i = 0; i < 20; ++i) {
        const Matrix<T> q = to<T>(random_matrix(1, H * dh, rng));
        const Matrix<T> k = to<T>(random_matrix(1, H * dh, rng));
        const std::int64_t a = uniform_int(rng, 0, 50), b = uniform_int(rng, 0, 50);
        const std::int64_t s = uniform_int(rng, 1, 1000);
        auto scores = [&](std::int64_t pa, std::int64_t pb) {
            Matrix<T> qa = q, kb = k;
            titans::apply_rope(qa, H, dh, pa, 10000.0);
            titans::apply_rope(kb, H, dh, pb, 10000.0);
            Matrixd sc(1, H);
            for (int h = 0; h < H; ++h) {
                sc(0, h) = static_cast<double>(qa.row(0).segment(h * dh, dh).dot(kb.row(0).segment(h * dh, dh)));
            }
            return sc;
        };
        INFO("a=" << a << " b=" << b << " s=" << s);
        CHECK(rel_error(scores(a + s, b + s), scores(a, b)) <= 10 * tol<T>());
    }
}

// ---------------------------------------------------------------------------------------------
// The Attention layer

// Attention::forward equals the reference layer (RoPE, shared and per-sequence prefix, B = 2)
TEMPLATE_LIST_TEST_CASE("Attention: == reference", "[attention]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    for (int i = 0; i < 24; ++i) {
        Rng rng(seed_for("attention layer reference", static_cast<std::uint64_t>(i)));
        const int N = uniform_int(rng, 1, 40);
        const int window = pick(rng, std::vector<int>{1, 2, 5, 16, 100});
        const bool rope = (i % 2) == 1;
        const AttentionConfig cfg = random_attention_config(rng, rope, window);
        const auto pd = random_attention_params<T>(cfg, rng);
        const int B = 2;
        const Matrixd x = round_through<T>(random_matrix(B * N, cfg.d_model, rng));
        const int prefix_kind = (i / 2) % 3;  // none, shared, per sequence
        const int p = uniform_int(rng, 1, 4);
        const Matrixd prefix =
            round_through<T>(random_matrix(prefix_kind == 2 ? B * p : p, cfg.d_model, rng));
        const Matrixd* pref = prefix_kind == 0 ? nullptr : &prefix;

        Attention<T, Bk> attn(cfg, cast_attention_params<T>(pd));
        auto st = attn.make_state(B);
        const Matrix<T> prefix_t = to<T>(prefix);
        const Matrix<T> y = attn.forward(st, to<T>(x), pref ? &prefix_t : nullptr,
                                         prefix_kind == 2 ? PrefixSharing::PerSequence
                                                          : PrefixSharing::Shared);
        const Matrixd ref = titans::reference::attention_layer(cfg, pd, x, B, pref, prefix_kind == 2);
        INFO("d_model=" << cfg.d_model << " H=" << cfg.n_heads << " d_h=" << cfg.head_dim()
                        << " window=" << window << " rope=" << rope << " N=" << N
                        << " prefix_kind=" << prefix_kind);
        CHECK(note_error<T>("attention: layer vs reference", rel_error(y, ref)) <= tol<T>());
        CHECK(st.position() == N);
        CHECK(st.window_rows(0).first == std::min(window - 1, N));
    }
}

// Attention streamed token by token and in random pieces equals one call (B = 2)
TEMPLATE_LIST_TEST_CASE("Attention: streaming", "[attention]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    for (int i = 0; i < 16; ++i) {
        Rng rng(seed_for("attention streaming", static_cast<std::uint64_t>(i)));
        const int N = uniform_int(rng, 1, 45);
        const int window = pick(rng, std::vector<int>{1, 2, 3, 7, 20, 64});
        const AttentionConfig cfg = random_attention_config(rng, (i % 2) == 0, window);
        const auto pd = random_attention_params<T>(cfg, rng);
        const int B = 2;
        const Matrix<T> x = to<T>(random_matrix(B * N, cfg.d_model, rng));
        const Matrix<T> prefix = to<T>(random_matrix(uniform_int(rng, 0, 3), cfg.d_model, rng));
        const Matrix<T>* pref = (i % 4) < 2 ? &prefix : nullptr;
        Attention<T, Bk> attn(cfg, cast_attention_params<T>(pd));
        INFO("d_model=" << cfg.d_model << " H=" << cfg.n_heads << " window=" << window
                        << " rope=" << cfg.rope << " N=" << N);

        auto st_one = attn.make_state(B);
        const Matrix<T> y_one = attn.forward(st_one, x, pref);

        // Token by token.
        {
            auto st = attn.make_state(B);
            Matrix<T> y(B * N, cfg.d_model);
            for (int t = 0; t < N; ++t) {
                put_tokens(y, attn.forward(st, take_tokens(x, B, N, t, t + 1), pref), B, N, t, t + 1);
            }
            CHECK(note_error<T>("attention: token-by-token vs one call", rel_error(y, y_one)) <= tol<T>());
            CHECK(st.position() == N);
            if constexpr (std::is_same_v<Bk, titans::backend::Cpu>) {  // host-readable keys
                for (int b = 0; b < B; ++b) {
                    CHECK(rel_error(st.keys(b), st_one.keys(b)) <= tol<T>());
                    CHECK(rel_error(st.values(b), st_one.values(b)) <= tol<T>());
                }
            }
        }
        // Random pieces: empty, single tokens, pieces shorter and longer than the window.
        {
            auto st = attn.make_state(B);
            Matrix<T> y(B * N, cfg.d_model);
            int t = 0;
            while (t < N) {
                int len = 0;
                switch (uniform_int(rng, 0, 3)) {
                    case 0: len = 0; break;
                    case 1: len = 1; break;
                    case 2: len = uniform_int(rng, 1, window + 1); break;
                    default: len = uniform_int(rng, 1, 2 * window + 3); break;
                }
                len = std::min(len, N - t);
                const Matrix<T> piece = take_tokens(x, B, N, t, t + len);
                const Matrix<T> yp = attn.forward(st, piece, pref);
                REQUIRE(yp.rows() == B * len);
                put_tokens(y, yp, B, N, t, t + len);
                t += len;
            }
            CHECK(note_error<T>("attention: random pieces vs one call", rel_error(y, y_one)) <= tol<T>());
            CHECK(st.position() == N);
        }
    }
}

// Attention is causal: perturbing token j leaves earlier outputs and the other sequence unchanged
TEMPLATE_LIST_TEST_CASE("Attention: causal", "[attention]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    Rng rng(seed_for("attention layer causality"));
    const AttentionConfig cfg{.d_model = 8, .n_heads = 2, .window = 6, .rope = true};
    const Attention<T, Bk> attn(cfg, AttentionParams<T>::random(cfg, 5));
    const int B = 2, N = 30;
    const Matrix<T> x = to<T>(random_matrix(B * N, cfg.d_model, rng));
    const Matrix<T> prefix = to<T>(random_matrix(2, cfg.d_model, rng));
    auto st = attn.make_state(B);
    const Matrix<T> y = attn.forward(st, x, &prefix);
    for (int j : {0, 11, 29}) {
        Matrix<T> xj = x;
        xj.row(j).array() += T(0.5);  // sequence 0, token j
        auto sj = attn.make_state(B);
        const Matrix<T> yj = attn.forward(sj, xj, &prefix);
        for (int i = 0; i < N; ++i) {
            INFO("perturbed token " << j << ", row " << i);
            if (i < j || i >= j + cfg.window) {
                CHECK(identical(yj.row(i), y.row(i)));
            } else {
                CHECK(attention_row_diff(yj, y, i) > 1e-6);
            }
        }
        CHECK(identical(yj.bottomRows(N), y.bottomRows(N)));
    }
}

// ---------------------------------------------------------------------------------------------
// Basic layers

namespace {

/// The CUDA backend's attention schedule (backend/cuda/attention_kernels.cuh) on the CPU: the
/// fused QKV product, then the element functors of attention/attention_row.hpp run in a loop
/// where the GPU launches a thread per element, then W_O. The window buffers hold the whole
/// stream (cap rows per sequence), the kept rows starting at position - kept.
template <class T>
struct FunctorAttention {
    AttentionConfig cfg;
    AttentionParams<T> p;
    int B = 1;
    long long cap = 0, kept = 0;
    std::int64_t pos = 0;
    std::vector<T> k, v;

    template <class F>
    static void launch(long long n, const F& f) {
        for (long long i = 0; i < n; ++i) {
            f(static_cast<unsigned>(i));
        }
    }

    Matrix<T> forward(const Matrix<T>& x, const Matrix<T>& prefix, PrefixSharing sharing) {
        const long long D = cfg.inner_dim(), N = x.rows() / B, H = cfg.n_heads;
        const int dh = cfg.head_dim();
        Matrix<T> wqkv(cfg.d_model, 3 * D);
        wqkv << p.w_q, p.w_k, p.w_v;
        Matrix<T> qkv = x * wqkv;
        using Append = titans::detail::AppendWindow<T>;
        const Append append{qkv.data(), k.data(), v.data(), N, D, cap, pos};
        if (cfg.rope) {  // a thread rotates its pair of q and k, then appends it
            launch(x.rows() * H * (dh / 2),
                   titans::detail::RopeThen<T, Append>{
                       {qkv.data(), N, D, cfg.n_heads, dh, pos, cfg.rope_base}, append});
        } else {
            launch(B * N * D, append);
        }
        const Matrix<T> kp = prefix * p.w_k, vp = prefix * p.w_v;
        const bool shared = sharing == PrefixSharing::Shared;
        const long long np = shared ? prefix.rows() : prefix.rows() / B;
        Matrix<T> o(x.rows(), D);
        const long long first = pos - kept;  // the first kept row of every sequence's buffer
        launch(B * N * H,
               titans::detail::AttendRows<T>{qkv.data(), kp.rows() > 0 ? kp.data() : qkv.data(),
                                             vp.rows() > 0 ? vp.data() : qkv.data(), np, D, D,
                                             shared, k.data() + first * D, v.data() + first * D,
                                             cap, kept, N, D, cfg.n_heads, dh, cfg.window,
                                             T(1) / std::sqrt(static_cast<T>(dh)), o.data()});
        pos += N;
        kept = std::min<long long>(cfg.window - 1, pos);
        return o * p.w_o;
    }
};

}  // namespace

// The CUDA backend's attention functors (RoPE of the fused rows with the window append in one
// pass, a thread per (row, head)) run in loops equal the CPU layer: random configurations with and without
// RoPE, shared and per-sequence prefixes or none, streams in random pieces; random, constant,
// periodic, huge and tiny streams
TEMPLATE_TEST_CASE("Attention: device functors", "[attention]", float, double) {
    using T = TestType;
    for (int i = 0; i < 24; ++i) {
        Rng rng(seed_for("attention functors", static_cast<std::uint64_t>(i)));
        const int window = pick(rng, std::vector<int>{1, 2, 3, 5, 9, 64});
        const AttentionConfig cfg = random_attention_config(rng, i % 2 == 0, window);
        const AttentionParams<T> params = cast_attention_params<T>(random_attention_params<T>(cfg, rng));
        const Attention<T> layer(cfg, params);
        const int B = uniform_int(rng, 1, 3), N = uniform_int(rng, 1, 30), np = uniform_int(rng, 0, 3);
        FunctorAttention<T> dev{cfg, params, B, N + 1, 0, 0, {}, {}};
        dev.k.assign(static_cast<std::size_t>(B * (N + 1) * cfg.inner_dim()), T(0));
        dev.v = dev.k;
        const Matrix<T> x = to<T>(stream_kind(random_matrix(B * N, cfg.d_model, rng, -2.0, 2.0), B, i));
        const Matrix<T> shared = to<T>(random_matrix(np, cfg.d_model, rng));
        const Matrix<T> per_seq = to<T>(random_matrix(B * np, cfg.d_model, rng));
        auto st = layer.make_state(B);
        INFO("case " << i << " window " << window << " rope " << cfg.rope << " B " << B << " N " << N);
        int t0 = 0;
        for (int len : random_pieces(rng, N, window)) {
            const Matrix<T> piece = take_tokens(x, B, N, t0, t0 + len);
            const bool per = (t0 + len) % 2 == 1;
            const Matrix<T>& prefix = per ? per_seq : shared;
            const PrefixSharing sharing = per ? PrefixSharing::PerSequence : PrefixSharing::Shared;
            const Matrix<T> want = layer.forward(st, piece, &prefix, sharing);
            CHECK(rel_error(dev.forward(piece, prefix, sharing), want) <= tol<T>());
            t0 += len;
        }
    }
}

// MAC's segment attention as the CUDA backend schedules it (backend/cuda/attention_kernels.cuh:
// fused QKV of the part, [K | V] of its reads, RoPE, the SegmentAppend and SegmentRows functors
// run in loops where the GPU launches a thread per element, then W_O) equals the host's
// (detail::segment_attention, the CPU kernel): outputs and segment buffers, parts at every
// offset of random segments, with and without RoPE and a prefix, random and hostile rows.
TEMPLATE_TEST_CASE("Attention: segment functors", "[attention]", float, double) {
    using T = TestType;
    const auto launch = [](long long n, const auto& f) {
        for (long long i = 0; i < n; ++i) f(static_cast<unsigned>(i));
    };
    for (int i = 0; i < 16; ++i) {
        Rng rng(seed_for("attention segment functors", static_cast<std::uint64_t>(i)));
        const AttentionConfig cfg = random_attention_config(rng, i % 2 == 0, 4);
        const AttentionParams<T> p = cast_attention_params<T>(random_attention_params<T>(cfg, rng));
        const int B = uniform_int(rng, 1, 3), C = uniform_int(rng, 1, 6), np = uniform_int(rng, 0, 3);
        const long long D = cfg.inner_dim(), H = cfg.n_heads;
        const int dh = cfg.head_dim();
        const Matrix<T> prefix = to<T>(random_matrix(np, cfg.d_model, rng));
        const Matrix<T> kp = prefix * p.w_k, vp = prefix * p.w_v;
        Matrix<T> host_k = to<T>(random_matrix(B * 2 * C, D, rng)), host_v = host_k;
        Matrix<T> dev_k = host_k, dev_v = host_v;
        std::int64_t pos = uniform_int(rng, 0, 40);
        for (int part = 0; part < 4; ++part) {
            const int off = static_cast<int>(pos % C), m = uniform_int(rng, 1, C - off);
            INFO("case " << i << " part " << part << " C " << C << " offset " << off << " m " << m);
            const Matrix<T> u = to<T>(stream_kind(random_matrix(B * m, cfg.d_model, rng, -2.0, 2.0), B, i));
            const Matrix<T> h = to<T>(random_matrix(B * m, cfg.d_model, rng));
            const Matrix<T> want = titans::detail::segment_attention<T>(
                cfg, p, u, h, kp, vp, host_k, host_v, B, C, off, pos);
            Matrix<T> wqkv(cfg.d_model, 3 * D), wkv(cfg.d_model, 2 * D);
            wqkv << p.w_q, p.w_k, p.w_v;
            wkv << p.w_k, p.w_v;
            Matrix<T> qkv = u * wqkv;
            const Matrix<T> kvh = h * wkv;
            using Append = titans::detail::SegmentAppend<T>;
            const Append append{qkv.data(), kvh.data(), dev_k.data(), dev_v.data(), D, 2LL * C,
                                m, off, D};
            if (cfg.rope) {
                launch(B * m * H * (dh / 2),
                       titans::detail::RopeThen<T, Append>{
                           {qkv.data(), m, D, cfg.n_heads, dh, pos, cfg.rope_base}, append});
            } else {
                launch(B * m * D, append);
            }
            Matrix<T> o(B * m, D);
            launch(B * m * H, titans::detail::SegmentRows<T>{
                                  qkv.data(), np > 0 ? kp.data() : qkv.data(),
                                  np > 0 ? vp.data() : qkv.data(), np, D, D, dev_k.data(),
                                  dev_v.data(), D, 2LL * C, m, off, D, cfg.n_heads, dh,
                                  T(1) / std::sqrt(static_cast<T>(dh)), o.data()});
            CHECK(rel_error(Matrix<T>(o * p.w_o), want) <= tol<T>());
            CHECK(rel_error(dev_k, host_k) <= tol<T>());
            CHECK(rel_error(dev_v, host_v) <= tol<T>());
            pos += m;
        }
    }
}


namespace {

using titans::view_of;

/// The inputs of one MAC part's segment attention (attention/segment_backward.hpp's test).
struct SegmentInputs {
    AttentionParams<double> p;
    Matrixd u, h, kept_k, kept_v, P;
};

/// L = Σ dy ⊙ y + Σ ak ⊙ (each stream's buffer keys, rows [0, n)) + Σ av ⊙ (its values) of
/// the library's segment forward on x: the loss whose gradient segment_backward gives.
double segment_loss(const AttentionConfig& cfg, const SegmentInputs& x, int B, int C, int o,
                    std::int64_t pos, const Matrixd& dy, const Matrixd& ak, const Matrixd& av) {
    const Attention<double> attn(cfg, x.p);
    const Eigen::Index m = x.u.rows() / B, n = 2 * (o + m), D = cfg.inner_dim();
    const Matrixd kp = x.P * x.p.w_k, vp = x.P * x.p.w_v;
    Matrixd sk = Matrixd::Zero(B * 2 * C, D), sv = sk, y(B * m, cfg.d_model);
    for (int b = 0; b < B; ++b) {
        sk.middleRows(b * 2 * C, 2 * o) = x.kept_k.middleRows(b * 2 * o, 2 * o);
        sv.middleRows(b * 2 * C, 2 * o) = x.kept_v.middleRows(b * 2 * o, 2 * o);
    }
    attn.segment(titans::SegmentCall<double>{view_of(x.u), view_of(x.h), view_of(sk), view_of(sv),
                                     titans::PrefixView<double>{view_of(kp), view_of(vp)}, view_of(y), B,
                                     C, o, static_cast<int>(m), pos});
    double L = (dy.array() * y.array()).sum();
    for (int b = 0; b < B && ak.rows() > 0; ++b) {
        L += (ak.middleRows(b * n, n).array() * sk.middleRows(b * 2 * C, n).array()).sum() +
             (av.middleRows(b * n, n).array() * sv.middleRows(b * 2 * C, n).array()).sum();
    }
    return L;
}

}  // namespace

// Attention::segment_backward (MAC's segment attention reversed, attention/segment_backward.hpp)
// against central differences of the library's own segment forward in double: each input (u,
// h, the kept rows, W_Q, W_K, W_V, W_O, P) moved along a random direction, with and without
// RoPE, a prefix and the later rows' adjoint, at every offset of random segments, batches 1-3,
// on constant, periodic and tiny rows too (huge ones saturate the softmax past what central
// differences resolve; the host form's own FD checks are MAC's block tests).
TEST_CASE("Attention: segment backward vs FD", "[attention][backward]") {
    for (int i = 0; i < 24; ++i) {
        Rng rng(seed_for("attention segment backward", static_cast<std::uint64_t>(i)));
        const AttentionConfig cfg = random_attention_config(rng, i % 2 == 0, 4);
        const int B = uniform_int(rng, 1, 3), C = uniform_int(rng, 1, 6),
                  np = i % 3 == 0 ? 0 : uniform_int(rng, 1, 3);
        const int o = uniform_int(rng, 0, C - 1), m = uniform_int(rng, 1, C - o);
        const std::int64_t pos = static_cast<std::int64_t>(C) * uniform_int(rng, 0, 5) + o;
        const Eigen::Index D = cfg.inner_dim(), d = cfg.d_model, n = 2 * (o + m);
        SegmentInputs x{AttentionParams<double>::random(cfg, rng()),
                        stream_kind(random_matrix(B * m, d, rng, -2.0, 2.0), B, i % 5 == 3 ? 0 : i),
                        random_matrix(B * m, d, rng), random_matrix(B * 2 * o, D, rng),
                        random_matrix(B * 2 * o, D, rng), random_matrix(np, d, rng)};
        const Matrixd dy = random_matrix(B * m, d, rng);
        const bool later = i % 4 != 1;
        const Matrixd ak = later ? random_matrix(B * n, D, rng) : Matrixd(),
                      av = later ? random_matrix(B * n, D, rng) : Matrixd();
        INFO("case " << i << " B " << B << " C " << C << " o " << o << " m " << m << " np " << np
                     << " rope " << cfg.rope);
        const Attention<double> attn(cfg, x.p);
        const Matrixd kp = x.P * x.p.w_k, vp = x.P * x.p.w_v;
        Matrixd du(B * m, d), dh(B * m, d), dkk(B * 2 * o, D), dkv(B * 2 * o, D);
        Matrixd grads = Matrixd::Constant(1, 4 * d * D, 0.25), dP = Matrixd::Constant(np, d, 0.5);
        attn.segment_backward(titans::SegmentBackwardCall<double>{
            view_of(x.u), view_of(x.h), view_of(dy), view_of(x.kept_k), view_of(x.kept_v),
            view_of(ak), view_of(av), titans::PrefixView<double>{view_of(kp), view_of(vp)}, view_of(x.P),
            view_of(du), view_of(dh), view_of(dkk), view_of(dkv), view_of(grads), view_of(dP), B,
            C, o, m, pos});
        grads.array() -= 0.25;  // added to
        dP.array() -= 0.5;
        const auto block = [&](int k, Eigen::Index r, Eigen::Index c) {
            return Matrixd(Eigen::Map<const Matrixd>(grads.data() + k * d * D, r, c));
        };
        const std::vector<std::pair<Matrixd*, Matrixd>> parts = {
            {&x.u, du},          {&x.h, dh},          {&x.kept_k, dkk},    {&x.kept_v, dkv},
            {&x.p.w_q, block(0, d, D)}, {&x.p.w_k, block(1, d, D)}, {&x.p.w_v, block(2, d, D)},
            {&x.p.w_o, block(3, D, d)}, {&x.P, dP}};
        const double eps = 1e-5;
        for (std::size_t k = 0; k < parts.size(); ++k) {
            Matrixd* in = parts[k].first;
            if (in->size() == 0) continue;
            const Matrixd dir = random_matrix(in->rows(), in->cols(), rng), saved = *in;
            *in = saved + eps * dir;
            const double up = segment_loss(cfg, x, B, C, o, pos, dy, ak, av);
            *in = saved - eps * dir;
            const double down = segment_loss(cfg, x, B, C, o, pos, dy, ak, av);
            *in = saved;
            const double fd = (up - down) / (2 * eps), an = (parts[k].second.array() * dir.array()).sum();
            INFO("input " << k);
            CHECK(std::abs(fd - an) <= 1e-7 * std::max(1.0, std::abs(an)));
        }
    }
}


// Attention::segment and segment_backward refuse a call they cannot run (each count out of
// range, each view of the wrong shape, with a null pointer or a short stride, an output
// sharing storage with an input or another output, a per-sequence prefix), naming the field
// and leaving every output as it was; the same calls well formed run.
TEST_CASE("Attention: segment calls refused", "[attention][errors]") {
    using titans::SegmentBackwardCall;
    using titans::SegmentCall;
    using titans::View;
    Rng rng(seed_for("attention segment calls refused"));
    const AttentionConfig cfg = random_attention_config(rng, true, 4);
    const Attention<double> attn(cfg, AttentionParams<double>::random(cfg, rng()));
    const int B = 2, C = 4, o = 1, m = 2, np = 2;
    const Eigen::Index d = cfg.d_model, D = cfg.inner_dim();
    const Matrixd u = random_matrix(B * m, d, rng), h = random_matrix(B * m, d, rng),
                  dy = random_matrix(B * m, d, rng), P = random_matrix(np, d, rng),
                  kp = random_matrix(np, D, rng), vp = random_matrix(np, D, rng),
                  kk = random_matrix(B * 2 * o, D, rng), kv = random_matrix(B * 2 * o, D, rng),
                  ak = random_matrix(B * 2 * (o + m), D, rng), av = ak;
    Matrixd y = random_matrix(B * m, d, rng), sk = random_matrix(B * 2 * C, D, rng),
            sv = random_matrix(B * 2 * C, D, rng), du = y, dh = y, dkk = kk, dkv = kv,
            g = random_matrix(1, attn.parameter_count(), rng), dP = P;
    const titans::PrefixView<double> pre{view_of(kp), view_of(vp)};
    const SegmentCall<double> fwd{view_of(u), view_of(h), view_of(sk), view_of(sv), pre,
                                  view_of(y),  B,          C,           o,           m, 5};
    const SegmentBackwardCall<double> bwd{
        view_of(u),   view_of(h),   view_of(dy),  view_of(kk),  view_of(kv), view_of(ak),
        view_of(av),  pre,          view_of(P),   view_of(du),  view_of(dh), view_of(dkk),
        view_of(dkv), view_of(g),   view_of(dP),  B,            C,           o, m, 5};
    const std::vector<Matrixd> before = {y, sk, sv, du, dh, dkk, dkv, g, dP};
    const auto unchanged = [&] {
        const std::vector<Matrixd> now = {y, sk, sv, du, dh, dkk, dkv, g, dP};
        for (std::size_t i = 0; i < now.size(); ++i) {
            if (!identical(now[i], before[i])) return false;
        }
        return true;
    };
    const auto short_rows = [](View<double> v) { return View<double>{v.data, v.rows - 1, v.cols, v.stride}; };
    const auto narrow = [](View<const double> v) { return View<const double>{v.data, v.rows, v.cols - 1, v.stride}; };
    // The forward: counts, shapes, layout, distinctness, sharing.
    const std::vector<std::tuple<std::function<void(SegmentCall<double>&)>, bool, std::string>> f = {
        {[](auto& c) { c.batch = 0; }, false, "batch = 0"},
        {[](auto& c) { c.segment = 0; }, false, "segment = 0"},
        {[](auto& c) { c.rows = 0; }, false, "rows = 0"},
        {[](auto& c) { c.offset = -1; }, false, "offset = -1"},
        {[](auto& c) { c.offset = 3; }, false, "offset = 3"},
        {[](auto& c) { c.position = -1; }, false, "position = -1"},
        {[&](auto& c) { c.u = narrow(c.u); }, true, "u is"},
        {[&](auto& c) { c.h = View<const double>{c.h.data, c.h.rows + 1, c.h.cols, c.h.stride}; }, true, "h is"},
        {[&](auto& c) { c.y = short_rows(c.y); }, true, "y is"},
        {[&](auto& c) { c.seg_k = short_rows(c.seg_k); }, true, "seg_k is"},
        {[&](auto& c) { c.seg_v.data = nullptr; }, true, "seg_v has a null pointer"},
        {[&](auto& c) { c.seg_k.stride = 1; }, true, "seg_k has a null pointer or a row stride of 1"},
        {[&](auto& c) { c.prefix.v = narrow(c.prefix.v); }, true, "prefix.v is"},
        {[&](auto& c) { c.prefix.sharing = PrefixSharing::PerSequence; }, false, "prefix.sharing"},
        {[&](auto& c) { c.y = View<double>{const_cast<double*>(c.u.data), c.y.rows, c.y.cols, c.y.stride}; }, true, "y shares storage with u"},
        {[&](auto& c) { c.seg_v = c.seg_k; }, true, "seg_k shares storage with seg_v"},
    };
    // Each case: the well-formed call changed, then refused (ShapeError or ConfigError).
    const auto refused = [&](const auto& base, const auto& cases, const auto& call) {
        for (const auto& [mutate, shape, text] : cases) {
            INFO(text);
            auto c = base;
            mutate(c);
            if (shape) {
                REQUIRE_THROWS_NAMING(call(c), ShapeError, text);
            } else {
                REQUIRE_THROWS_NAMING(call(c), ConfigError, text);
            }
            CHECK(unchanged());
        }
    };
    refused(fwd, f, [&](const SegmentCall<double>& c) { attn.segment(c); });
    // The backward: the optional views, grads, the outputs' distinctness.
    const std::vector<std::tuple<std::function<void(SegmentBackwardCall<double>&)>, bool, std::string>> b = {
        {[](auto& c) { c.offset = 3; }, false, "offset = 3"},
        {[&](auto& c) { c.dy = narrow(c.dy); }, true, "dy is"},
        {[&](auto& c) { c.kept_k = View<const double>{}; }, true, "kept_k is 0 x 0"},
        {[&](auto& c) { c.after_v = View<const double>{}; }, true, "after_v is 0 x 0"},
        {[&](auto& c) { c.after_k = narrow(c.after_k); }, true, "after_k is"},
        {[&](auto& c) { c.persistent = narrow(c.persistent); }, true, "persistent is"},
        {[&](auto& c) { c.dkept_v = View<double>{}; }, true, "dkept_v is 0 x 0"},
        {[&](auto& c) { c.grads = View<double>{c.grads.data, 1, c.grads.cols - 1, c.grads.cols}; }, true, "grads is"},
        {[&](auto& c) { c.dpersistent = View<double>{}; }, true, "dpersistent is 0 x 0"},
        {[&](auto& c) { c.du = View<double>{const_cast<double*>(c.dy.data), c.du.rows, c.du.cols, c.du.stride}; }, true, "du shares storage with dy"},
        {[&](auto& c) { c.dh = c.du; }, true, "du shares storage with dh"},
        {[&](auto& c) { c.dpersistent = View<double>{const_cast<double*>(c.persistent.data), np, d, d}; }, true, "dpersistent shares storage with persistent"},
    };
    refused(bwd, b, [&](const SegmentBackwardCall<double>& c) { attn.segment_backward(c); });
    // Well formed: both run; without the later rows' adjoint and the kept rows' too.
    attn.segment(fwd);
    CHECK_FALSE(identical(y, before[0]));
    attn.segment_backward(bwd);
    SegmentBackwardCall<double> lean = bwd;
    lean.after_k = lean.after_v = View<const double>{};
    lean.dkept_k = lean.dkept_v = View<double>{};
    attn.segment_backward(lean);
    CHECK(g.allFinite());
}

// RMSNorm equals a hand-computed value and the loop reference
TEMPLATE_LIST_TEST_CASE("RMSNorm: == reference", "[layers]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    // x = (3, 4): mean(x^2) = 12.5; weight (1, 2).
    RowVector<T> wgt(2);
    wgt << T(1), T(2);
    const RMSNorm<T, Bk> norm(wgt, 1e-6);
    Matrix<T> x(1, 2);
    x << T(3), T(4);
    const Matrix<T> y = norm.forward(x);
    const double rms = std::sqrt(12.5 + 1e-6);
    CHECK(std::abs(static_cast<double>(y(0, 0)) - 3.0 / rms) <= tol<T>());
    CHECK(std::abs(static_cast<double>(y(0, 1)) - 8.0 / rms) <= tol<T>());

    Rng rng(seed_for("rms norm"));
    const Matrixd xr = round_through<T>(random_matrix(7, 13, rng, -3, 3));
    const Matrixd wr = round_through<T>(random_matrix(1, 13, rng));
    RMSNorm<T, Bk> n2(13);
    CHECK(n2.dim() == 13);
    CHECK((n2.weight().array() == T(1)).all());
    n2.set_weight(to<T>(wr));
    CHECK(note_error<T>("layers: RMSNorm vs reference",
                        rel_error(n2.forward(to<T>(xr)), titans::reference::rms_norm(xr, wr, 1e-6))) <= tol<T>());
    // In place.
    Matrix<T> xi = to<T>(xr);
    n2.forward(xi, xi);
    CHECK(rel_error(xi, titans::reference::rms_norm(xr, wr, 1e-6)) <= tol<T>());
}

// FeedForward (SwiGLU and GELU) equals the loop reference
TEMPLATE_LIST_TEST_CASE("FeedForward: == reference", "[layers]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    CHECK(FeedForwardConfig{.d_model = 64}.hidden_dim() == 176);
    CHECK(FeedForwardConfig{.d_model = 512}.hidden_dim() == 1368);
    CHECK(FeedForwardConfig{.d_model = 64, .kind = FeedForwardKind::GELU}.hidden_dim() == 256);
    CHECK(FeedForwardConfig{.d_model = 64, .hidden = 10}.hidden_dim() == 10);
    for (FeedForwardKind kind : {FeedForwardKind::SwiGLU, FeedForwardKind::GELU}) {
        for (int i = 0; i < 3; ++i) {
            Rng rng(seed_for(std::string("feed forward ") + titans::to_string(kind),
                             static_cast<std::uint64_t>(i)));
            const FeedForwardConfig cfg{.d_model = uniform_int(rng, 1, 12), .kind = kind,
                                        .hidden = i == 0 ? 0 : uniform_int(rng, 1, 20)};
            const auto p = FeedForwardParams<double>::random(cfg, rng());
            FeedForwardParams<double> pd;
            pd.w1 = round_through<T>(p.w1);
            pd.w3 = round_through<T>(p.w3);
            pd.w2 = round_through<T>(p.w2);
            FeedForwardParams<T> pt;
            pt.w1 = to<T>(pd.w1);
            pt.w3 = to<T>(pd.w3);
            pt.w2 = to<T>(pd.w2);
            const FeedForward<T, Bk> ff(cfg, pt);
            const Matrixd x = round_through<T>(random_matrix(uniform_int(rng, 0, 9), cfg.d_model, rng, -2, 2));
            const Matrix<T> y = ff.forward(to<T>(x));
            INFO(titans::to_string(kind) << " d=" << cfg.d_model << " h=" << cfg.hidden_dim());
            REQUIRE(y.rows() == x.rows());
            REQUIRE(y.cols() == cfg.d_model);
            if (x.rows() > 0) {
                CHECK(note_error<T>(std::string("layers: FeedForward ") + titans::to_string(kind),
                                    rel_error(y, titans::reference::feed_forward(cfg, pd, x))) <= tol<T>());
            }
        }
    }
}

// PersistentMemory: seeded tokens, prepend for one and several sequences
TEMPLATE_TEST_CASE("PersistentMemory: prepend", "[layers]", float, double) {
    using T = TestType;
    const auto P = PersistentMemory<T>::random(3, 5, 42);
    CHECK(P.size() == 3);
    CHECK(P.d_model() == 5);
    CHECK(identical(P.tokens(), PersistentMemory<T>::random(3, 5, 42).tokens()));
    CHECK_FALSE(identical(P.tokens(), PersistentMemory<T>::random(3, 5, 43).tokens()));
    Rng rng(seed_for("persistent memory"));
    const Matrix<T> x = to<T>(random_matrix(2 * 4, 5, rng));
    const Matrix<T> one = P.prepend(x.topRows(4).eval());
    REQUIRE(one.rows() == 7);
    CHECK(identical(one.topRows(3), P.tokens()));
    CHECK(identical(one.bottomRows(4), x.topRows(4)));
    const Matrix<T> two = P.prepend(x, 2);
    REQUIRE(two.rows() == 14);
    CHECK(identical(two.middleRows(0, 3), P.tokens()));
    CHECK(identical(two.middleRows(3, 4), x.topRows(4)));
    CHECK(identical(two.middleRows(7, 3), P.tokens()));
    CHECK(identical(two.middleRows(10, 4), x.bottomRows(4)));
    // No persistent memory at all.
    const auto none = PersistentMemory<T>::random(0, 5, 1);
    CHECK(identical(none.prepend(x), x));
}

// ---------------------------------------------------------------------------------------------
// Errors

// attention and layer errors throw the right types and name the argument
TEMPLATE_TEST_CASE("attention and layer errors", "[attention][layers]", float, double) {
    using T = TestType;
    // Configurations.
    REQUIRE_THROWS_NAMING((AttentionConfig{.d_model = 0}.validate()), ConfigError, "d_model");
    REQUIRE_THROWS_NAMING((AttentionConfig{.d_model = 6, .n_heads = 4}.validate()), ConfigError, "d_model");
    REQUIRE_THROWS_NAMING((AttentionConfig{.n_heads = 0}.validate()), ConfigError, "n_heads");
    REQUIRE_THROWS_NAMING((AttentionConfig{.window = 0}.validate()), ConfigError, "window");
    REQUIRE_THROWS_NAMING((AttentionConfig{.d_model = 6, .n_heads = 2, .rope = true}.validate()),
                          ConfigError, "d_head");
    REQUIRE_THROWS_NAMING((AttentionConfig{.rope = true, .rope_base = 0.0}.validate()), ConfigError,
                          "rope_base");
    // Parameters.
    const AttentionConfig cfg{.d_model = 8, .n_heads = 2, .window = 4, .rope = true};
    auto bad = AttentionParams<T>::random(cfg, 1);
    bad.w_k.resize(8, 3);
    REQUIRE_THROWS_NAMING((Attention<T>(cfg, bad)), ShapeError, "w_k");
    auto nan = AttentionParams<T>::random(cfg, 1);
    nan.w_o(1, 1) = std::numeric_limits<T>::quiet_NaN();
    REQUIRE_THROWS_NAMING((Attention<T>(cfg, nan)), NonFiniteError, "w_o");
    // The layer.
    const Attention<T> attn(cfg, AttentionParams<T>::random(cfg, 1));
    REQUIRE_THROWS_NAMING(attn.make_state(0), ConfigError, "batch");
    auto st = attn.make_state(2);
    REQUIRE_THROWS_NAMING(attn.forward(st, Matrix<T>::Zero(4, 7)), ShapeError, "x");
    REQUIRE_THROWS_NAMING(attn.forward(st, Matrix<T>::Zero(3, 8)), ShapeError, "batch");
    Matrix<T> xn = Matrix<T>::Zero(4, 8);
    xn(2, 3) = std::numeric_limits<T>::infinity();
    REQUIRE_THROWS_NAMING(attn.forward(st, xn), NonFiniteError, "x");
    const Matrix<T> pw = Matrix<T>::Zero(2, 5);
    REQUIRE_THROWS_NAMING(attn.forward(st, Matrix<T>::Zero(4, 8), &pw), ShapeError, "prefix");
    const Matrix<T> p3 = Matrix<T>::Zero(3, 8);
    REQUIRE_THROWS_NAMING(attn.forward(st, Matrix<T>::Zero(4, 8), &p3, PrefixSharing::PerSequence),
                          ShapeError, "prefix");
    const AttentionConfig other{.d_model = 8, .n_heads = 2, .window = 5, .rope = true};
    auto st_other = Attention<T>(other, AttentionParams<T>::random(other, 1)).make_state(2);
    REQUIRE_THROWS_NAMING(attn.forward(st_other, Matrix<T>::Zero(4, 8)), ConfigError, "state");
    titans::AttentionState<T> st_default;
    REQUIRE_THROWS_NAMING(attn.forward(st_default, Matrix<T>::Zero(4, 8)), ConfigError, "state");
    CHECK(st.position() == 0);  // failed calls leave the state alone
    // The core primitive.
    const Matrix<T> q = Matrix<T>::Zero(3, 6), k = Matrix<T>::Zero(4, 6), e(0, 6);
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention(q, e, e, k, k, 2, 3, 2, 2), ShapeError,
                          "k_seq.rows()");
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention(q, e, e, k, k, 2, 3, 0, 0), ConfigError,
                          "window");
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention(q, e, e, k, k, 2, 2, 1, 0), ShapeError,
                          "q");
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention(q, k, e, k, k, 2, 3, 1, 0), ShapeError,
                          "v_prefix.rows()");
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention(q, e, e, k, k.topRows(3).eval(), 2, 3, 1, 0),
                          ShapeError, "v_seq.rows()");
    Matrix<T> small_out(2, 6);
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention<T>(q, e, e, k, k, 2, 3, 1, 0,
                                                             Eigen::Ref<Matrix<T>>(small_out)),
                          ShapeError, "out");
    Matrix<T> alias = q;
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention(alias, e, e, k, k, 2, 3, 1, 0, alias),
                          ShapeError, "out");
    // RoPE.
    Matrix<T> r = Matrix<T>::Zero(2, 6);
    REQUIRE_THROWS_NAMING(titans::apply_rope(r, 2, 3, 0, 10000.0), ConfigError, "d_head");
    REQUIRE_THROWS_NAMING(titans::apply_rope(r, 2, 4, 0, 10000.0), ShapeError, "x");
    REQUIRE_THROWS_NAMING(titans::apply_rope(r, 3, 2, -1, 10000.0), ConfigError, "first_position");
    // RMSNorm.
    REQUIRE_THROWS_NAMING(RMSNorm<T>(4, 0.0), ConfigError, "eps");
    REQUIRE_THROWS_NAMING(RMSNorm<T>(0), ConfigError, "d_model");
    const RMSNorm<T> norm(4);
    REQUIRE_THROWS_NAMING(norm.forward(Matrix<T>::Zero(2, 3)), ShapeError, "x");
    Matrix<T> xr = Matrix<T>::Zero(2, 4);
    xr(1, 1) = std::numeric_limits<T>::quiet_NaN();
    REQUIRE_THROWS_NAMING(norm.forward(xr), NonFiniteError, "x");
    // FeedForward.
    REQUIRE_THROWS_NAMING((FeedForwardConfig{.hidden = -1}.validate()), ConfigError, "hidden");
    const FeedForwardConfig fcfg{.d_model = 4, .kind = FeedForwardKind::SwiGLU, .hidden = 6};
    auto fp = FeedForwardParams<T>::random(fcfg, 2);
    fp.w3.resize(0, 0);
    REQUIRE_THROWS_NAMING((FeedForward<T>(fcfg, fp)), ShapeError, "w3");
    const FeedForward<T> ff(fcfg, FeedForwardParams<T>::random(fcfg, 2));
    REQUIRE_THROWS_NAMING(ff.forward(Matrix<T>::Zero(1, 5)), ShapeError, "x");
    // PersistentMemory.
    REQUIRE_THROWS_NAMING(PersistentMemory<T>::random(-1, 4, 0), ConfigError, "n_tokens");
    const auto P = PersistentMemory<T>::random(2, 4, 0);
    REQUIRE_THROWS_NAMING(P.prepend(Matrix<T>::Zero(3, 5)), ShapeError, "x");
    REQUIRE_THROWS_NAMING(P.prepend(Matrix<T>::Zero(3, 4), 2), ShapeError, "batch");
}
