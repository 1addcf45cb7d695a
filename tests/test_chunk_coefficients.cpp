// The closed-form chunk coefficients (math §4): chunk_end_coefficients and
// chunk_row_coefficients against a brute-force evaluation of the math §4 sums (every product
// computed directly, in double), for random gates including exact 0 and 1 values of eta and
// alpha; and against running the scalar recurrence of math §3 token by token.
#include "test_common.hpp"

using namespace titans_test;

namespace {

/// Gates of one chunk of n tokens. eta and alpha are exactly 0 or 1 with probability 0.2 each.
struct ChunkGates {
    std::vector<double> theta, eta, alpha;
};

ChunkGates random_gates(Rng& rng, int n, bool extremes) {
    ChunkGates g;
    auto gate = [&](double lo, double hi) {
        const int r = uniform_int(rng, 0, 9);
        if (extremes && r < 2) return 0.0;
        if (extremes && r < 4) return 1.0;
        return uniform(rng, lo, hi);
    };
    for (int i = 0; i < n; ++i) {
        g.theta.push_back(uniform(rng, 0.01, 1.0));
        g.eta.push_back(gate(0.0, 1.0));
        g.alpha.push_back(gate(0.0, 1.0));
    }
    return g;
}

/// prod_{j=a..b} f[j] (1 if a > b).
double prod(const std::vector<double>& f, int a, int b) {
    double p = 1.0;
    for (int j = a; j <= b; ++j) p *= f[static_cast<std::size_t>(j)];
    return p;
}

/// math §4 by its definitions, 0-based: P_i = prod_{j<=i} eta_j, beta_i = prod_{j<=i}(1-alpha_j),
/// c_i = sum_{m<=i} (beta_i/beta_m) P_m, G_ik = theta_k sum_{m=k..i} (beta_i/beta_m)(P_m/P_k),
/// with every ratio of products written as the product over the indices in between (no division).
struct BruteForce {
    std::vector<double> P, beta, c;
    Matrixd G;  // n x n, 0 above the diagonal
    std::vector<double> s_end;  // theta_k prod_{j=k+1..n-1} eta_j
};

BruteForce brute_force(const ChunkGates& g) {
    const int n = static_cast<int>(g.theta.size());
    std::vector<double> decay(static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j) decay[static_cast<std::size_t>(j)] = 1.0 - g.alpha[static_cast<std::size_t>(j)];
    BruteForce r;
    r.G = Matrixd::Zero(n, n);
    for (int i = 0; i < n; ++i) {
        r.P.push_back(prod(g.eta, 0, i));
        r.beta.push_back(prod(decay, 0, i));
        double c = 0.0;
        for (int m = 0; m <= i; ++m) c += prod(decay, m + 1, i) * prod(g.eta, 0, m);
        r.c.push_back(c);
        for (int k = 0; k <= i; ++k) {
            double s = 0.0;
            for (int m = k; m <= i; ++m) s += prod(decay, m + 1, i) * prod(g.eta, k + 1, m);
            r.G(i, k) = g.theta[static_cast<std::size_t>(k)] * s;
        }
    }
    for (int k = 0; k < n; ++k) {
        r.s_end.push_back(g.theta[static_cast<std::size_t>(k)] * prod(g.eta, k + 1, n - 1));
    }
    return r;
}

template <class T>
std::vector<T> as(const std::vector<double>& v) {
    return std::vector<T>(v.begin(), v.end());
}
template <class T>
std::vector<double> back(const std::vector<T>& v) {
    return std::vector<double>(v.begin(), v.end());
}
double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
    Matrixd ma = Eigen::Map<const Matrixd>(a.data(), 1, static_cast<Eigen::Index>(a.size()));
    Matrixd mb = Eigen::Map<const Matrixd>(b.data(), 1, static_cast<Eigen::Index>(b.size()));
    return rel_error(ma, mb);
}

}  // namespace

// chunk_end_coefficients and chunk_row_coefficients match the brute-force math §4 sums, with gates
// including exact 0 and 1; the last row equals the end
TEMPLATE_TEST_CASE("chunk coeffs: brute force", "[chunk-coefficients]", float, double) {
    using T = TestType;
    const int n = GENERATE(range(1, 13));
    const bool extremes = GENERATE(false, true);
    const int rep = GENERATE(range(0, 4));
    const std::uint64_t seed =
        seed_for(std::string("chunk-coefficients/") + type_name<T>(),
                 static_cast<std::uint64_t>((n * 2 + extremes) * 8 + rep));
    Rng rng(seed);
    ChunkGates g = random_gates(rng, n, extremes);
    // Round the gates through T so both sides see the same values.
    for (auto* v : {&g.theta, &g.eta, &g.alpha})
        for (double& x : *v) x = static_cast<double>(static_cast<T>(x));
    INFO("seed=" << seed << " n=" << n << " extremes=" << extremes);
    const BruteForce bf = brute_force(g);
    const std::vector<T> th = as<T>(g.theta), et = as<T>(g.eta), al = as<T>(g.alpha);
    const double t = tol<T>();

    // End coefficients.
    std::vector<T> gk(static_cast<std::size_t>(n)), sk(static_cast<std::size_t>(n));
    T beta_end = T(-7), c_end = T(-7), p_end = T(-7);
    titans::chunk_end_coefficients<T>(n, th.data(), et.data(), al.data(), gk.data(), sk.data(),
                                      &beta_end, &c_end, &p_end);
    std::vector<double> g_last(static_cast<std::size_t>(n));
    for (int k = 0; k < n; ++k) g_last[static_cast<std::size_t>(k)] = bf.G(n - 1, k);
    CHECK(note_error<T>("chunk_end g vs brute force", max_rel(back(gk), g_last)) <= t);
    CHECK(note_error<T>("chunk_end s vs brute force", max_rel(back(sk), bf.s_end)) <= t);
    CHECK(std::abs(static_cast<double>(beta_end) - bf.beta.back()) <= t * std::max(1.0, bf.beta.back()));
    CHECK(std::abs(static_cast<double>(c_end) - bf.c.back()) <= t * std::max(1.0, bf.c.back()));
    CHECK(std::abs(static_cast<double>(p_end) - bf.P.back()) <= t * std::max(1.0, bf.P.back()));

    // Row coefficients for every starting row.
    for (int row0 = 0; row0 < n; ++row0) {
        INFO("row0=" << row0);
        const int rows = n - row0;
        std::vector<T> beta(static_cast<std::size_t>(rows)), c(static_cast<std::size_t>(rows));
        std::vector<T> G(static_cast<std::size_t>(rows * n), T(-7));
        titans::chunk_row_coefficients<T>(n, row0, th.data(), et.data(), al.data(), beta.data(),
                                          c.data(), G.data());
        const std::vector<double> beta_bf(bf.beta.begin() + row0, bf.beta.end());
        const std::vector<double> c_bf(bf.c.begin() + row0, bf.c.end());
        CHECK(note_error<T>("chunk_row beta vs brute force", max_rel(back(beta), beta_bf)) <= t);
        CHECK(note_error<T>("chunk_row c vs brute force", max_rel(back(c), c_bf)) <= t);
        Matrixd Gm(rows, n);
        for (int i = 0; i < rows; ++i)
            for (int k = 0; k < n; ++k) Gm(i, k) = static_cast<double>(G[static_cast<std::size_t>(i * n + k)]);
        CHECK(note_error<T>("chunk_row G vs brute force", rel_error(Gm, bf.G.bottomRows(rows))) <= t);
        bool upper_zero = true;
        for (int i = 0; i < rows; ++i)
            for (int k = row0 + i + 1; k < n; ++k) upper_zero = upper_zero && Gm(i, k) == 0.0;
        CHECK(upper_zero);
        // The last row of the row coefficients is the end coefficients.
        std::vector<double> g_row(static_cast<std::size_t>(n));
        for (int k = 0; k < n; ++k) g_row[static_cast<std::size_t>(k)] = Gm(rows - 1, k);
        CHECK(note_error<T>("chunk_row last row vs chunk_end", max_rel(g_row, back(gk))) <= t);
        CHECK(std::abs(static_cast<double>(beta.back() - beta_end)) <= t);
        CHECK(std::abs(static_cast<double>(c.back() - c_end)) <= t * std::max(1.0, std::abs(static_cast<double>(c_end))));
    }
}

// chunk coefficients reproduce the scalar recurrence S_i = eta_i S_{i-1} - theta_i u_i, W_i = (1 -
// alpha_i) W_{i-1} + S_i token by token (gates including 0 and 1)
TEST_CASE("chunk coeffs: scalar recurrence", "[chunk-coefficients]") {
    for (int rep = 0; rep < 40; ++rep) {
        Rng rng(seed_for("chunk-coefficients-recurrence", static_cast<std::uint64_t>(rep)));
        const int n = uniform_int(rng, 1, 10);
        const ChunkGates g = random_gates(rng, n, rep % 2 == 1);
        const double W0 = uniform(rng), S0 = uniform(rng);
        std::vector<double> u(static_cast<std::size_t>(n));
        for (double& x : u) x = uniform(rng);
        INFO("rep=" << rep << " n=" << n);
        // Token by token.
        std::vector<double> Ws, Ss;
        double W = W0, S = S0;
        for (int i = 0; i < n; ++i) {
            const auto ii = static_cast<std::size_t>(i);
            S = g.eta[ii] * S - g.theta[ii] * u[ii];
            W = (1.0 - g.alpha[ii]) * W + S;
            Ws.push_back(W);
            Ss.push_back(S);
        }
        // Closed form, every row.
        std::vector<double> beta(static_cast<std::size_t>(n)), c(static_cast<std::size_t>(n)),
            G(static_cast<std::size_t>(n * n));
        titans::chunk_row_coefficients<double>(n, 0, g.theta.data(), g.eta.data(), g.alpha.data(),
                                               beta.data(), c.data(), G.data());
        for (int i = 0; i < n; ++i) {
            double Wi = beta[static_cast<std::size_t>(i)] * W0 + c[static_cast<std::size_t>(i)] * S0;
            for (int k = 0; k <= i; ++k) Wi -= G[static_cast<std::size_t>(i * n + k)] * u[static_cast<std::size_t>(k)];
            CHECK(std::abs(Wi - Ws[static_cast<std::size_t>(i)]) <= 1e-12 * std::max(1.0, std::abs(Ws[static_cast<std::size_t>(i)])));
        }
        // Closed form, chunk end (weights and momentum).
        std::vector<double> gk(static_cast<std::size_t>(n)), sk(static_cast<std::size_t>(n));
        double beta_end = 0, c_end = 0, p_end = 0;
        titans::chunk_end_coefficients<double>(n, g.theta.data(), g.eta.data(), g.alpha.data(),
                                               gk.data(), sk.data(), &beta_end, &c_end, &p_end);
        double We = beta_end * W0 + c_end * S0, Se = p_end * S0;
        for (int k = 0; k < n; ++k) {
            We -= gk[static_cast<std::size_t>(k)] * u[static_cast<std::size_t>(k)];
            Se -= sk[static_cast<std::size_t>(k)] * u[static_cast<std::size_t>(k)];
        }
        CHECK(std::abs(We - Ws.back()) <= 1e-12 * std::max(1.0, std::abs(Ws.back())));
        CHECK(std::abs(Se - Ss.back()) <= 1e-12 * std::max(1.0, std::abs(Ss.back())));
    }
}

// chunk coefficients of an empty prefix are the identity (beta = 1, c = 0, P = 1)
TEST_CASE("chunk coeffs: empty prefix", "[chunk-coefficients]") {
    double beta_end = -1, c_end = -1, p_end = -1;
    titans::chunk_end_coefficients<double>(0, nullptr, nullptr, nullptr, nullptr, nullptr,
                                           &beta_end, &c_end, &p_end);
    CHECK(beta_end == 1.0);
    CHECK(c_end == 0.0);
    CHECK(p_end == 1.0);
}
