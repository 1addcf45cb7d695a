// Streaming (math §5, last paragraph): feeding a stream in pieces of any length - empty pieces,
// single tokens, pieces inside a chunk and pieces crossing several chunk boundaries - gives the
// same outputs, Diagnostics, weights, momentum and position as one call over the whole
// sequence, in every update / retrieval / gate mode; the same for token-by-token streaming; on
// the CPU and on the simulated device (tests/backends.hpp).
#include "backends.hpp"

#include <thread>

using namespace titans_test;

namespace {


/// Streams c in the given pieces; checks every piece's bookkeeping and returns the assembled
/// outputs, diagnostics and final state.
template <class T, class Backend>
LibRun<T> run_streamed(const Case& c, const std::vector<int>& pieces, bool check_prefix_state) {
    const MemoryParams<T> p = cast_params<T>(c.params);
    const Matrix<T> x = c.x.cast<T>();
    const int B = c.batch, N = c.tokens, H = c.cfg.n_heads;
    NeuralMemory<T, Backend> mem(c.cfg, p);
    auto st = mem.make_state(B);
    LibRun<T> r;
    r.y.setConstant(x.rows(), c.cfg.d_model, T(12345));
    r.diag.loss.setConstant(x.rows(), H, T(12345));
    r.diag.grad_norm.setConstant(x.rows(), H, T(12345));
    int t0 = 0;
    for (int len : pieces) {
        const int t1 = t0 + len;
        const Matrix<T> xp = take_tokens(x, B, N, t0, t1);
        Diagnostics<T> dp;
        const Matrix<T> yp = mem.forward(st, xp, &dp);
        REQUIRE(yp.rows() == xp.rows());
        REQUIRE(yp.cols() == c.cfg.d_model);
        REQUIRE(dp.loss.rows() == xp.rows());
        REQUIRE(dp.grad_norm.rows() == xp.rows());
        CHECK(st.position() == t1);
        put_tokens(r.y, yp, B, N, t0, t1);
        put_tokens(r.diag.loss, dp.loss, B, N, t0, t1);
        put_tokens(r.diag.grad_norm, dp.grad_norm, B, N, t0, t1);
        if (check_prefix_state && len > 0 && t1 < N) {
            // The state after a prefix equals a one-call run on that prefix.
            const LibRun<T> one = run_library<T, Backend>(c.cfg, p, take_tokens(x, B, N, 0, t1), B);
            for (int b = 0; b < B; ++b)
                for (int h = 0; h < H; ++h) {
                    INFO("prefix " << t1 << " b=" << b << " h=" << h);
                    CHECK(note_error<T>("streaming: prefix weights",
                                        rel_error(mem.current_weights(st, b, h),
                                                  one.weights[static_cast<std::size_t>(b)][static_cast<std::size_t>(h)])) <= tol<T>());
                    CHECK(note_error<T>("streaming: prefix momentum",
                                        rel_error(mem.current_momentum(st, b, h),
                                                  one.momentum[static_cast<std::size_t>(b)][static_cast<std::size_t>(h)])) <= tol<T>());
                }
        }
        t0 = t1;
    }
    REQUIRE(t0 == N);
    collect_state(mem, st, r);
    return r;
}

template <class T>
void check_same(const LibRun<T>& s, const LibRun<T>& one, const std::string& what) {
    const double t = tol<T>();
    CHECK(note_error<T>(what + ": y", rel_error(s.y, one.y)) <= t);
    CHECK(note_error<T>(what + ": diag loss", rel_error(s.diag.loss, one.diag.loss)) <= t);
    CHECK(note_error<T>(what + ": diag grad_norm", rel_error(s.diag.grad_norm, one.diag.grad_norm)) <= t);
    CHECK(s.position == one.position);
    REQUIRE(s.weights.size() == one.weights.size());
    for (std::size_t b = 0; b < s.weights.size(); ++b)
        for (std::size_t h = 0; h < s.weights[b].size(); ++h) {
            INFO("b=" << b << " h=" << h);
            CHECK(note_error<T>(what + ": weights", rel_error(s.weights[b][h], one.weights[b][h])) <= t);
            CHECK(note_error<T>(what + ": momentum", rel_error(s.momentum[b][h], one.momentum[b][h])) <= t);
        }
}

}  // namespace

// streaming in random pieces (empty, single tokens, across several chunk boundaries) equals one
// call: outputs, diagnostics, weights, momentum, position, in every update/retrieval/gate mode
TEMPLATE_LIST_TEST_CASE("streaming: random pieces", "[streaming]", Both) {
    using T = typename TestType::Scalar;
    using Backend = typename TestType::Backend;
    const std::vector<Modes> primary = all_primary_modes();  // 9 valid modes
    const int combo = GENERATE(range(0, 9 * 6));
    Rng rng(seed_for(std::string("streaming-pieces/") + type_name<T>(), static_cast<std::uint64_t>(combo)));
    const Modes m = random_flags(primary[static_cast<std::size_t>(combo % 9)], rng);
    const Case c = make_case<T>(m, rng(), Limits{.max_tokens = 40, .max_batch = 3, .max_depth = 3},
                                [](Case& d) {
                                    if (d.cfg.update == UpdateMode::Chunked && d.cfg.chunk == 1) d.cfg.chunk = 3;
                                });
    const std::vector<int> pieces = random_pieces(rng, c.tokens, c.cfg.chunk);
    std::ostringstream os;
    for (int len : pieces) os << len << ' ';
    INFO(c.describe());
    INFO("pieces: " << os.str());
    const LibRun<T> one = run_library<T, Backend>(c);
    const LibRun<T> streamed = run_streamed<T, Backend>(c, pieces, combo % 2 == 0);
    check_same(streamed, one, "streaming pieces vs one call");
}

// token-by-token streaming equals one call in every update/retrieval/gate mode
TEMPLATE_LIST_TEST_CASE("streaming: token by token", "[streaming]", Both) {
    using T = typename TestType::Scalar;
    using Backend = typename TestType::Backend;
    const std::vector<Modes> primary = all_primary_modes();
    const int combo = GENERATE(range(0, 9 * 2));
    Rng rng(seed_for(std::string("streaming-tokens/") + type_name<T>(), static_cast<std::uint64_t>(combo)));
    const Modes m = random_flags(primary[static_cast<std::size_t>(combo % 9)], rng);
    const Case c = make_case<T>(m, rng(), Limits{.max_tokens = 24, .max_batch = 3, .max_depth = 3});
    INFO(c.describe());
    const LibRun<T> one = run_library<T, Backend>(c);
    const LibRun<T> streamed = run_streamed<T, Backend>(c, std::vector<int>(static_cast<std::size_t>(c.tokens), 1), false);
    check_same(streamed, one, "token-by-token vs one call");
}

// a copied state is an independent snapshot: both copies continue exactly like the original stream
TEMPLATE_LIST_TEST_CASE("streaming: state copies", "[streaming][state]", BothD) {
    using Backend = typename TestType::Backend;
    const std::vector<Modes> primary = all_primary_modes();
    for (std::size_t i = 0; i < primary.size(); ++i) {
        Rng rng(seed_for("state-copy", i));
        const Modes m = random_flags(primary[i], rng);
        const Case c = make_case<double>(m, rng(), Limits{.max_tokens = 20, .max_batch = 2, .max_depth = 2},
                                         [](Case& d) {
                                             if (d.cfg.update == UpdateMode::Chunked) d.cfg.chunk = 5;
                                         });
        if (c.tokens < 4) continue;
        INFO(c.describe());
        const int B = c.batch, N = c.tokens, cut = N / 2 + 1;
        NeuralMemory<double, Backend> mem(c.cfg, c.params);
        auto st = mem.make_state(B);
        (void)mem.forward(st, take_tokens(c.x, B, N, 0, cut));
        auto copy = st;  // snapshot mid-chunk
        const Matrixd rest = take_tokens(c.x, B, N, cut, N);
        const Matrixd y1 = mem.forward(st, rest);
        // Something else written to the copy first, then restored from a second snapshot.
        auto copy2 = copy;
        (void)mem.forward(copy, random_matrix(rest.rows(), rest.cols(), rng));
        const Matrixd y2 = mem.forward(copy2, rest);
        CHECK(identical(y1, y2));
        CHECK(copy2.position() == st.position());
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < c.cfg.n_heads; ++h)
                CHECK(rel_error(mem.current_weights(copy2, b, h), mem.current_weights(st, b, h)) == 0.0);
    }
}

// forward into a reused output matrix (any prior size) equals the returning overload
TEMPLATE_LIST_TEST_CASE("streaming: reused output", "[streaming]", BothD) {
    using Backend = typename TestType::Backend;
    const std::vector<Modes> primary = all_primary_modes();
    for (std::size_t i = 0; i < primary.size(); ++i) {
        Rng rng(seed_for("forward-into", i));
        const Modes m = random_flags(primary[i], rng);
        const Case c = make_case<double>(m, rng(), Limits{.max_tokens = 16, .max_batch = 2, .max_depth = 2});
        INFO(c.describe());
        NeuralMemory<double, Backend> mem(c.cfg, c.params);
        auto s1 = mem.make_state(c.batch);
        auto s2 = mem.make_state(c.batch);
        Matrixd y = random_matrix(3, 5, rng);  // wrong size on purpose: must be resized
        Diagnostics<double> d1, d2;
        mem.forward(s1, c.x, y, &d1);
        const Matrixd expect = mem.forward(s2, c.x, &d2);
        CHECK(identical(y, expect));
        CHECK(identical(d1.grad_norm, d2.grad_norm));
        // Second piece into the same (now correctly sized) matrix.
        const Matrixd x2 = random_matrix(2 * c.batch, c.cfg.d_model, rng);
        mem.forward(s1, x2, y);
        CHECK(identical(y, mem.forward(s2, x2)));
    }
}

// distinct states can be used from distinct threads concurrently with one NeuralMemory
TEMPLATE_LIST_TEST_CASE("streaming: threads", "[streaming][threads]", BothD) {
    using Backend = typename TestType::Backend;
    Modes m;
    m.retrieval = Retrieval::InChunk;
    Rng rng(seed_for("threads"));
    const Case c = make_case<double>(m, rng(), Limits{.max_tokens = 30, .max_batch = 2, .max_depth = 2});
    INFO(c.describe());
    const NeuralMemory<double, Backend> mem(c.cfg, c.params);
    constexpr int kThreads = 4;
    std::vector<Matrixd> xs, expect(kThreads), got(kThreads);
    for (int i = 0; i < kThreads; ++i) xs.push_back(random_matrix(c.x.rows(), c.x.cols(), rng));
    for (int i = 0; i < kThreads; ++i) {
        auto st = mem.make_state(c.batch);
        expect[static_cast<std::size_t>(i)] = mem.forward(st, xs[static_cast<std::size_t>(i)]);
    }
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
        threads.emplace_back([&, i] {
            auto st = mem.make_state(c.batch);
            got[static_cast<std::size_t>(i)] = mem.forward(st, xs[static_cast<std::size_t>(i)]);
        });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < kThreads; ++i) {
        CHECK(identical(got[static_cast<std::size_t>(i)], expect[static_cast<std::size_t>(i)]));
    }
}
