// Serving: thread control (titans/threads.hpp, docs/design.md "Threads": the team a call gets
// from its work, the per-call ThreadLimit and the per-object set_threads, the OpenMP setting
// restored after every call, results that do not depend on the team), the streamed product
// (detail::multiply) against Eigen's, the attention's window buffer under transactions, and
// Attention::forward_projected (a prefix projected once) against forward with the prefix.
#include "test_common.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <string>
#include <thread>

#if defined(__linux__)
#include <sys/wait.h>
#include <unistd.h>
#endif

using namespace titans_test;
using titans::Attention;
using titans::AttentionConfig;
using titans::AttentionParams;
using titans::ConfigError;
using titans::NeuralMemory;
using titans::NonFiniteError;
using titans::ShapeError;
using titans::ThreadLimit;
using titans::Threads;
namespace td = titans::detail;

namespace {

MemoryConfig small_memory() {
    MemoryConfig cfg;
    cfg.d_model = 16;
    cfg.n_heads = 4;
    cfg.depth = 2;
    cfg.chunk = 4;
    cfg.theta_max = 0.05;
    return cfg;
}

}  // namespace

// the team: one thread below kParallelWork whatever the settings, never more than the usable
// CPUs (a huge max included), the call's limit over the object's (innermost limit wins), a
// nested scope lowers and never raises, the OpenMP setting comes back afterwards
TEST_CASE("threads: team choice", "[threads]") {
    const int before = td::openmp_max_threads();
    const int cpus = td::usable_cpus();
    const auto at_most = [cpus](int n) { return std::min(n, cpus); };
    const double big = 1e3 * titans::kParallelWork, small = 0.5 * titans::kParallelWork;
    const Threads two{.max = 2, .adapt_to_load = false}, one{.max = 1};
    CHECK(td::choose_team(Threads{.max = 8, .adapt_to_load = false}, small) == 1);
    CHECK(td::choose_team(two, big) == at_most(2));
    CHECK(td::choose_team(one, big) == 1);
    CHECK(td::choose_team(Threads{.max = INT_MAX, .adapt_to_load = false}, big) == cpus);
    const int adaptive = td::choose_team(Threads{.max = 64}, big);
    CHECK(adaptive >= 1);
    CHECK(adaptive <= std::max(1, cpus));
    {
        const ThreadLimit limit(one);
        CHECK(td::choose_team(two, big) == 1);  // the call's limit, not the object's
        {
            const ThreadLimit inner(two);
            CHECK(td::choose_team(one, big) == at_most(2));
        }
        CHECK(td::choose_team(Threads{}, big) == 1);
    }
#if defined(_OPENMP)
    {
        const titans::ThreadScope outer(Threads{.max = 8, .adapt_to_load = false}, small);
        CHECK(td::openmp_max_threads() == 1);
        const titans::ThreadScope inner(two, big);
        CHECK(td::openmp_max_threads() == 1);  // nested: may only lower
    }
    CHECK(td::openmp_max_threads() == before);
    {
        const titans::ThreadScope outer(two, big);
        CHECK(td::openmp_max_threads() == at_most(2));
        {
            const titans::ThreadScope inner(one, small);
            CHECK(td::openmp_max_threads() == 1);
        }
        CHECK(td::openmp_max_threads() == at_most(2));
    }
    {
        const ThreadLimit limit(two);
        const titans::ThreadScope outer(Threads{.max = 5}, big);
        CHECK(td::openmp_max_threads() <= at_most(2));
        const int team = td::openmp_max_threads();
        const titans::ThreadScope inner(one, big);  // the limit wins over objects
        CHECK(td::openmp_max_threads() == team);
    }
#endif
    CHECK(td::openmp_max_threads() == before);
}

#if defined(__linux__)
// the load another process puts on the machine is seen: while a child process spins, some read
// of read_busy_elsewhere() counts it (this process's own running threads are not counted)
TEST_CASE("threads: load elsewhere seen", "[threads]") {
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(400);
        volatile unsigned long spin = 0;
        while (std::chrono::steady_clock::now() < end) spin = spin + 1;
        _exit(0);
    }
    int seen = 0;
    for (int i = 0; i < 100 && seen == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(3));
        seen = std::max(seen, td::read_busy_elsewhere());
    }
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(seen >= 1);
}
#endif

// bad settings are refused with the argument named; a failing call leaves OpenMP as it was
TEST_CASE("threads: errors", "[threads]") {
    const MemoryConfig cfg = small_memory();
    NeuralMemory<double> mem(cfg, titans::MemoryParams<double>::random(cfg, 3));
    CHECK_THROWS_AS(mem.set_threads(Threads{.max = -1}), ConfigError);
    CHECK_THROWS_WITH(ThreadLimit(Threads{.max = -2}),
                      Catch::Matchers::Contains("threads.max") &&
                          Catch::Matchers::Contains(">= 0"));
    CHECK(mem.threads().max == 0);
    const int before = td::openmp_max_threads();
    auto st = mem.make_state(1);
    Matrixd x = Matrixd::Random(4000, cfg.d_model);
    x(3999, 2) = std::numeric_limits<double>::quiet_NaN();
    CHECK_THROWS_AS(mem.forward(st, x), NonFiniteError);
    CHECK(st.position() == 0);
    try {  // unwinding through a scope restores the setting
        const titans::ThreadScope scope(Threads{.max = 3, .adapt_to_load = false},
                                    1e3 * titans::kParallelWork);
        throw NonFiniteError("thrown inside a call");
    } catch (const NonFiniteError&) {
    }
    CHECK(td::openmp_max_threads() == before);
}

// the memory gives the same outputs and state on 1, 2 and 3 threads and under the automatic
// choice (random streams, B = 3, long enough calls to use a team)
TEST_CASE("threads: same results", "[threads]") {
    MemoryConfig cfg = small_memory();
    cfg.d_model = 64;
    cfg.n_heads = 8;
    cfg.chunk = 16;
    const auto p = titans::MemoryParams<double>::random(cfg, seed_for("threads/same"));
    NeuralMemory<double> mem(cfg, p);
    Rng rng(seed_for("threads/same", 1));
    const Matrixd x = random_matrix(3 * 600, cfg.d_model, rng);
    auto run = [&](Threads t) {
        const ThreadLimit limit(t);
        auto st = mem.make_state(3);
        Matrixd y = mem.forward(st, x);
        return std::pair{y, mem.current_weights(st, 2, 7)};
    };
    const auto [y1, w1] = run(Threads{.max = 1});
    for (Threads t : {Threads{.max = 2, .adapt_to_load = false},
                      Threads{.max = 3, .adapt_to_load = false}, Threads{}}) {
        INFO("threads.max " << t.max << " adapt " << t.adapt_to_load);
        const auto [y, w] = run(t);
        CHECK(rel_error(y, y1) <= tol<double>());
        CHECK(rel_error(w, w1) <= tol<double>());
    }
    mem.set_threads(Threads{.max = 2, .adapt_to_load = false});
    auto st = mem.make_state(3);
    CHECK(rel_error(mem.forward(st, x), y1) <= tol<double>());
    mem.set_threads(Threads{.max = INT_MAX, .adapt_to_load = false});  // capped at the CPUs
    auto st2 = mem.make_state(3);
    CHECK(rel_error(mem.forward(st2, x), y1) <= tol<double>());
}

// a prefix projected once (forward_projected, project_prefix) gives what forward gives with the
// prefix, call after call; wrong shapes and non-finite prefixes are refused and leave the state as it was
TEMPLATE_TEST_CASE("attention: projected prefix", "[attention]", float, double) {
    using T = TestType;
    AttentionConfig cfg{.d_model = 12, .n_heads = 3, .window = 5, .rope = true};
    const auto p = AttentionParams<T>::random(cfg, seed_for("attention/projected"));
    const Attention<T> att(cfg, p);
    Rng rng(seed_for("attention/projected", 1));
    const Matrix<T> prefix = random_matrix(3, cfg.d_model, rng).cast<T>();
    const Matrix<T> kp = prefix * p.w_k, vp = prefix * p.w_v;
    auto s1 = att.make_state(2), s2 = att.make_state(2), s3 = att.make_state(2);
    const auto projected = att.project_prefix(prefix);  // the same products as forward's
    CHECK(identical(projected.k, Matrix<T>(prefix * p.w_k)));
    Matrix<T> y2, y3;
    for (int len : {1, 4, 0, 7, 1, 1}) {
        const Matrix<T> x = random_matrix(2 * len, cfg.d_model, rng).cast<T>();
        const Matrix<T> y1 = att.forward(s1, x, &prefix);
        att.forward_projected(s2, x, y2, kp, vp);
        att.forward(s3, x, y3, projected);
        CHECK(rel_error(y2, y1) <= tol<T>());
        CHECK(identical(y3, y1));
        CHECK(s2.position() == s1.position());
    }
    // A per-sequence prefix projected once must have B*p rows.
    const Matrix<T> odd = random_matrix(3, cfg.d_model, rng).cast<T>();
    const auto per_seq = att.project_prefix(odd, titans::PrefixSharing::PerSequence);
    const auto pos3 = s3.position();
    CHECK_THROWS_AS(att.forward(s3, Matrix<T>(random_matrix(2, cfg.d_model, rng).cast<T>()), y3,
                                per_seq),
                    ShapeError);
    CHECK(s3.position() == pos3);
    Matrix<T> nan_prefix = prefix;
    nan_prefix(0, 0) = std::numeric_limits<T>::quiet_NaN();
    CHECK_THROWS_AS(att.project_prefix(nan_prefix), NonFiniteError);
    CHECK_THROWS_AS(att.project_prefix(Matrix<T>(prefix.leftCols(5))), ShapeError);
    const Matrix<T> x = random_matrix(2, cfg.d_model, rng).cast<T>();
    const auto pos = s2.position();
    CHECK_THROWS_AS(att.forward_projected(s2, x, y2, Matrix<T>(kp.leftCols(6)), vp), ShapeError);
    CHECK_THROWS_AS(att.forward_projected(s2, x, y2, kp, Matrix<T>(vp.topRows(2))), ShapeError);
    Matrix<T> bad = kp;
    bad(1, 1) = std::numeric_limits<T>::infinity();
    CHECK_THROWS_AS(att.forward_projected(s2, x, y2, bad, vp), NonFiniteError);
    CHECK_THROWS_AS(att.forward_projected(s2, x, y2, y2, vp), ShapeError);
    CHECK(s2.position() == pos);
}

// detail::multiply (one pass over w for a few rows) equals Eigen's product to rounding, and is
// bit-identical whatever the team, for every row count around the switch and odd widths
TEMPLATE_TEST_CASE("multiply: streamed == Eigen", "[threads]", float, double) {
    using T = TestType;
    Rng rng(seed_for(std::string("multiply/") + type_name<T>()));
    for (int rows : {1, 2, 3, 7, 15, 16, 17, 40}) {
        for (int cols : {1, 5, 64, 131, 700}) {
            const int inner = uniform_int(rng, 1, 300);
            INFO("rows " << rows << " inner " << inner << " cols " << cols);
            const Matrix<T> x = random_matrix(rows, inner, rng).cast<T>();
            const Matrix<T> w = random_matrix(inner, cols, rng).cast<T>();
            const Matrix<T> ref = x * w;
            Matrix<T> y1(rows, cols), y3(rows, cols);
            {
                const ThreadLimit one(Threads{.max = 1});
                td::multiply(y1, x, w);
            }
            {
                const titans::ThreadScope three(Threads{.max = 3, .adapt_to_load = false},
                                            1e3 * titans::kParallelWork);
                td::multiply(y3, x, w);
            }
            CHECK(rel_error(y1, ref) <= tol<T>());
            CHECK(identical(y1, y3));
        }
    }
}

// a transaction over many calls, during which the window buffer moves its kept rows, rolls
// back to the exact state at begin; the stream then continues as if the calls never happened
TEMPLATE_TEST_CASE("attention: window rollback", "[attention]", float, double) {
    using T = TestType;
    AttentionConfig cfg{.d_model = 8, .n_heads = 2, .window = 6};
    const Attention<T> att(cfg, AttentionParams<T>::random(cfg, seed_for("attention/window")));
    Rng rng(seed_for("attention/window", 1));
    auto piece = [&](int n) { return Matrix<T>(random_matrix(3 * n, cfg.d_model, rng).cast<T>()); };
    auto st = att.make_state(3);
    for (int n : {2, 1, 4}) (void)att.forward(st, piece(n));
    const auto saved = st;
    REQUIRE(att.begin(st));
    for (int n : {1, 1, 9, 1, 2, 1, 1, 1, 1, 1, 5}) (void)att.forward(st, piece(n));
    att.rollback(st);
    CHECK(st.position() == saved.position());
    for (int b = 0; b < 3; ++b) {
        CHECK(identical(st.keys(b), saved.keys(b)));
        CHECK(identical(st.values(b), saved.values(b)));
    }
    auto copy = saved;
    for (int n : {1, 7, 1}) {
        const Matrix<T> x = piece(n);
        CHECK(identical(att.forward(st, x), att.forward(copy, x)));
    }
}

// Inputs are views: a block of a wider matrix (rows with a stride), a block of rows, and a
// column-major matrix give the outputs of the same values in a plain row-major matrix, bit for
// bit, for every layer that takes input; an output sharing storage with its input is refused.
TEMPLATE_TEST_CASE("inputs: views not copies", "[serving]", float, double) {
    using T = TestType;
    using Mat = Matrix<T>;
    Rng rng(seed_for(std::string("views/") + type_name<T>()));
    const int d = 16, B = 2, N = 7;
    const Mat wide = random_matrix(B * N + 3, d + 5, rng).cast<T>();
    const auto view = wide.block(1, 2, B * N, d);  // outer stride d + 5
    const Mat plain = view;
    const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor> colmajor = plain;

    const auto mc = titans::ModelConfig::uniform(titans::BlockKind::MAC, 1, d, 2, 2, 4);
    titans::ModelConfig cfg = mc;
    cfg.blocks.push_back(titans::BlockConfig::make(titans::BlockKind::MAG, d, 2, 2, 4, 4));
    const titans::Model<T> model(cfg, titans::ModelParams<T>::random(cfg, 3));
    auto run_model = [&](const auto& x) {
        auto st = model.make_state(B);
        return model.forward(st, x);
    };
    const Mat ref = run_model(plain);
    CHECK(identical(run_model(view), ref));
    CHECK(identical(run_model(colmajor), ref));

    const titans::Block<T>& block = model.blocks()[1];
    auto st1 = block.make_state(B), st2 = block.make_state(B);
    CHECK(identical(block.forward(st1, view), block.forward(st2, plain)));
    CHECK(identical(block.mix(st1, view.topRows(B * 3)), block.mix(st2, plain.topRows(B * 3))));

    const NeuralMemory<T>& mem = block.memory();
    auto m1 = mem.make_state(B), m2 = mem.make_state(B);
    CHECK(identical(mem.forward(m1, view), mem.forward(m2, plain)));
    CHECK(identical(mem.read(m1, view), mem.read(m2, colmajor)));

    const titans::RMSNorm<T> norm(d);
    CHECK(identical(norm.forward(view), norm.forward(plain)));
    Mat inplace = plain;
    norm.forward(inplace, inplace);
    CHECK(identical(inplace, norm.forward(plain)));
    Mat holder = plain;
    CHECK_THROWS_AS(norm.forward(holder.topRows(3), holder), ShapeError);

    const titans::FeedForwardConfig fc{.d_model = d};
    const titans::FeedForward<T> ffn(fc, titans::FeedForwardParams<T>::random(fc, 4));
    CHECK(identical(ffn.forward(view), ffn.forward(colmajor)));
    CHECK_THROWS_AS(ffn.forward(holder.topRows(3), holder), ShapeError);

    const AttentionConfig ac{.d_model = d, .n_heads = 2, .window = 5, .rope = true};
    const Attention<T> attn(ac, AttentionParams<T>::random(ac, 5));
    auto a1 = attn.make_state(B), a2 = attn.make_state(B);
    CHECK(identical(attn.forward(a1, view), attn.forward(a2, plain)));
    CHECK_THROWS_AS(attn.forward(a1, holder, holder), ShapeError);
}
