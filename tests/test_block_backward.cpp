// The training pass of blocks and models (math §9, "Blocks and the model"): Block and Model
// backward against central finite differences of the inference forward (persistent tokens fed
// at make_state there, in the call here), the training forward against the inference forward,
// the refusals.
#include "catch.hpp"
#include "test_common.hpp"
#include "block_cases.hpp"
#include "trainer_common.hpp"
#include "training_pass.hpp"

#include <titans/titans.hpp>

#include <limits>
#include <string>
#include <vector>

using namespace titans_test;
using titans::BlockConfig;
using titans::BlockKind;
using titans::BlockParams;

namespace {

struct BackwardBlockCase {
    BlockConfig cfg;
    BlockParams<double> p;
    Matrixd x, dy;
    int batch = 1;
};

/// Norm weights around 1, gate biases and conv taps off their initial values: every tensor
/// matters.
void perturb(BlockParams<double>& p, const BlockConfig& cfg, Rng& rng) {
    for (titans::RowVector<double>* w : {&p.norm_mix, &p.norm_ffn, &p.norm_y, &p.norm_m}) {
        if (w->size() > 0) *w = (1.0 + 0.3 * random_matrix(1, w->size(), rng).array()).matrix();
    }
    if (!titans::has_memory(cfg.kind)) return;
    const int H = cfg.memory.n_heads;
    p.memory.b_theta = random_matrix(1, H, rng);
    p.memory.b_eta = random_matrix(1, H, rng, -1.0, 1.5);
    p.memory.b_alpha = random_matrix(1, H, rng, -3.0, 0.0);
    for (Matrixd* conv : {&p.memory.conv_q, &p.memory.conv_k, &p.memory.conv_v}) {
        *conv += random_matrix(conv->rows(), conv->cols(), rng, -0.3, 0.3);
    }
}

/// A small block of `kind`: width 2..6, 1..2 heads, memory depth 1..2 and chunk 1..4, window
/// or MAC segment 2..4 (segments start inside chunks and at their starts), 0..3 persistent
/// tokens, feed-forward SwiGLU / GELU / none, RoPE when the head width is even, both retrievals
/// and gate modes; 5..9 tokens (several chunks and segments, beyond the window), batch 1..2;
/// bit 4 of i: a constant stream.
BackwardBlockCase draw_block_case(BlockKind kind, int i, Rng& rng) {
    BackwardBlockCase c;
    const int heads = uniform_int(rng, 1, 2), d = heads * uniform_int(rng, 1, 3);
    c.cfg = BlockConfig::make(kind, d, heads, uniform_int(rng, 1, 2), uniform_int(rng, 2, 4),
                              uniform_int(rng, 1, 4));
    c.cfg.n_persistent = uniform_int(rng, 0, 3);
    c.cfg.use_ffn = i % 3 != 2;
    c.cfg.ffn.kind = i % 2 == 0 ? titans::FeedForwardKind::SwiGLU : titans::FeedForwardKind::GELU;
    c.cfg.ffn.hidden = uniform_int(rng, 2, 5);
    c.cfg.memory.retrieval = (i / 2) % 2 == 0 ? titans::Retrieval::Lagged : titans::Retrieval::InChunk;
    c.cfg.memory.gates = (i / 3) % 2 == 0 ? titans::GateMode::DataDependent : titans::GateMode::Constant;
    c.cfg.attention.rope = i % 2 == 1 && c.cfg.attention.head_dim() % 2 == 0;
    if (kind == BlockKind::MAC && i % 8 == 7) c.cfg.memory.retrieval = titans::Retrieval::Lagged;
    c.cfg.validate();
    c.p = BlockParams<double>::random(c.cfg, rng());
    perturb(c.p, c.cfg, rng);
    c.batch = uniform_int(rng, 1, 2);
    const int N = uniform_int(rng, 5, 9);
    c.x = random_matrix(c.batch * N, d, rng);
    if ((i & 16) != 0) c.x.rowwise() = c.x.row(0);
    c.dy = random_matrix(c.batch * N, d, rng);
    return c;
}

double block_loss(const BackwardBlockCase& c) {
    return fresh_loss<titans::Block<double>>(c.cfg, c.p, c.batch, c.x, c.dy);
}
BlockParams<double> block_gradients(const BackwardBlockCase& c, Matrixd& dx) {
    return fresh_gradients<titans::Block<double>>(c.cfg, c.p, c.batch, c.x, c.dy, dx);
}

const std::vector<BlockKind> trainable_kinds{BlockKind::LMM, BlockKind::MAG, BlockKind::MAL,
                                             BlockKind::MAC, BlockKind::SWA};
/// The kind of case i: every kind in turn.
BlockKind kind_of_case(int i) {
    return trainable_kinds[static_cast<std::size_t>(i) % trainable_kinds.size()];
}

}  // namespace

TEST_CASE("block bwd: FD, every kind", "[train][blocks]") {
    const int i = GENERATE(range(0, 25));
    const std::uint64_t seed = seed_for("block bwd: FD", static_cast<std::uint64_t>(i));
    Rng rng(seed);
    BackwardBlockCase c = draw_block_case(kind_of_case(i), i, rng);
    INFO("seed=" << seed << " case=" << i << " kind=" << titans::to_string(c.cfg.kind)
                 << " rows=" << c.x.rows() << " persistent=" << c.cfg.n_persistent);
    Matrixd dx;
    const BlockParams<double> g = block_gradients(c, dx);
    const auto loss = [&]() { return block_loss(c); };
    const double atol = fd_floor(loss());
    const double ep = params_fd_error(c.p, g, c.cfg, atol, loss);
    const double ex = tensor_error(c.x.data(), dx.data(), c.x.size(), atol, loss);
    if (ex > 1e-6) UNSCOPED_INFO("x: " << ex);
    CHECK(note_error<double>("block backward", std::max(ep, ex)) <= 1e-6);
}

TEMPLATE_TEST_CASE("block bwd: as inference", "[train][blocks]", float, double) {
    using T = TestType;
    for (int i = 0; i < 10; ++i) {
        Rng rng(seed_for("block bwd: as inference", static_cast<std::uint64_t>(i)));
        const BackwardBlockCase c = draw_block_case(kind_of_case(i), i + 16 * (i / 5), rng);
        INFO("case " << i << " kind " << titans::to_string(c.cfg.kind));
        const auto pt = cast_block<T>(c.p);
        titans::Block<T> block(c.cfg, pt);
        const titans::Matrix<T> x = c.x.template cast<T>();
        auto s1 = block.make_state(c.batch), s2 = block.make_state(c.batch);
        typename titans::Block<T>::Trace trace;
        titans::Matrix<T> y2;
        const titans::Matrix<T> y1 = block.forward(s1, x);
        block.forward(s2, x, y2, trace);
        CHECK(rel_error(y2, y1) <= 10 * tol<T>());
        CHECK(s2.position() == s1.position());
        // Both states continue the streams the same (the memory took P in the same call here).
        const titans::Matrix<T> x2 = random_matrix(x.rows(), x.cols(), rng).template cast<T>();
        CHECK(rel_error(block.forward(s2, x2), block.forward(s1, x2)) <= 10 * tol<T>());
    }
}

TEST_CASE("block bwd: sums and refusals", "[train][blocks]") {
    Rng rng(seed_for("block bwd: sums and refusals"));
    BackwardBlockCase c = draw_block_case(BlockKind::MAG, 0, rng);
    titans::Block<double> block(c.cfg, c.p);
    auto st = block.make_state(c.batch);
    const auto fresh = block.make_state(c.batch);
    titans::Block<double>::Trace trace;
    Matrixd y, dx1, dx2;
    block.forward(st, c.x, y, trace);
    // Gradients add up; dx is written.
    auto g = BlockParams<double>::zeros(c.cfg);
    block.backward(trace, c.dy, dx1, g);
    const auto once = g;
    block.backward(trace, c.dy, dx2, g);
    CHECK(identical(dx1, dx2));
    CHECK(identical(g.persistent, (2 * once.persistent).eval()));
    CHECK(identical(g.memory.w_q, (2 * once.memory.w_q).eval()));
    // Refusals change nothing.
    Matrixd y3 = y;
    auto st2 = fresh;
    Matrixd bad_x = c.x;
    bad_x(0, 0) = std::numeric_limits<double>::infinity();
    CHECK_THROWS_AS(block.forward(st2, bad_x, y3, trace), titans::NonFiniteError);
    CHECK(st2.position() == 0);
    titans::Block<double>::Trace empty;
    CHECK_THROWS_AS(block.backward(empty, c.dy, dx1, g), titans::ShapeError);
    const Matrixd short_dy = c.dy.topRows(c.dy.rows() - 1);
    CHECK_THROWS_AS(block.backward(trace, short_dy, dx1, g), titans::ShapeError);
    Matrixd bad_dy = c.dy;
    bad_dy(1, 0) = std::numeric_limits<double>::quiet_NaN();
    CHECK_THROWS_AS(block.backward(trace, bad_dy, dx1, g), titans::NonFiniteError);
    auto wrong = g;
    wrong.persistent.resize(1, 1);
    CHECK_THROWS_AS(block.backward(trace, c.dy, dx1, wrong), titans::ShapeError);
    CHECK(identical(g.memory.w_q, (2 * once.memory.w_q).eval()));
    // A trace of another block kind, of the same width (else the width is refused first).
    BackwardBlockCase l = draw_block_case(BlockKind::LMM, 0, rng);
    for (int k = 0; k < 100 && l.cfg.d_model != c.cfg.d_model; ++k) {
        l = draw_block_case(BlockKind::LMM, 0, rng);
    }
    REQUIRE(l.cfg.d_model == c.cfg.d_model);
    titans::Block<double> lmm(l.cfg, l.p);
    auto sl = lmm.make_state(l.batch);
    titans::Block<double>::Trace tl;
    lmm.forward(sl, l.x, y3, tl);
    CHECK_THROWS_AS(block.backward(tl, c.dy, dx1, g), titans::ConfigError);
}


// Chained pieces (math §9): blocks of every kind over pieces cut where the memory is at a
// chunk boundary or, every other case, anywhere (the memory left mid-chunk; pieces longer and
// shorter than the window, MAC's cut inside segments and at their ends, and empty pieces),
// forward in order and backward last first, each given the next
// one's d_state_in as its d_state_out: the dx and gradients of one call, to rounding. The first
// piece takes P; the later ones continue the memory, the attention window and MAC's segment
// state. Inputs of unit size, 1e-4 and 1e4, and constant streams. Each tensor is compared relative to its own largest entry or, for a
// tensor far below the gradient's scale (the largest entry of any gradient or dx), 1e-3 of that
// scale: such a tensor is a sum of terms of the gradient's size that cancel (a constant stream
// leaves some near 1e-18; MAG's attention gradients can cancel to 1e-6 of the others), and
// the rounding of those terms is what chained pieces and one call differ by.
TEST_CASE("block bwd: chained pieces", "[train][blocks]") {
    for (int i = 0; i < 25; ++i) {
        Rng rng(seed_for("block bwd: chained pieces", static_cast<std::uint64_t>(i)));
        BackwardBlockCase c = draw_block_case(kind_of_case(i), i, rng);
        const int B = c.batch;
        const Eigen::Index N = uniform_int(rng, 8, 16);
        c.x = random_matrix(B * N, c.cfg.d_model, rng);
        if (i % 6 == 4) c.x *= 1e-4;  // tiny and huge inputs (the residual keeps their scale)
        if (i % 6 == 5) c.x *= 1e4;
        if (i % 6 == 3) {  // a constant stream: every token of a sequence the same row
            for (int b = 0; b < B; ++b) {
                c.x.middleRows(b * N, N).rowwise() = c.x.row(b * N);
            }
        }
        c.dy = random_matrix(B * N, c.cfg.d_model, rng);
        const std::vector<Eigen::Index> cuts =
            i % 2 == 1 ? any_cuts(N, rng) : chunk_cuts({c.cfg}, N, rng);
        INFO("case " << i << " kind " << titans::to_string(c.cfg.kind) << " chunk "
                     << c.cfg.memory.chunk << " segment " << c.cfg.segment << " persistent "
                     << c.cfg.n_persistent << " pieces " << cuts.size() - 1);
        Matrixd dx_all;
        const BlockParams<double> g_all = block_gradients(c, dx_all);
        titans::Block<double> block(c.cfg, c.p);
        auto g = BlockParams<double>::zeros(c.cfg);
        Matrixd y_pieces;
        const Matrixd dx = chained_pieces<titans::BlockStateGradient<double>>(block, B, c.x, c.dy,
                                                                              cuts, g, true, &y_pieces);
        auto s_inf = block.make_state(B);  // the inference forward over the whole stream
        CHECK(rel_error(y_pieces, block.forward(s_inf, c.x)) <= 1e-12);
        const double floor = chained_floor(g_all, c.cfg, dx_all);
        CHECK(note_error<double>("block chained pieces", rel_error(dx, dx_all, floor)) <= 1e-12);
        check_gradients_match(g, g_all, c.cfg, floor, "block chained pieces");
    }
}

// A state gradient with a part the block's kind lacks, or MAC's segment part of the wrong count,
// shape or with a NaN, is refused naming it; grads are unchanged.
TEST_CASE("block bwd: state gradient checks", "[train][blocks]") {
    Rng rng(seed_for("block bwd: state gradient checks"));
    BackwardBlockCase c = draw_block_case(BlockKind::MAC, 0, rng);
    c.cfg.segment = 4;
    c.cfg.memory.chunk = 1;
    c.p = BlockParams<double>::random(c.cfg, rng());
    titans::Block<double> block(c.cfg, c.p);
    auto st = block.make_state(c.batch);
    titans::Block<double>::Trace t1, t2;
    Matrixd y, dx;
    const Eigen::Index N = c.x.rows() / c.batch;  // 5..9 tokens: the second piece ends mid-segment
    block.forward(st, take_tokens(c.x, c.batch, N, 0, 3), y, t1);
    block.forward(st, take_tokens(c.x, c.batch, N, 3, N), y, t2);
    const Matrixd dy = take_tokens(c.dy, c.batch, N, 0, 3);
    titans::BlockStateGradient<double> d;
    auto g2 = BlockParams<double>::zeros(c.cfg);
    block.backward(t2, take_tokens(c.dy, c.batch, N, 3, N), dx, g2, &d);
    REQUIRE(d.mac.keys.size() == static_cast<std::size_t>(c.batch));
    CHECK(d.mac.keys[0].rows() == 2 * 3);  // 3 tokens into the first segment
    CHECK(d.attention.empty());
    auto g = BlockParams<double>::zeros(c.cfg);
    auto bad = d;
    bad.mac.keys.pop_back();
    REQUIRE_THROWS_NAMING(block.backward(t1, dy, dx, g, nullptr, &bad), titans::ShapeError, "mac.keys.size()");
    bad = d;
    bad.mac.values[0].conservativeResize(1, Eigen::NoChange);
    REQUIRE_THROWS_NAMING(block.backward(t1, dy, dx, g, nullptr, &bad), titans::ShapeError, "mac.values");
    bad = d;
    bad.mac.snapshot.back().back()(0, 0) = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_NAMING(block.backward(t1, dy, dx, g, nullptr, &bad), titans::NonFiniteError, "mac");
    bad = d;
    bad.attention.keys = bad.mac.keys;
    REQUIRE_THROWS_NAMING(block.backward(t1, dy, dx, g, nullptr, &bad), titans::ConfigError, "attention");
    // (W_O's gradient: W_Q's is exactly 0 when the draw has d_head = 1 and the q/k norm on.)
    CHECK(g.memory.w_o.isZero(0));
    block.backward(t1, dy, dx, g, nullptr, &d);  // the right one: fine
    CHECK(!g.memory.w_o.isZero(0));
    // A part another kind lacks: MAC's segment state given to MAG, a memory part to SWA (no
    // memory); refused naming it, grads unchanged.
    REQUIRE(!d.memory.empty());
    const auto refuses_stray = [&](BlockKind kind, const titans::BlockStateGradient<double>& stray,
                                   const char* part) {
        BackwardBlockCase m = draw_block_case(kind, 1, rng);
        titans::Block<double> other(m.cfg, m.p);
        auto sm = other.make_state(m.batch);
        titans::Block<double>::Trace tm;
        other.forward(sm, m.x, y, tm);
        auto gm = BlockParams<double>::zeros(m.cfg);
        REQUIRE_THROWS_NAMING(other.backward(tm, m.dy, dx, gm, nullptr, &stray), titans::ConfigError, part);
        CHECK(gm.attention.w_q.isZero(0));
    };
    titans::BlockStateGradient<double> stray_mac, stray_memory;
    stray_mac.mac = d.mac;
    stray_memory.memory = d.memory;
    refuses_stray(BlockKind::MAG, stray_mac, "d_state_out.mac");
    refuses_stray(BlockKind::SWA, stray_memory, "d_state_out.memory");
}

// ---------------------------------------------------------------------------------------------
// Model: embedding, mixed blocks, final norm, head.

namespace {

struct TrainModelCase {
    titans::ModelConfig cfg;
    titans::ModelParams<double> p;
    std::vector<int> ids;
    Matrixd x, dout;
    int batch = 1;
};

TrainModelCase draw_model_case(int i, Rng& rng) {
    TrainModelCase c;
    Rng r2(rng());
    // Cases 0-7: LMM+MAG, MAG+MAL, MAL+MAC, MAC+LMM, ...; 8: SWA+MAG; 9: MAC+SWA.
    const BlockKind ka = i < 8 ? kind_of_case(i % 4) : i == 8 ? BlockKind::SWA : BlockKind::MAC;
    const BlockKind kb = i < 8 ? kind_of_case((i + 1) % 4) : i == 8 ? BlockKind::MAG : BlockKind::SWA;
    const BackwardBlockCase a = draw_block_case(ka, i, rng);
    BackwardBlockCase b = draw_block_case(kb, i + 1, r2);
    c.cfg.d_model = a.cfg.d_model;
    b.cfg = BlockConfig::make(b.cfg.kind, a.cfg.d_model, a.cfg.memory.n_heads, 1, 3, 2);
    b.cfg.n_persistent = 2;
    c.cfg.blocks = {a.cfg, b.cfg};
    c.cfg.vocab_size = i % 2 == 0 ? uniform_int(rng, 3, 6) : 0;
    c.cfg.d_out = c.cfg.vocab_size == 0 ? uniform_int(rng, 1, 3) : 0;
    c.p = titans::ModelParams<double>::random(c.cfg, rng());
    perturb(c.p.blocks[0], c.cfg.blocks[0], rng);
    perturb(c.p.blocks[1], c.cfg.blocks[1], rng);
    c.p.norm_final = (1.0 + 0.3 * random_matrix(1, c.cfg.d_model, rng).array()).matrix();
    c.batch = a.batch;
    const Eigen::Index rows = a.x.rows();
    if (c.cfg.vocab_size > 0) {
        for (Eigen::Index r = 0; r < rows; ++r) c.ids.push_back(uniform_int(rng, 0, c.cfg.vocab_size - 1));
    } else {
        c.x = a.x;
    }
    c.dout = random_matrix(rows, c.cfg.output_dim(), rng);
    return c;
}

Matrixd model_out(const TrainModelCase& c) {
    titans::Model<double> model(c.cfg, c.p);
    auto st = model.make_state(c.batch);
    return c.ids.empty() ? model.forward(st, c.x) : model.forward_tokens(st, c.ids);
}

/// Case i of the model's gradient check against central finite differences (every
/// parameter and the input or the embedding's rows): two blocks of mixed kinds (draw_model_case).
void check_model_fd(int i) {
    const std::uint64_t seed = seed_for("model bwd: FD", static_cast<std::uint64_t>(i));
    Rng rng(seed);
    TrainModelCase c = draw_model_case(i, rng);
    INFO("seed=" << seed << " case=" << i << " vocab=" << c.cfg.vocab_size);
    titans::Model<double> model(c.cfg, c.p);
    auto st = model.make_state(c.batch);
    titans::Model<double>::Trace trace;
    Matrixd out, dx;
    if (c.ids.empty()) {
        model.forward(st, c.x, out, trace);
    } else {
        model.forward_tokens(st, c.ids, out, trace);
    }
    CHECK(rel_error(out, model_out(c)) <= 1e-12);
    auto g = titans::ModelParams<double>::zeros(c.cfg);
    model.backward(trace, c.dout, g, &dx);
    const auto loss = [&]() { return c.dout.cwiseProduct(model_out(c)).sum(); };
    const double atol = fd_floor(loss());
    double err = params_fd_error(c.p, g, c.cfg, atol, loss);
    if (c.ids.empty()) {
        err = std::max(err, tensor_error(c.x.data(), dx.data(), c.x.size(), atol, loss));
    } else {  // dx: the gradient of the embedded rows, summed per id into the embedding's
        Matrixd e = Matrixd::Zero(c.p.embedding.rows(), c.p.embedding.cols());
        for (std::size_t r = 0; r < c.ids.size(); ++r) e.row(c.ids[r]) += dx.row(static_cast<Eigen::Index>(r));
        CHECK(rel_error(e, g.embedding) <= 1e-14);
    }
    CHECK(note_error<double>("model backward", err) <= 1e-6);
}

}  // namespace

// Ten cases in two test cases, so that ctest runs them on two cores (about 160 s in all under
// the sanitizers).
TEST_CASE("model bwd: FD, cases 0-4", "[train][model]") {
    check_model_fd(GENERATE(range(0, 5)));
}

TEST_CASE("model bwd: FD, cases 5-9", "[train][model]") {
    check_model_fd(GENERATE(range(5, 10)));
}

TEST_CASE("model bwd: refusals", "[train][model]") {
    Rng rng(seed_for("model bwd: refusals"));
    TrainModelCase c = draw_model_case(0, rng);
    titans::Model<double> model(c.cfg, c.p);
    auto st = model.make_state(c.batch);
    titans::Model<double>::Trace trace;
    Matrixd out;
    model.forward_tokens(st, c.ids, out, trace);
    auto g = titans::ModelParams<double>::zeros(c.cfg);
    auto st2 = model.make_state(c.batch);
    std::vector<int> bad = c.ids;
    bad.back() = c.cfg.vocab_size;
    Matrixd out2 = out;
    REQUIRE_THROWS_NAMING(model.forward_tokens(st2, bad, out2, trace), titans::ShapeError, "token id");
    CHECK(identical(out2, out));
    CHECK(st2.position == 0);
    {  // the loss on the backend: labels of the wrong count or range; a trace without a loss
        std::vector<int> labels = c.ids;
        labels.back() = c.cfg.vocab_size;
        REQUIRE_THROWS_NAMING(model.forward_loss(st2, c.ids, labels, trace), titans::ShapeError,
                              "a label");
        labels.pop_back();
        REQUIRE_THROWS_NAMING(model.forward_loss(st2, c.ids, labels, trace), titans::ShapeError,
                              "labels.size()");
        CHECK(st2.position == 0);
        REQUIRE_THROWS_NAMING(model.backward_loss(trace, g), titans::ConfigError, "no loss");
        CHECK(identical(g.head, Matrixd::Zero(g.head.rows(), g.head.cols())));
        // forward_loss then backward_loss: forward_tokens, cross_entropy_loss and backward.
        labels.push_back(-1);
        titans::Model<double>::Trace tl;
        auto g2 = g;
        Matrixd dlogits;
        const double want = titans::cross_entropy_loss<double>(out, labels, dlogits);
        CHECK(model.forward_loss(st2, c.ids, labels, tl) == want);
        model.backward(trace, dlogits, g);
        model.backward_loss(tl, g2);
        CHECK(same_param_bits(g, g2, c.cfg));
        g = titans::ModelParams<double>::zeros(c.cfg);
    }
    const Matrixd wide = Matrixd::Ones(c.dout.rows(), c.dout.cols() + 1);
    CHECK_THROWS_AS(model.backward(trace, wide, g), titans::ShapeError);
    auto wrong = g;
    wrong.head.resize(1, 1);
    CHECK_THROWS_AS(model.backward(trace, c.dout, wrong), titans::ShapeError);
    titans::Model<double>::Trace empty;
    CHECK_THROWS_AS(model.backward(empty, c.dout, g), titans::ShapeError);
    CHECK(g.head.isZero(0));
    Matrixd dx;
    model.backward(trace, c.dout, g, &dx);
    CHECK(dx.rows() == c.dout.rows());
    CHECK(!g.head.isZero(0));
}

// Chained pieces through a model of two blocks (every kind, first and second; token ids or
// rows), cut at chunk boundaries or (odd cases) anywhere: the same dx and gradients as one
// call, each piece's d_state_in given to the piece before it.
TEST_CASE("model bwd: chained pieces", "[train][model]") {
    for (int i = 0; i < 10; ++i) {
        Rng rng(seed_for("model bwd: chained pieces", static_cast<std::uint64_t>(i)));
        TrainModelCase c = draw_model_case(i, rng);  // LMM+MAG, ..., MAC+LMM, SWA+MAG, MAC+SWA
        const int B = c.batch;
        const Eigen::Index N = uniform_int(rng, 8, 14);
        c.dout = random_matrix(B * N, c.cfg.output_dim(), rng);
        c.ids.clear();
        c.x = random_matrix(B * N, c.cfg.d_model, rng);
        const std::vector<Eigen::Index> cuts =
            i % 2 == 1 ? any_cuts(N, rng) : chunk_cuts(c.cfg.blocks, N, rng);
        INFO("case " << i << " pieces " << cuts.size() - 1);
        titans::Model<double> model(c.cfg, c.p);
        auto s_all = model.make_state(B);
        titans::Model<double>::Trace t_all;
        Matrixd out, dx_all;
        model.forward(s_all, c.x, out, t_all);
        auto g_all = titans::ModelParams<double>::zeros(c.cfg);
        model.backward(t_all, c.dout, g_all, &dx_all);
        auto st = model.make_state(B);
        std::vector<titans::Model<double>::Trace> traces(cuts.size() - 1);
        for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
            model.forward(st, take_tokens(c.x, B, N, cuts[k], cuts[k + 1]), out, traces[k]);
        }
        auto g = titans::ModelParams<double>::zeros(c.cfg);
        Matrixd dx(c.x.rows(), c.x.cols());
        titans::ModelStateGradient<double> d_next;
        for (std::size_t k = traces.size(); k-- > 0;) {
            Matrixd dxk;
            titans::ModelStateGradient<double> d_in;
            model.backward(traces[k], take_tokens(c.dout, B, N, cuts[k], cuts[k + 1]), g, &dxk,
                           &d_in, &d_next);
            put_tokens(dx, dxk, B, N, cuts[k], cuts[k + 1]);
            d_next = std::move(d_in);
        }
        // Each tensor against its one-call value, relative to its own largest entry or, for a
        // tensor far below the gradient's scale (the largest entry of any gradient or dx; a
        // final norm over large rows leaves the blocks' near 1e-6 of the head's), chained_floor.
        const double floor = chained_floor(g_all, c.cfg, dx_all);
        CHECK(note_error<double>("model chained pieces", rel_error(dx, dx_all, floor)) <= 1e-12);
        check_gradients_match(g, g_all, c.cfg, floor, "model chained pieces");
        titans::ModelStateGradient<double> wrong;
        wrong.blocks.resize(3);
        REQUIRE_THROWS_NAMING(model.backward(traces[0], take_tokens(c.dout, B, N, 0, cuts[1]), g,
                                             nullptr, nullptr, &wrong),
                              titans::ShapeError, "blocks.size()");
    }
}

namespace {

/// The largest t in [1, N) where every memory block of `blocks` is at a chunk boundary (a
/// chained piece may end there), or 0 if none.
Eigen::Index last_cut(const std::vector<BlockConfig>& blocks, Eigen::Index N) {
    for (Eigen::Index t = N - 1; t >= 1; --t) {
        bool aligned = true;
        for (const BlockConfig& cfg : blocks) {
            if (!titans::has_memory(cfg.kind)) continue;
            const bool fed_p = cfg.kind == BlockKind::MAG || cfg.kind == BlockKind::MAL;
            aligned = aligned && ((fed_p ? cfg.n_persistent : 0) + t) %
                                         cfg.memory.effective_chunk() == 0;
        }
        if (aligned) return t;
    }
    return 0;
}

/// z's matrices shaped as d's, count for count, and all 0.
void same_zero_layout(const std::vector<Matrixd>& z, const std::vector<Matrixd>& d) {
    REQUIRE(z.size() == d.size());
    for (std::size_t k = 0; k < z.size(); ++k) {
        CHECK(z[k].rows() == d[k].rows());
        CHECK(z[k].cols() == d[k].cols());
        CHECK(z[k].isZero(0));
    }
}
void same_zero_layout(const std::vector<std::vector<Matrixd>>& z,
                      const std::vector<std::vector<Matrixd>>& d) {
    REQUIRE(z.size() == d.size());
    for (std::size_t k = 0; k < z.size(); ++k) same_zero_layout(z[k], d[k]);
}
void same_zero_layout(const titans::BlockStateGradient<double>& z,
                      const titans::BlockStateGradient<double>& d) {
    same_zero_layout(z.memory.weights, d.memory.weights);
    same_zero_layout(z.memory.momentum, d.memory.momentum);
    same_zero_layout(z.memory.conv_tail, d.memory.conv_tail);
    same_zero_layout(z.memory.pending_a, d.memory.pending_a);
    same_zero_layout(z.memory.pending_delta, d.memory.pending_delta);
    same_zero_layout(z.memory.pending_gates, d.memory.pending_gates);
    same_zero_layout(z.attention.keys, d.attention.keys);
    same_zero_layout(z.attention.values, d.attention.values);
    same_zero_layout(z.mac.keys, d.mac.keys);
    same_zero_layout(z.mac.values, d.mac.values);
    same_zero_layout(z.mac.snapshot, d.mac.snapshot);
}

template <class Params, class Config>
void check_same_bits(const Params& a, const Params& b, const Config& cfg) {
    std::vector<Matrixd> ta, tb;
    Params::tensors(a, cfg, [&](const std::string&, const auto& m) { ta.push_back(m); });
    Params::tensors(b, cfg, [&](const std::string&, const auto& m) { tb.push_back(m); });
    REQUIRE(ta.size() == tb.size());
    for (std::size_t k = 0; k < ta.size(); ++k) CHECK(ta[k] == tb[k]);
}

}  // namespace

// Block::zero_state_gradient: every part shaped as the d_state_in that the next piece's
// backward returns (the layout backward reads, found without the helper) and all 0; given to
// the earlier piece's backward as d_state_out it changes nothing (dx and grads bit for bit as
// with none); a state of another block is refused. Every kind, MAC cut inside its segments,
// the memory at a chunk boundary or mid-chunk.
TEST_CASE("block bwd: zero state gradient", "[train][blocks]") {
    int tested = 0;
    for (int i = 0; i < 20; ++i) {
        Rng rng(seed_for("block bwd: zero state gradient", static_cast<std::uint64_t>(i)));
        const BackwardBlockCase c = draw_block_case(kind_of_case(i), i, rng);
        const int B = c.batch;
        // Odd cases cut anywhere: the memory part then has the pending rows' adjoints.
        const Eigen::Index N = c.x.rows() / B,
                           cut = i % 2 == 1 ? N / 2 + 1 : last_cut({c.cfg}, N);
        INFO("case " << i << " kind " << titans::to_string(c.cfg.kind) << " cut " << cut);
        if (cut == 0) continue;
        ++tested;
        titans::Block<double> block(c.cfg, c.p);
        auto st = block.make_state(B);
        titans::Block<double>::Trace t1, t2;
        Matrixd y, dx, dx_none, dx_zero;
        block.forward(st, take_tokens(c.x, B, N, 0, cut), y, t1);
        const titans::BlockStateGradient<double> zero = block.zero_state_gradient(st);
        block.forward(st, take_tokens(c.x, B, N, cut, N), y, t2);
        titans::BlockStateGradient<double> d;
        auto g = BlockParams<double>::zeros(c.cfg);
        block.backward(t2, take_tokens(c.dy, B, N, cut, N), dx, g, &d);
        same_zero_layout(zero, d);
        const Matrixd dy1 = take_tokens(c.dy, B, N, 0, cut);
        auto g_none = BlockParams<double>::zeros(c.cfg), g_zero = g_none;
        block.backward(t1, dy1, dx_none, g_none);
        block.backward(t1, dy1, dx_zero, g_zero, nullptr, &zero);
        CHECK(dx_zero == dx_none);
        check_same_bits(g_zero, g_none, c.cfg);
        const BlockKind other_kind = c.cfg.kind == BlockKind::MAG ? BlockKind::MAL : BlockKind::MAG;
        const BackwardBlockCase o = draw_block_case(other_kind, i, rng);
        titans::Block<double> other(o.cfg, o.p);
        REQUIRE_THROWS_NAMING((void)other.zero_state_gradient(st), titans::ConfigError,
                              "Block::zero_state_gradient: state was made for a different block");
    }
    CHECK(tested >= 10);
}

// Model::zero_state_gradient: one block's zeros per block, shaped as the next piece's
// d_state_in, changing nothing as d_state_out; mixed models of every kind.
TEST_CASE("model bwd: zero state gradient", "[train][model]") {
    int tested = 0;
    for (int i = 0; i < 10; ++i) {
        Rng rng(seed_for("model bwd: zero state gradient", static_cast<std::uint64_t>(i)));
        TrainModelCase c = draw_model_case(i, rng);  // mixed kinds, SWA+MAG and MAC+SWA too
        const int B = c.batch;
        const Eigen::Index N = uniform_int(rng, 8, 14), cut = last_cut(c.cfg.blocks, N);
        c.ids.clear();
        c.x = random_matrix(B * N, c.cfg.d_model, rng);
        c.dout = random_matrix(B * N, c.cfg.output_dim(), rng);
        INFO("case " << i << " cut " << cut);
        if (cut == 0) continue;
        ++tested;
        titans::Model<double> model(c.cfg, c.p);
        auto st = model.make_state(B);
        titans::Model<double>::Trace t1, t2;
        Matrixd out;
        model.forward(st, take_tokens(c.x, B, N, 0, cut), out, t1);
        const titans::ModelStateGradient<double> zero = model.zero_state_gradient(st);
        model.forward(st, take_tokens(c.x, B, N, cut, N), out, t2);
        titans::ModelStateGradient<double> d;
        auto g = titans::ModelParams<double>::zeros(c.cfg);
        Matrixd dx_none, dx_zero;
        model.backward(t2, take_tokens(c.dout, B, N, cut, N), g, nullptr, &d);
        REQUIRE(zero.blocks.size() == d.blocks.size());
        for (std::size_t k = 0; k < d.blocks.size(); ++k) same_zero_layout(zero.blocks[k], d.blocks[k]);
        const Matrixd dout1 = take_tokens(c.dout, B, N, 0, cut);
        auto g_none = titans::ModelParams<double>::zeros(c.cfg), g_zero = g_none;
        model.backward(t1, dout1, g_none, &dx_none);
        model.backward(t1, dout1, g_zero, &dx_zero, nullptr, &zero);
        CHECK(dx_zero == dx_none);
        check_same_bits(g_zero, g_none, c.cfg);
    }
    CHECK(tested >= 5);
}

// An empty piece (0 rows) through every layer's training pass: a 0-row output, a 0-row dx and
// no gradient (the sums over no rows are 0), never an out-of-bounds access.
TEST_CASE("training: empty pieces", "[train][model]") {
    Rng rng(seed_for("training: empty pieces"));
    for (BlockKind kind : trainable_kinds) {
        BackwardBlockCase c = draw_block_case(kind, 0, rng);
        INFO("kind " << titans::to_string(kind));
        const Matrixd none(0, c.cfg.d_model);
        titans::Block<double> block(c.cfg, c.p);
        auto st = block.make_state(c.batch);
        titans::Block<double>::Trace trace;
        Matrixd y, dx;
        block.forward(st, none, y, trace);
        CHECK((y.rows() == 0 && y.cols() == c.cfg.d_model && st.position() == 0));
        auto g = BlockParams<double>::zeros(c.cfg);
        block.backward(trace, none, dx, g);
        CHECK((dx.rows() == 0 && dx.cols() == c.cfg.d_model));
        CHECK(g.memory.w_q.isZero(0));
        CHECK(g.persistent.isZero(0));
        // The memory and the attention on their own: 0 rows out, 0 rows back, no gradient.
        const auto empty_pass = [&](const auto& layer, auto grads, const auto& touched) {
            auto s = layer.make_state(c.batch);
            typename std::decay_t<decltype(layer)>::Trace t;
            layer.forward(s, none, y, t);
            layer.backward(t, none, dx, grads);
            CHECK((y.rows() == 0 && dx.rows() == 0 && touched(grads).isZero(0)));
        };
        if (titans::has_memory(kind)) {
            empty_pass(titans::NeuralMemory<double>(c.cfg.memory, c.p.memory),
                       titans::MemoryParams<double>::zeros(c.cfg.memory),
                       [](const auto& g) { return g.w_o; });
        }
        if (kind != BlockKind::LMM) {
            empty_pass(titans::Attention<double>(c.cfg.attention, c.p.attention),
                       titans::AttentionParams<double>::zeros(c.cfg.attention),
                       [](const auto& g) { return g.w_q; });
        }
    }
    TrainModelCase c = draw_model_case(0, rng);
    titans::Model<double> model(c.cfg, c.p);
    auto st = model.make_state(c.batch);
    titans::Model<double>::Trace trace;
    Matrixd out;
    model.forward_tokens(st, std::vector<int>{}, out, trace);
    CHECK(out.rows() == 0);
    auto g = titans::ModelParams<double>::zeros(c.cfg);
    Matrixd dx;
    model.backward(trace, Matrixd(0, out.cols()), g, &dx);
    CHECK((dx.rows() == 0 && g.head.isZero(0) && g.embedding.isZero(0)));
}
