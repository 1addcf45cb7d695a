// Blocks and models training on the CUDA backend (math §9) against the CPU: every kind (LMM,
// MAC, MAG, MAL, SWA; MAC's training drives the memory's staged reverse and its reads of the
// memory at segment starts), random configurations, batches 1-2, pieces cut where the memory
// is at a chunk boundary (empty ones too) chained through d_state_in / d_state_out. CPU double is the
// reference: CUDA double within 1e-12; CUDA float within 1e-5 of the same problem rounded to
// float, run in double, or within 4x the error of the CPU's own float run where that is larger
// (float loses more than 1e-5 in some cancelling gradient sums on either backend). The
// Trainer on CUDA takes the CPU's steps.

#include <thread>

#include <titans/backend/cuda/cuda.cuh>

#include "block_cases.hpp"
#include "cuda_common.hpp"
#include "trainer_common.hpp"
#include "training_pass.hpp"

namespace {

using namespace titans_test;
using titans::Block;
using titans::BlockStateGradient;
using titans::backend::Cuda;

/// The largest relative error of got against ref: y, dx and every gradient tensor, each
/// relative to its own largest entry or 1e-3 of the case's gradient scale.
double pieces_error(const BlockPieces& got, const BlockPieces& ref, const BlockConfig& cfg) {
    const double floor = std::max(1e-3 * gradient_scale(ref.g, cfg, ref.dx), 1e-300);
    double e = std::max(rel_error(got.y, ref.y), rel_error(got.dx, ref.dx, floor));
    BlockParams<double>::tensors(got.g, cfg, [&](const std::string& name, const auto& t) {
        BlockParams<double>::tensors(ref.g, cfg, [&](const std::string& n2, const auto& t2) {
            if (n2 != name) return;
            const double en = rel_error(Matrixd(t), Matrixd(t2), floor);
            if (!(en <= 1e-12)) UNSCOPED_INFO("tensor " << name << " error " << en);
            e = std::max(e, en);
        });
    });
    return e;
}

}  // namespace

TEMPLATE_TEST_CASE("cuda blocks: training parity", "[cuda]", float, double) {
    using T = TestType;
    const int per_kind = parity_cases(4);
    double worst = 0;
    int index = 0;
    for (BlockKind kind : {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL,
                           BlockKind::SWA}) {
        for (int i = 0; i < per_kind; ++i, ++index) {
            Rng rng(seed_for(std::string("cuda block training ") + type_name<T>(),
                             static_cast<std::uint64_t>(index)));
            const BlockTrainCase tc = block_train_case<T>(kind, i, 12, rng);
            const BlockConfig& cfg = tc.cfg;
            const Block<double> cpu(cfg, tc.params);
            const Block<T, Cuda> gpu(cfg, cast_block<T>(tc.params));
            INFO(titans::to_string(kind) << " case " << i << " B " << tc.B << " N " << tc.N
                                         << " chunk " << cfg.memory.chunk << " persistent "
                                         << cfg.n_persistent << " pieces " << tc.cuts.size() - 1);
            const BlockPieces ref = block_pieces(cpu, tc.B, tc.x, tc.dy, tc.cuts);
            const BlockPieces got = block_pieces(gpu, tc.B, tc.x, tc.dy, tc.cuts);
            const double e = pieces_error(got, ref, cfg);
            // Float: within 1e-5 of CPU double, or as close as the CPU's own run in float
            // (4x its error: a gradient that is a cancelling sum over tokens, such as a gate
            // bias's through MAG's norms, loses more than 1e-5 in float on either backend).
            double own = 0;
            if constexpr (std::is_same_v<T, float>) {
                const Block<float> cpu_f(cfg, cast_block<float>(tc.params));
                own = pieces_error(block_pieces(cpu_f, tc.B, tc.x, tc.dy, tc.cuts), ref, cfg);
            }
            INFO("error " << e << ", the CPU's own in this type " << own);
            CHECK(e <= std::max(bound<T>(), 4 * own));
            worst = std::max(worst, e);
        }
    }
    std::printf("cuda block training (%s): %d cases, worst relative error %.3g (bound %.0e)\n",
                type_name<T>(), index, worst, bound<T>());
}

TEST_CASE("cuda blocks: every kind trains", "[cuda]") {
    STATIC_REQUIRE(Block<double, Cuda>::trainable);
    STATIC_REQUIRE(titans::backend::MemoryTraining<Cuda, float>::staged);
    for (BlockKind kind : {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL,
                           BlockKind::SWA}) {
        CHECK(Block<float, Cuda>::trains(kind));
        CHECK(Block<double, Cuda>::trains(kind));
    }
}

// A 2-layer model of LMM, MAC, MAG, MAL or SWA blocks trained by the Trainer on CUDA in double
// takes the CPU trainer's steps: the same losses and gradient norms to 1e-12 and parameters
// after four steps to 1e-10 (AdamW divides by the second moment's root, which can enlarge a
// gradient's rounding in a tiny entry).
TEST_CASE("cuda trainer: the CPU's steps", "[cuda]") {
    const std::vector<std::pair<BlockKind, BlockKind>> pairs{
        {BlockKind::LMM, BlockKind::MAG}, {BlockKind::MAL, BlockKind::SWA},
        {BlockKind::MAC, BlockKind::LMM}};
    for (std::size_t c = 0; c < pairs.size(); ++c) {
        Rng rng(seed_for("cuda trainer steps", c));
        const int vocab = 11, B = 2, N = 6;
        const ModelCase m = trainer_model_case<double>(pairs[c].first, pairs[c].second, vocab, rng);
        const TrainerConfig tc = trainer_test_config(c == 0 ? 1.0 : 0.0);
        Trainer<double> cpu(m.cfg, m.params, tc);
        Trainer<double, Cuda> gpu(m.cfg, m.params, tc);
        for (int s = 0; s < 4; ++s) {
            const StepData d = step_data("cuda trainer steps", static_cast<std::uint64_t>(s), B, N, vocab);
            const double lc = cpu.step(d.ids, d.labels, B);
            const double lg = gpu.step(d.ids, d.labels, B);
            INFO("pair " << c << " step " << s << " loss " << lc << " vs " << lg);
            CHECK(std::abs(lg - lc) <= 1e-12 * std::abs(lc));
            CHECK(std::abs(gpu.last_gradient_norm() - cpu.last_gradient_norm()) <=
                  1e-12 * cpu.last_gradient_norm());
        }
        double e = 0;
        titans::ModelParams<double>::tensors(gpu.params(), m.cfg, [&](const std::string& name,
                                                                      const auto& t) {
            titans::ModelParams<double>::tensors(cpu.params(), m.cfg, [&](const std::string& n2,
                                                                          const auto& t2) {
                if (n2 == name) e = std::max(e, rel_error(Matrixd(t), Matrixd(t2)));
            });
        });
        CHECK(e <= 1e-10);
        CHECK(gpu.steps() == 4);
    }
}

// Model::set_parameters(flat) on CUDA: values in a device buffer taken there by every layer
// (prepare_flat: the projections, gates and conv taps laid out by device copies, memory_init
// kept on the device) give the logits and the gradients of a model built from them, bit for
// bit, over random configurations (conv or not, constant or data-dependent gates, SwiGLU or
// GELU; MAC's P W_K, P W_V made on the device); the host tensors come back on first read; a
// NaN is refused naming its tensor.
TEMPLATE_TEST_CASE("cuda model: flat parameters", "[cuda]", float, double) {
    using T = TestType;
    using M = titans::Model<T, Cuda>;
    const std::pair<BlockKind, BlockKind> stacks[] = {
        {BlockKind::LMM, BlockKind::MAG}, {BlockKind::MAL, BlockKind::SWA},
        {BlockKind::MAG, BlockKind::LMM}, {BlockKind::SWA, BlockKind::MAL},
        {BlockKind::MAC, BlockKind::LMM}};
    for (std::size_t s = 0; s < std::size(stacks); ++s) {
        Rng rng(seed_for(std::string("cuda model: parameters on device/") + type_name<T>(), s));
        const int vocab = 11, B = uniform_int(rng, 1, 2), N = uniform_int(rng, 3, 9);
        const ModelCase mc = make_model_case<T>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
        const auto pa = cast_model<T>(mc.params);
        const auto pb = cast_model<T>(titans::ModelParams<double>::random(
            mc.cfg, static_cast<unsigned>(uniform_int(rng, 1, 1 << 30))));
        INFO("stack " << s);
        M model(mc.cfg, pa);
        const M built(mc.cfg, pb);
        Matrix<T> flat(1, model.parameter_count());
        titans::detail::flatten_tensors(pb, mc.cfg, flat.data());
        Matrix<T> bad = flat;
        bad(0, 0) = std::numeric_limits<T>::infinity();  // the embedding's first entry
        using Tr = titans::backend::Transfer<Cuda, T>;
        const auto on_dev = Tr::upload(titans::view_of(std::as_const(flat)));
        const auto bad_dev = Tr::upload(titans::view_of(std::as_const(bad)));
        REQUIRE_THROWS_NAMING(model.set_parameters(Tr::view(bad_dev)), titans::NonFiniteError,
                              "embedding");
        model.set_parameters(Tr::view(on_dev));
        const std::vector<int> ids = random_ids(rng, B * N, vocab);
        std::vector<int> labels = random_ids(rng, B * N, vocab);
        auto s1 = model.make_state(B), s2 = built.make_state(B);
        CHECK(identical(model.forward_tokens(s1, ids), built.forward_tokens(s2, ids)));
        CHECK(same_training(model, built, B, ids, labels));
        CHECK(same_param_bits(model.params(), pb, mc.cfg));
    }
}

// A model (two blocks, every kind among the stacks, MAC cut inside segments, two stacks cut
// anywhere: memories left mid-chunk) trained on token ids in chained pieces on CUDA in double equals the CPU's: logits, dx and every gradient
// within 1e-12 (each relative to its own largest entry, or 1e-3 of the gradients' scale).
TEST_CASE("cuda model: chained pieces", "[cuda]") {
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAC, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::LMM},
                                                      {BlockKind::SWA, BlockKind::MAC}};
    for (std::size_t s = 0; s < std::size(stacks); ++s) {
        Rng rng(seed_for("cuda model pieces", s));
        const int vocab = 9, B = uniform_int(rng, 1, 2), N = uniform_int(rng, 6, 12);
        const ModelCase mc =
            make_model_case<double>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
        const std::vector<int> ids = random_ids(rng, B * N, vocab);
        const Matrixd dout = random_matrix(B * N, vocab, rng);
        // The memory trains from mid-chunk on CUDA too: the last two stacks cut anywhere.
        const std::vector<Eigen::Index> cuts =
            s >= 1 ? any_cuts(N, rng) : chunk_cuts(mc.cfg.blocks, N, rng);
        INFO(titans::to_string(stacks[s].first) << " + " << titans::to_string(stacks[s].second)
                                                << " B " << B << " pieces " << cuts.size() - 1);
        const ModelPieces ref =
            model_pieces(titans::Model<double>(mc.cfg, mc.params), B, ids, dout, cuts);
        const ModelPieces got =
            model_pieces(titans::Model<double, Cuda>(mc.cfg, mc.params), B, ids, dout, cuts);
        CHECK(rel_error(got.out, ref.out) <= 1e-12);
        double scale = std::max(ref.dx.cwiseAbs().maxCoeff(), 1e-300);
        titans::ModelParams<double>::tensors(ref.g, mc.cfg, [&](const std::string&, const auto& t) {
            scale = std::max(scale, Matrixd(t).cwiseAbs().maxCoeff());
        });
        const double floor = 1e-3 * scale;
        CHECK(rel_error(got.dx, ref.dx, floor) <= 1e-12);
        titans::ModelParams<double>::tensors(got.g, mc.cfg, [&](const std::string& name,
                                                                const auto& t) {
            titans::ModelParams<double>::tensors(ref.g, mc.cfg, [&](const std::string& n2,
                                                                    const auto& t2) {
                if (n2 != name) return;
                INFO("tensor " << name);
                CHECK(rel_error(Matrixd(t), Matrixd(t2), floor) <= 1e-12);
            });
        });
    }
}

// DeviceBuffer's memory (runtime.cuh, DeviceMemory): Trainer steps and forwards on CUDA take
// every buffer from the device's stream-ordered pool, none from cudaMalloc (counted under the
// emulator), and give the same bits as with DeviceMemory::Direct, which takes them all from
// cudaMalloc.
TEST_CASE("cuda memory: pooled device buffers", "[cuda]") {
    namespace tc = titans::backend::cuda;
    Rng rng(seed_for("cuda pooled buffers", 0));
    const int vocab = 11, B = 2, N = 6;
    const ModelCase m = trainer_model_case<double>(BlockKind::MAG, BlockKind::LMM, vocab, rng);
    const TrainerConfig cfg = trainer_test_config(1.0);
    struct Run {
        std::vector<double> losses;
        Matrixd logits;
    };
    const auto run = [&](tc::DeviceMemory mode) {
        tc::set_device_memory(mode);
        Run r;
        Trainer<double, Cuda> trainer(m.cfg, m.params, cfg);
        for (int s = 0; s < 3; ++s) {
            const StepData d = step_data("cuda pooled buffers", static_cast<std::uint64_t>(s),
                                         B, N, vocab);
            r.losses.push_back(trainer.step(d.ids, d.labels, B));
        }
        const titans::Model<double, Cuda> model(m.cfg, trainer.params());
        auto st = model.make_state(B);
        r.logits = model.forward_tokens(st, random_ids(rng, B * N, vocab));
        tc::set_device_memory(tc::DeviceMemory::Pooled);
        return r;
    };
#if TITANS_CUDA_EMULATION
    const auto c0 = cuda_emulation::allocation_calls();
#endif
    Rng keep = rng;
    const Run pooled = run(tc::DeviceMemory::Pooled);
#if TITANS_CUDA_EMULATION
    const auto c1 = cuda_emulation::allocation_calls();
    CHECK(c1.direct == c0.direct);  // nothing from cudaMalloc
    CHECK(c1.pooled > c0.pooled);
#endif
    rng = keep;
    const Run direct = run(tc::DeviceMemory::Direct);
#if TITANS_CUDA_EMULATION
    const auto c2 = cuda_emulation::allocation_calls();
    CHECK(c2.pooled == c1.pooled);
    CHECK(c2.direct > c1.direct);
#endif
    CHECK(pooled.losses == direct.losses);
    CHECK(identical(pooled.logits, direct.logits));
    tc::release_cached_device_memory();
}

// A model call on CUDA runs in one CallScope (call_scope.cuh): every layer on the thread's
// stream (MAC's mixer too, pieces cut inside its segments), no host wait but its transfers and
// the call's flag at the edge (counted under the emulator); outputs as the CPU's. A deferred check that fails rolls the call back and runs it
// again strictly, which throws the error at its place (block 0 here, not the head's output,
// which is also non-finite), the state as it was.
TEST_CASE("cuda model: one wait per call", "[cuda]") {
    Rng rng(seed_for("cuda call waits", 0));
    const int vocab = 11, d = 8;
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::LMM, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::SWA},
                                                      {BlockKind::MAG, BlockKind::MAL},
                                                      {BlockKind::MAC, BlockKind::LMM},
                                                      {BlockKind::SWA, BlockKind::MAC}};
    for (const auto& [k0, k1] : stacks) {
        const int B = uniform_int(rng, 1, 3), N = uniform_int(rng, 1, 9);
        INFO(titans::to_string(k0) << "+" << titans::to_string(k1) << " B " << B << " N " << N);
        const ModelCase mc = make_model_case<double>(k0, k1, d, vocab, 0, rng);
        const titans::Model<double> cpu(mc.cfg, mc.params);
        const titans::Model<double, Cuda> gpu(mc.cfg, mc.params);
        auto sc = cpu.make_state(B);
        auto sg = gpu.make_state(B);
        for (int piece = 0; piece < 4; ++piece) {
            const std::vector<int> ids = random_ids(rng, B * N, vocab);
            const Matrixd x = random_matrix(B * N, d, rng);
#if TITANS_CUDA_EMULATION
            const long w0 = cuda_emulation::host_waits();
#endif
            const Matrixd lg = piece % 2 == 0 ? gpu.forward_tokens(sg, ids) : gpu.forward(sg, x);
#if TITANS_CUDA_EMULATION
            CHECK(cuda_emulation::host_waits() - w0 == 3);  // input up, output down, the flag
#endif
            const Matrixd lc = piece % 2 == 0 ? cpu.forward_tokens(sc, ids) : cpu.forward(sc, x);
            CHECK(rel_error(lg, lc) <= 1e-12);
        }
        auto bad_p = mc.params;
        bad_p.blocks[0].ffn.w1 *= 1e200;  // block 0's feed-forward overflows
        bad_p.blocks[0].ffn.w2 *= 1e200;
        const titans::Model<double, Cuda> bad(mc.cfg, bad_p);
        const auto copy = sg;
        const auto before = state_tensors(sg);
        const std::vector<int> ids = random_ids(rng, B * N, vocab);
        const std::string what = nonfinite_message([&] { (void)bad.forward_tokens(sg, ids); });
        INFO(what);
        CHECK(what.find("Model::forward: block 0: ") == 0);
        CHECK(same_tensors(state_tensors(sg), before));
        auto other = copy;
        CHECK(identical(gpu.forward_tokens(sg, ids), gpu.forward_tokens(other, ids)));

        // A block's host call likewise: x up, the flag, y down.
        const Block<double> cblk(mc.cfg.blocks[0], mc.params.blocks[0]);
        const Block<double, Cuda> gblk(mc.cfg.blocks[0], mc.params.blocks[0]);
        const Block<double, Cuda> gbad(mc.cfg.blocks[0], bad_p.blocks[0]);
        auto bc = cblk.make_state(B);
        auto bg = gblk.make_state(B);
        const Matrixd x = random_matrix(B * N, d, rng);
#if TITANS_CUDA_EMULATION
        const long w0 = cuda_emulation::host_waits();
#endif
        const Matrixd yg = gblk.forward(bg, x);
#if TITANS_CUDA_EMULATION
        CHECK(cuda_emulation::host_waits() - w0 == 3);
#endif
        CHECK(rel_error(yg, cblk.forward(bc, x)) <= 1e-12);
        const auto bbefore = state_tensors(bg);
        const std::string bwhat = nonfinite_message([&] { (void)gbad.forward(bg, x); });
        INFO(bwhat);
        CHECK(bwhat.find("the output is not finite at sequence") != std::string::npos);
        CHECK(same_tensors(state_tensors(bg), bbefore));
    }
}

// A memory that diverges inside a model call on CUDA (block 0's LMM or MAL, clipping off, its
// values scaled up): its checks are deferred to the call's flag like the others (its output's
// left to the block's output: cuda::OutputCovered), so the call is rolled back and run again
// strictly, and the error is the memory's, named in block 0 as the CPU names it; the state as
// it was, and the model continues it. Two ways: its reads diverge (then the block's output is
// not finite either: in MAL through the attention over them), and only its weights at the
// piece's last chunk end (a piece of one chunk: every read of it uses the finite start
// weights, so the output is finite and the memory's own flag is all that stops the call from
// committing them).
TEST_CASE("cuda model: deferred memory error", "[cuda]") {
    Rng rng(seed_for("cuda deferred memory", 0));
    const int vocab = 11, d = 8;
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::LMM, BlockKind::MAG},
                                                      {BlockKind::LMM, BlockKind::SWA},
                                                      {BlockKind::MAL, BlockKind::LMM}};
    for (const auto& [k0, k1] : stacks) {
        ModelCase mc = make_model_case<double>(k0, k1, d, vocab, 0, rng);
        mc.cfg.blocks[0].memory.max_grad_norm = 0;
        mc.cfg.blocks[0].memory.retrieval = Retrieval::Lagged;  // reads at the chunk start
        mc.cfg.blocks[0].memory.gates = titans::GateMode::DataDependent;  // theta_max scales
        mc.params.blocks[0] = random_block_params<double>(mc.cfg.blocks[0], rng);
        const int B = uniform_int(rng, 1, 2), C = mc.cfg.blocks[0].memory.effective_chunk();
        const titans::Model<double> cpu(mc.cfg, mc.params);
        const titans::Model<double, Cuda> gpu(mc.cfg, mc.params);
        bool weights_only = false;  // a case whose divergence is in the weights alone was met
        // {scale of w_v, theta_max or 0 for the drawn one}: reads diverging, then steps so
        // large that only the weights at the chunk end overflow.
        const std::pair<double, double> cases[] = {
            {1e200, 0}, {1, 1e306}, {1, 1.7e308}, {1e10, 1.7e308}, {1e100, 1.7e308}};
        // MAL's memory counts its persistent tokens first: its one-chunk pieces end at a chunk
        // end all the same (a later read would see the overflowed weights, which the CPU names
        // first and the CUDA backend, checking the weights at the piece's end, after the read)
        const int lead = k0 == BlockKind::LMM ? 0 : mc.cfg.blocks[0].n_persistent % C;
        for (const auto& [scale, theta_max] : cases) {
            const int N = theta_max == 0 ? 3 * C + 1 : C - lead;
            INFO(titans::to_string(k0) << "+" << titans::to_string(k1) << " B " << B << " N " << N
                                       << " scale " << scale << " theta_max " << theta_max);
            auto bad_p = mc.params;
            bad_p.blocks[0].memory.w_v *= scale;
            titans::ModelConfig bad_cfg = mc.cfg;
            if (theta_max > 0) bad_cfg.blocks[0].memory.theta_max = theta_max;
            const titans::Model<double> cbad(bad_cfg, bad_p);
            const titans::Model<double, Cuda> gbad(bad_cfg, bad_p);
            // (MAL's state starts with its persistent tokens through the memory of the model that
            // makes it: the healthy one's where the healthy model continues it)
            auto sc = theta_max == 0 ? cpu.make_state(B) : cbad.make_state(B);
            auto sg = theta_max == 0 ? gpu.make_state(B) : gbad.make_state(B);
            if (theta_max == 0) {  // the drawn config: the healthy model's state, to a chunk end
                const std::vector<int> warm = random_ids(rng, B * C, vocab);
                (void)cpu.forward_tokens(sc, warm);
                (void)gpu.forward_tokens(sg, warm);
            }
            const auto before = state_tensors(sg);
            const std::vector<int> ids = random_ids(rng, B * N, vocab);
            const std::string cwhat =
                nonfinite_message([&] { (void)cbad.forward_tokens(sc, ids); });
            const std::string what =
                nonfinite_message([&] { (void)gbad.forward_tokens(sg, ids); });
            INFO(what << "\nCPU: " << cwhat);
            const std::string prefix = std::string("Model::forward: block 0: Block (") +
                                       titans::to_string(k0) + "): NeuralMemory::forward: ";
            if (cwhat.find(prefix) != 0) {
                continue;  // this case overflows elsewhere first
            }
            const bool weights = cwhat.find("non-finite memory weights") != std::string::npos;
            weights_only = weights_only || weights;
            CHECK(what.find(prefix) == 0);
            CHECK(what.find(weights ? "non-finite memory weights" : "a non-finite memory read") !=
                  std::string::npos);
            CHECK(same_tensors(state_tensors(sg), before));
            if (theta_max == 0) {
                CHECK(rel_error(gpu.forward_tokens(sg, ids), cpu.forward_tokens(sc, ids)) <=
                      1e-12);
            }
        }
        CHECK(weights_only);
    }
}

// Inside a model's CallScope a block checks its output alone: the checks of its input x and of
// its mixer's residual sum are covered by it (y = x + Mixer(u), y += FFN(RMSNorm(y)) keeps a
// non-finite entry non-finite), and the strict rerun a raised flag makes names the first
// failing check. Three ways, each message the CPU's and the state unchanged: the model's input
// holds a NaN (block 0's x), block 0's residual sum overflows (x near the largest double, its
// attention's W_O scaled up: the attention's output itself finite), its feed-forward
// overflows (the output), and so does block 1's (whose check shares a kernel with the model's
// final norm). Counted by the emulator: a one-token call of a two-block model makes 2 deferred
// block checks where it made 6, each in the launch of the block's last sum.
TEST_CASE("cuda model: one deferred check a block", "[cuda]") {
    Rng rng(seed_for("cuda deferred block checks", 0));
    const int d = 8, B = 2;
    titans::ModelConfig cfg;
    cfg.d_model = d;
    for (const BlockKind k : {BlockKind::SWA, BlockKind::LMM}) {
        cfg.blocks.push_back(titans::BlockConfig::make(k, d, 2, 2, 6, 4));
    }
    const auto params = titans::ModelParams<double>::random(cfg, 7);
    const titans::Model<double> cpu(cfg, params);
    const titans::Model<double, Cuda> gpu(cfg, params);
    auto sc = cpu.make_state(B);
    auto sg = gpu.make_state(B);
    for (int t = 0; t < 3; ++t) {
        const Matrixd x = random_matrix(B, d, rng);
#if TITANS_CUDA_EMULATION
        const long k0 = cuda_emulation::total_launches(), g0 = cuda_emulation::gemm_calls();
#endif
        const Matrixd yg = gpu.forward(sg, x);
#if TITANS_CUDA_EMULATION
        // SWA: the pre-norm, the attention (its kernel appends the token to the window), the
        // residual sum with the feed-forward's pre-norm, the feed-forward's activation,
        // its sum with the output check and LMM's pre-norm (5); LMM: the same with the
        // memory's 1 kernel for the attention's, the final norm in its last sum, its own
        // pre-norm in SWA's (4); the attention's and the memory's output checks are left to
        // the residual sum's (cuda model: covered attention checks, cuda memory: decode
        // checks in the kernel). With the append a launch of its own: 10; with the sums, the
        // norms and the checks each a launch of their own too: 20; with x's and the residual
        // sum's checks too: 24. With the feed-forward of few rows, each block's two sums and
        // the norms after them in the feed-forward's kernel: 5.
        CHECK(cuda_emulation::total_launches() - k0 ==
              (titans::backend::cuda::fused_feed_forward() ? 5 : 9));
        // GEMMs: the attention's projections and output, the memory's, each feed-forward's
        // x [W1 | W3] and its W2 (one product for W1 and W3 since 2026-11-29: 11 before), the
        // head: 9; 5 with the feed-forward of few rows (its products in its one kernel).
        CHECK(cuda_emulation::gemm_calls() - g0 ==
              (titans::backend::cuda::fused_feed_forward() ? 5 : 9));
#endif
        CHECK(rel_error(yg, cpu.forward(sc, x)) <= 1e-12);
    }
    const auto expect_cpu_error = [&](const titans::Model<double>& c,
                                      const titans::Model<double, Cuda>& g, const Matrixd& x,
                                      const char* what) {
        auto cs = sc;
        auto gs = sg;
        const auto before = state_tensors(gs);
        const std::string cw = nonfinite_message([&] { (void)c.forward(cs, x); });
        const std::string gw = nonfinite_message([&] { (void)g.forward(gs, x); });
        INFO("CPU: " << cw << "\nCUDA: " << gw);
        REQUIRE(cw.find(what) != std::string::npos);  // the case fails where it is meant to
        CHECK(gw == cw);
        CHECK(same_tensors(state_tensors(gs), before));
    };
    Matrixd xn = random_matrix(B, d, rng);
    xn(1, 3) = std::numeric_limits<double>::quiet_NaN();
    expect_cpu_error(cpu, gpu, xn, "block 0: Block::forward: x has a NaN");
    auto big = params;
    big.blocks[0].attention.w_o *= 1e307;
    const titans::Model<double> cbig(cfg, big);
    const titans::Model<double, Cuda> gbig(cfg, big);
    const Matrixd xb = Matrixd::Constant(B, d, 1.79e308);
    expect_cpu_error(cbig, gbig, xb, "the mixer's residual sum is not finite");
    auto ffn = params;
    ffn.blocks[0].ffn.w1 *= 1e200;
    ffn.blocks[0].ffn.w2 *= 1e200;
    const titans::Model<double> cffn(cfg, ffn);
    const titans::Model<double, Cuda> gffn(cfg, ffn);
    expect_cpu_error(cffn, gffn, random_matrix(B, d, rng), "the output is not finite");
    auto last = params;  // the last block's output: its check in the final norm's kernel
    last.blocks[1].ffn.w1 *= 1e200;
    last.blocks[1].ffn.w2 *= 1e200;
    const titans::Model<double> clast(cfg, last);
    const titans::Model<double, Cuda> glast(cfg, last);
    expect_cpu_error(clast, glast, random_matrix(B, d, rng), "block 1: Block (LMM): the output");
}

// Inside a model's deferring call, SWA's and MAL's attention output (straight into the
// residual sum) and MAG's (read by the gated norms' kernel, which checks its inputs) leave
// their own check to that later one (cuda::OutputCovered; MAL's memory output too, which its
// attention reads): an attention whose output overflows (W_V and W_O x 1e200) still fails the
// call with the CPU's message naming the attention, the state unchanged; one token of
// SWA + LMM makes 9 kernels, 10 with the check; MAL + LMM 10, 12 with the two checks (4 fewer
// with the feed-forward of few rows: each block's two sums and norms in its kernel).
TEST_CASE("cuda model: covered attention checks", "[cuda]") {
    Rng rng(seed_for("cuda covered attention checks", 0));
    const int d = 8, B = 2;
    for (const BlockKind kind : {BlockKind::SWA, BlockKind::MAG, BlockKind::MAL}) {
        INFO(titans::to_string(kind));
        titans::ModelConfig cfg;
        cfg.d_model = d;
        for (const BlockKind k : {kind, BlockKind::LMM}) {
            cfg.blocks.push_back(titans::BlockConfig::make(k, d, 2, 2, 6, 4));
        }
        auto params = titans::ModelParams<double>::random(cfg, 11);
        auto sc = titans::Model<double>(cfg, params).make_state(B);
        auto sg = titans::Model<double, Cuda>(cfg, params).make_state(B);
        const Matrixd x0 = random_matrix(B, d, rng);
        (void)titans::Model<double>(cfg, params).forward(sc, x0);
        (void)titans::Model<double, Cuda>(cfg, params).forward(sg, x0);
        if (kind != BlockKind::MAG) {
            const titans::Model<double, Cuda> gpu(cfg, params);
            auto st = sg;
#if TITANS_CUDA_EMULATION
            const long k0 = cuda_emulation::total_launches();
#endif
            (void)gpu.forward(st, random_matrix(B, d, rng));
#if TITANS_CUDA_EMULATION
            const int fused = titans::backend::cuda::fused_feed_forward() ? 4 : 0;
            CHECK(cuda_emulation::total_launches() - k0 ==
                  (kind == BlockKind::SWA ? 9 : 10) - fused);
#endif
        }
        params.blocks[0].attention.w_v *= 1e200;
        params.blocks[0].attention.w_o *= 1e200;
        const titans::Model<double> cpu(cfg, params);
        const titans::Model<double, Cuda> gpu(cfg, params);
        const Matrixd x = random_matrix(B, d, rng);
        const auto before = state_tensors(sg);
        const std::string cw = nonfinite_message([&] { (void)cpu.forward(sc, x); });
        const std::string gw = nonfinite_message([&] { (void)gpu.forward(sg, x); });
        INFO("CPU: " << cw << "\nCUDA: " << gw);
        REQUIRE(cw.find("Attention::forward: the output is not finite") != std::string::npos);
        CHECK(gw == cw);
        CHECK(same_tensors(state_tensors(sg), before));
    }
}

// A model's call and a block's host call take their temporaries (the activations between the
// blocks, each block's normalised input and feed-forward output, MAG's and MAL's memory
// output, the feed-forward's hidden rows, the uploaded input, the downloaded output, the
// call's flag) from the thread's CallArena (call_scope.cuh): once warm, a decode call
// allocates no device memory (it made 31 pooled allocations a token for the four-block decode
// benchmark's model, 2026-11-29), and gives the CPU's outputs. Every kind, one token a call,
// chunk ends included; counted by the emulator.
TEST_CASE("cuda model: a decode call allocates nothing", "[cuda]") {
    Rng rng(seed_for("cuda decode allocations", 0));
    const int vocab = 11, d = 8, B = 2;
    const std::pair<BlockKind, BlockKind> stacks[] = {
        {BlockKind::LMM, BlockKind::MAG}, {BlockKind::MAL, BlockKind::SWA},
        {BlockKind::MAC, BlockKind::LMM}};
    for (const auto& [k0, k1] : stacks) {
        INFO(titans::to_string(k0) << "+" << titans::to_string(k1));
        const ModelCase mc = make_model_case<double>(k0, k1, d, vocab, 0, rng);
        const titans::Model<double> cpu(mc.cfg, mc.params);
        const titans::Model<double, Cuda> gpu(mc.cfg, mc.params);
        const Block<double> cblk(mc.cfg.blocks[0], mc.params.blocks[0]);
        const Block<double, Cuda> gblk(mc.cfg.blocks[0], mc.params.blocks[0]);
        auto sc = cpu.make_state(B);
        auto sg = gpu.make_state(B);
        auto bc = cblk.make_state(B);
        auto bg = gblk.make_state(B);
        for (int t = 0; t < 40; ++t) {  // the first 20 warm up (window moves, chunk ends)
            const Matrixd x = random_matrix(B, d, rng);
#if TITANS_CUDA_EMULATION
            const auto a0 = cuda_emulation::allocation_calls();
#endif
            const Matrixd yg = gpu.forward(sg, x);
            const Matrixd bg_y = gblk.forward(bg, x);
#if TITANS_CUDA_EMULATION
            const auto a1 = cuda_emulation::allocation_calls();
            if (t >= 20) {
                INFO("token " << t);
                CHECK(a1.pooled + a1.direct == a0.pooled + a0.direct);
            }
#endif
            CHECK(rel_error(yg, cpu.forward(sc, x)) <= 1e-12);
            CHECK(rel_error(bg_y, cblk.forward(bc, x)) <= 1e-12);
        }
    }
}

namespace {

/// The host waits so far (the emulator's count; 0 on a GPU, where they are not counted).
long cuda_emulation_waits() {
#if TITANS_CUDA_EMULATION
    return cuda_emulation::host_waits();
#else
    return 0;
#endif
}

/// A model's tensors by name, as same_tensors compares them.
std::vector<std::pair<std::string, Matrixd>> listed_params(const titans::ModelParams<double>& p,
                                                           const titans::ModelConfig& cfg) {
    std::vector<std::pair<std::string, Matrixd>> l;
    titans::ModelParams<double>::tensors(p, cfg, [&](const std::string& n, const auto& t) {
        l.emplace_back(n, Matrixd(t));
    });
    return l;
}

}  // namespace

// A Trainer step on CUDA runs its gradients pass (the training forward, the loss, the
// backward) in one CallScope: in a scope that pass makes fewer host waits than without one
// (counted under the emulator) and gives the same loss and gradients, bit for bit; the
// trainer's steps are the CPU's (test above). A memory diverging inside the pass (block 0's
// weights at the piece's one chunk end, every read and the loss finite) raises the scope's
// flag: the trainer runs the pass again strictly and throws the memory's error as the CPU's
// trainer does (without the rerun it would take the step), the trainer unchanged.
TEST_CASE("cuda trainer: one scope a step", "[cuda]") {
    Rng rng(seed_for("cuda trainer scope", 0));
    const int vocab = 11, B = 2;
    for (const BlockKind k1 : {BlockKind::MAG, BlockKind::SWA}) {
        ModelCase m = trainer_model_case<double>(BlockKind::LMM, k1, vocab, rng);
        const int N = m.cfg.blocks[0].memory.effective_chunk();
        const TrainerConfig tc = trainer_test_config(1.0);
        const StepData d = step_data("cuda trainer scope", 0, B, N, vocab);
        const titans::Model<double, Cuda> model(m.cfg, m.params);
        const auto pass = [&](titans::ModelGradients<double, Cuda>& g) {
            auto st = model.make_state(B);
            typename titans::Model<double, Cuda>::Trace trace;
            const double loss = model.forward_loss(st, d.ids, d.labels, trace);
            model.backward_loss(trace, g);
            return loss;
        };
        titans::ModelGradients<double, Cuda> g0(model), g1(model);
        (void)pass(g0);  // the pools warmed
        g0.zero();
        const long w0 = cuda_emulation_waits();
        const double l0 = pass(g0);
        const long plain = cuda_emulation_waits() - w0;
        double l1 = 0;
        {
            typename titans::backend::GlueKernels<Cuda, double>::CallScope scope;
            l1 = pass(g1);
            CHECK_FALSE(scope.flagged());
        }
        const long scoped = cuda_emulation_waits() - w0 - plain;
        INFO("LMM+" << titans::to_string(k1) << ": " << plain << " waits, in a scope " << scoped);
#if TITANS_CUDA_EMULATION
        CHECK(scoped < plain);
#endif
        CHECK(l1 == l0);
        CHECK(same_tensors(listed_params(g1.to_params(), m.cfg),
                           listed_params(g0.to_params(), m.cfg)));

        // Block 0's memory: clipping off, lagged reads, steps so large that its weights
        // overflow at the chunk end of a piece of one chunk.
        m.cfg.blocks[0].memory.max_grad_norm = 0;
        m.cfg.blocks[0].memory.retrieval = Retrieval::Lagged;
        m.cfg.blocks[0].memory.gates = titans::GateMode::DataDependent;
        m.cfg.blocks[0].memory.theta_max = 1.7e308;
        m.params.blocks[0] = random_block_params<double>(m.cfg.blocks[0], rng);
        m.params.blocks[0].memory.w_v *= 1e10;
        Trainer<double> cbad(m.cfg, m.params, tc);
        Trainer<double, Cuda> gbad(m.cfg, m.params, tc);
        const std::string cwhat =
            nonfinite_message([&] { (void)cbad.step(d.ids, d.labels, B); });
        const std::string what =
            nonfinite_message([&] { (void)gbad.step(d.ids, d.labels, B); });
        INFO(what << "\nCPU: " << cwhat);
        const std::string named =
            "Model::forward: block 0: Block (LMM): NeuralMemory::forward: non-finite memory "
            "weights";
        REQUIRE(cwhat.find(named) == 0);
        CHECK(what.find(named) == 0);
        CHECK(gbad.steps() == 0);
        CHECK(same_tensors(listed_params(gbad.params(), m.cfg), listed_params(m.params, m.cfg)));
    }
}

namespace {

/// Call graphs on or off for its lifetime (call_graph.cuh), the setting restored after.
struct CallGraphs {
    bool was = titans::backend::cuda::call_graphs();
    explicit CallGraphs(bool on) { titans::backend::cuda::set_call_graphs(on); }
    CallGraphs(const CallGraphs&) = delete;
    CallGraphs& operator=(const CallGraphs&) = delete;
    ~CallGraphs() { titans::backend::cuda::set_call_graphs(was); }
};

}  // namespace

// The call tape on its own (call_graph.cuh): inside a deferring CallScope, element-wise kernels
// on this thread's stream are recorded and run at the scope's end. A call's first sighting runs
// as recorded, its second is built into a graph and launched, the third launches that graph
// with the kernels whose arguments changed updated (here every one: each call adds its own
// value), a call of another shape (other grids) runs as recorded again; a call with fewer
// records than graph_min_records never becomes a graph. Every result is the plain sum.
TEST_CASE("cuda graphs: the call tape", "[cuda]") {
    namespace cu = titans::backend::cuda;
    const CallGraphs on(true);
    const long long n = 300;
    cu::DeviceBuffer<double> buf(static_cast<std::size_t>(n));
    std::vector<double> host(static_cast<std::size_t>(n), 0.0), expect = host;
    cu::check(cudaMemcpy(buf.data(), host.data(), n * sizeof(double), cudaMemcpyHostToDevice),
              "upload");
    const auto call = [&](int kernels, long long len, double base) {
        cu::CallScope scope;
        double* p = buf.data();
        for (int k = 0; k < kernels; ++k) {
            const double add = base + k;
            cu::each(cu::thread_context().stream(), len,
                     [=] __device__(unsigned i) { p[i] = 2 * p[i] + add; });
            for (long long i = 0; i < len; ++i) {
                expect[static_cast<std::size_t>(i)] =
                    2 * expect[static_cast<std::size_t>(i)] + add;
            }
        }
        CHECK_FALSE(scope.flagged());
    };
    const cu::CallGraphStats s0 = cu::call_graph_stats();
    const auto since = [&] {
        const cu::CallGraphStats& s = cu::call_graph_stats();
        return std::array<long long, 4>{s.built - s0.built, s.launched - s0.launched,
                                        s.updated - s0.updated, s.direct - s0.direct};
    };
    const int K = static_cast<int>(cu::CallTape::graph_min_records) + 2;
    call(K, n, 0.25);  // first sighting: as recorded
    CHECK(since() == std::array<long long, 4>{0, 0, 0, 1});
    call(K, n, 0.5);  // second: built, launched (its arguments those it was built with)
    CHECK(since() == std::array<long long, 4>{1, 1, 0, 1});
    call(K, n, 0.75);  // third: every kernel's value changed
    CHECK(since() == std::array<long long, 4>{1, 2, K, 1});
    call(K, 200, 0.75);  // another shape (one block a launch, not two)
    CHECK(since() == std::array<long long, 4>{1, 2, K, 2});
    call(K, n, 0.75);  // the graph again, as last launched: nothing to update
    CHECK(since() == std::array<long long, 4>{1, 3, K, 2});
    call(2, n, 1.0);  // too short for a graph
    call(2, n, 1.0);
    CHECK(since() == std::array<long long, 4>{1, 3, K, 4});
    cu::check(cudaMemcpy(host.data(), buf.data(), n * sizeof(double), cudaMemcpyDeviceToHost),
              "download");
    CHECK(host == expect);
}

// The handles a call tape records products of (this thread's, in either math mode) run with the
// thread's own cuBLAS workspace, set after their stream (cublasSetStream resets it): a product
// captured into a call graph's child graph then allocates nothing (cudaGraphAddChildGraphNode
// refuses a child holding an allocation node). Another thread has its own; a state's own
// context keeps cuBLAS's default pool.
TEST_CASE("cuda graphs: a workspace per thread", "[cuda]") {
    namespace cu = titans::backend::cuda;
    const cu::StreamContext& t = cu::thread_context();
    const cu::StreamContext& o = cu::thread_context_other_mode();
    REQUIRE(t.stream() == o.stream());
    CHECK(t.tf32() != o.tf32());
    const std::size_t bytes = cu::blas_workspace_bytes();
    CHECK(bytes >= (std::size_t(4) << 20));
    CHECK(t.workspace() != nullptr);
    CHECK(t.workspace_bytes() == bytes);
    CHECK(o.workspace() == t.workspace());
    CHECK(o.workspace_bytes() == bytes);
    const cu::StreamContext own;
    CHECK(own.workspace() == nullptr);
    const void* other = nullptr;
    std::thread([&] { other = cu::thread_context().workspace(); }).join();
    CHECK(other != nullptr);
    CHECK(other != t.workspace());
#if TITANS_CUDA_EMULATION
    // What cuBLAS was told (the emulated handle resets it on cublasSetStream, as cuBLAS does).
    CHECK(cuda_emulation::blas_workspace(t.blas()) ==
          std::pair<void*, std::size_t>{const_cast<void*>(t.workspace()), bytes});
    CHECK(cuda_emulation::blas_workspace(o.blas()) ==
          std::pair<void*, std::size_t>{const_cast<void*>(t.workspace()), bytes});
    CHECK(cuda_emulation::blas_workspace(own.blas()).first == nullptr);
    CHECK(bytes == (std::size_t(32) << 20));  // the emulated device is sm_90
#endif
}

// Model::forward with call graphs (call_graph.cuh) against the same model without them: every
// block kind among the stacks, batches 1-2, 40 decode tokens (window moves, chunk ends, MAC's
// segments) then pieces of 2-5 tokens: the same output bits, within 1e-12 of the CPU, graphs
// built, launched and updated along the way (a decode token's attention position changes
// every call). A NaN in the input then fails the call with the message of the run without
// graphs, the state unchanged, and decoding continues identically.
TEST_CASE("cuda model: call graphs", "[cuda]") {
    namespace cu = titans::backend::cuda;
    Rng rng(seed_for("cuda call graphs", 0));
    const int vocab = 11, d = 8;
    const std::pair<BlockKind, BlockKind> stacks[] = {
        {BlockKind::LMM, BlockKind::MAG}, {BlockKind::MAL, BlockKind::SWA},
        {BlockKind::MAC, BlockKind::LMM}};
    for (const auto& [k0, k1] : stacks) {
        const int B = uniform_int(rng, 1, 2);
        INFO(titans::to_string(k0) << "+" << titans::to_string(k1) << " B " << B);
        const ModelCase mc = make_model_case<double>(k0, k1, d, vocab, 0, rng);
        const titans::Model<double> cpu(mc.cfg, mc.params);
        const titans::Model<double, Cuda> gpu(mc.cfg, mc.params);
        auto sc = cpu.make_state(B);
        auto plain = gpu.make_state(B), graphed = gpu.make_state(B);
        const cu::CallGraphStats s0 = cu::call_graph_stats();
        const auto step = [&](int N) {
            const Matrixd x = random_matrix(B * N, d, rng);
            Matrixd y0, y1;
            {
                const CallGraphs off(false);
                y0 = gpu.forward(plain, x);
            }
            {
                const CallGraphs on(true);
                y1 = gpu.forward(graphed, x);
            }
            CHECK(identical(y1, y0));
            CHECK(rel_error(y1, cpu.forward(sc, x)) <= 1e-12);
        };
        for (int t = 0; t < 40; ++t) {
            step(1);
        }
        const cu::CallGraphStats& s = cu::call_graph_stats();
        CHECK(s.built > s0.built);
        CHECK(s.launched - s0.launched >= 20);
        CHECK(s.updated > s0.updated);
        for (int t = 0; t < 6; ++t) {
            step(uniform_int(rng, 2, 5));
        }
        Matrixd xn = random_matrix(B, d, rng);
        xn(B - 1, 2) = std::numeric_limits<double>::quiet_NaN();
        const auto before = state_tensors(graphed);
        std::string plain_what, graphed_what;
        {
            const CallGraphs off(false);
            plain_what = nonfinite_message([&] { (void)gpu.forward(plain, xn); });
        }
        {
            const CallGraphs on(true);
            graphed_what = nonfinite_message([&] { (void)gpu.forward(graphed, xn); });
        }
        CHECK(!graphed_what.empty());
        CHECK(graphed_what == plain_what);
        CHECK(same_tensors(state_tensors(graphed), before));
        for (int t = 0; t < 4; ++t) {
            step(1);
        }
        CHECK(same_tensors(state_tensors(graphed), state_tensors(plain)));
    }
}

// A model with the one-launch feed-forward of few rows (feed_forward_rows.cuh) in both blocks,
// hidden widths of one block (GELU, 40) and of four (SwiGLU, 200: partials summed by the last
// block): 24 decode tokens at B 1-3, then calls of 2-5 tokens, then one of 17 rows (the cuBLAS
// path), within 1e-12 of the CPU, the same bits with call graphs on and off, and two products
// fewer a feed-forward where it applies (the activation's kernel becomes the fused one) and two
// launches fewer (the block's two sums and the norms after them run in the fused kernel).
TEST_CASE("cuda model: few-row FFN", "[cuda]") {
    namespace cu = titans::backend::cuda;
    struct Fused {
        bool was = cu::fused_feed_forward();
        explicit Fused(bool on) { cu::set_fused_feed_forward(on); }
        ~Fused() { cu::set_fused_feed_forward(was); }
    };
    Rng rng(seed_for("cuda model: few-row FFN", 0));
    const int vocab = 11, d = 8, B = uniform_int(rng, 1, 3);
    ModelCase mc = make_model_case<double>(BlockKind::MAG, BlockKind::LMM, d, vocab, 0, rng);
    mc.cfg.blocks[0].use_ffn = mc.cfg.blocks[1].use_ffn = true;
    mc.cfg.blocks[0].ffn = {.d_model = d, .kind = titans::FeedForwardKind::SwiGLU, .hidden = 200};
    mc.cfg.blocks[1].ffn = {.d_model = d, .kind = titans::FeedForwardKind::GELU, .hidden = 40};
    mc.params = titans::ModelParams<double>::random(mc.cfg, rng());
    const titans::Model<double> cpu(mc.cfg, mc.params);
    const titans::Model<double, Cuda> gpu(mc.cfg, mc.params);
    auto sc = cpu.make_state(B);
    auto plain = gpu.make_state(B), fused = gpu.make_state(B), graphed = gpu.make_state(B);
    INFO("B " << B);
    // One call on state st with the fused feed-forward and call graphs as given; gemms: its
    // products (counted under the emulator).
    struct Count {
        long gemms = 0, launches = 0;
    };
    const auto run = [&](auto& st, bool ffn, bool graphs, const Matrixd& x, Count& n) {
        const Fused f(ffn);
        const CallGraphs g(graphs);
#if TITANS_CUDA_EMULATION
        n = {-cuda_emulation::gemm_calls(), -cuda_emulation::total_launches()};
#endif
        Matrixd y = gpu.forward(st, x);
#if TITANS_CUDA_EMULATION
        n.gemms += cuda_emulation::gemm_calls();
        n.launches += cuda_emulation::total_launches();
#endif
        return y;
    };
    const auto step = [&](int N) {
        const Matrixd x = random_matrix(B * N, d, rng);
        Count n0, n1, n2;
        const Matrixd y0 = run(plain, false, false, x, n0), y1 = run(fused, true, false, x, n1),
                      y2 = run(graphed, true, true, x, n2);
#if TITANS_CUDA_EMULATION
        const bool applies = B * N <= cu::feed_forward_rows_max;
        CHECK(n0.gemms - n1.gemms == (applies ? 4 : 0));
        CHECK(n0.launches - n1.launches == (applies ? 4 : 0));
        CHECK(n2.gemms == n1.gemms);
#endif
        CHECK(identical(y2, y1));
        const Matrixd yc = cpu.forward(sc, x);
        CHECK(rel_error(y1, yc) <= 1e-12);
        CHECK(rel_error(y0, yc) <= 1e-12);
    };
    for (int t = 0; t < 24; ++t) {
        step(1);
    }
    for (int t = 0; t < 4; ++t) {
        step(uniform_int(rng, 2, 5));
    }
    step(17);
    step(1);
}

// Models with the few-row product on (rows_product.cuh: every product of <= 8 rows, the
// memory's batched ones too), every block kind (MAC and MAL, MAG and LMM; a feed-forward in
// the first block; a head): 16 decode tokens at B 1-3, calls of 2-5 tokens, one of 9 a
// sequence; within 1e-12 of the CPU, the same bits with call graphs on and off, and fewer
// cuBLAS calls than with it off wherever a call has at most 8 rows.
TEST_CASE("cuda model: few-row product", "[cuda]") {
    namespace cu = titans::backend::cuda;
    struct Rows {
        bool was = cu::rows_product();
        explicit Rows(bool on) { cu::set_rows_product(on); }
        ~Rows() { cu::set_rows_product(was); }
    };
    Rng rng(seed_for("cuda model: few-row product", 0));
    for (const auto& [k0, k1] : {std::pair{BlockKind::MAC, BlockKind::MAL},
                                 std::pair{BlockKind::MAG, BlockKind::LMM}}) {
        const int vocab = 11, d = 8, B = uniform_int(rng, 1, 3);
        const ModelCase mc = make_model_case<double>(k0, k1, d, vocab, 0, rng);
        const titans::Model<double> cpu(mc.cfg, mc.params);
        const titans::Model<double, Cuda> gpu(mc.cfg, mc.params);
        auto sc = cpu.make_state(B);
        auto plain = gpu.make_state(B), rows = gpu.make_state(B), graphed = gpu.make_state(B);
        INFO("kinds " << static_cast<int>(k0) << " " << static_cast<int>(k1) << " B " << B);
        const auto run = [&](auto& st, bool on, bool graphs, const Matrixd& x, long& gemms) {
            const Rows r(on);
            const CallGraphs g(graphs);
#if TITANS_CUDA_EMULATION
            gemms = -cuda_emulation::gemm_calls();
#endif
            Matrixd y = gpu.forward(st, x);
#if TITANS_CUDA_EMULATION
            gemms += cuda_emulation::gemm_calls();
#endif
            return y;
        };
        const auto step = [&](int N) {
            const Matrixd x = random_matrix(B * N, d, rng);
            long g0 = 0, g1 = 0, g2 = 0;
            const Matrixd y0 = run(plain, false, false, x, g0), y1 = run(rows, true, false, x, g1),
                          y2 = run(graphed, true, true, x, g2);
#if TITANS_CUDA_EMULATION
            if (B * N <= cu::rows_product_max) {
                CHECK(g1 < g0);
            }
            CHECK(g2 == g1);
#endif
            CHECK(identical(y2, y1));
            const Matrixd yc = cpu.forward(sc, x);
            CHECK(rel_error(y1, yc) <= 1e-12);
            CHECK(rel_error(y0, yc) <= 1e-12);
        };
        for (int t = 0; t < 16; ++t) {
            step(1);
        }
        for (int t = 0; t < 4; ++t) {
            step(uniform_int(rng, 2, 5));
        }
        step(9);
        step(1);
    }
}

#if defined(TITANS_TEST_HAS_NCCL) && TITANS_TEST_HAS_NCCL
#include <titans/nccl/nccl.cuh>

// NCCL with one rank (the GPU tests only; NCCL is not emulated): its sum and gather on device
// memory, a CUDA trainer joined to it takes the steps of one without it bit for bit, and a
// host communicator's refusal by a device backend.
TEST_CASE("cuda nccl: one rank", "[cuda]") {
    const auto comm = titans::nccl::Communicator::alone();
    CHECK((comm->rank() == 0 && comm->size() == 1 && comm->device_memory()));
    std::vector<double> host{1.5, -2.0, 1e300};
    titans::backend::cuda::DeviceBuffer<double> dev(host.size());
    titans::backend::cuda::check(cudaMemcpy(dev.data(), host.data(), 3 * sizeof(double),
                                            cudaMemcpyHostToDevice), "cudaMemcpy");
    comm->sum(std::span<double>(dev.data(), 3));
    std::vector<double> back(3);
    titans::backend::cuda::check(cudaMemcpy(back.data(), dev.data(), 3 * sizeof(double),
                                            cudaMemcpyDeviceToHost), "cudaMemcpy");
    CHECK(back == host);
    CHECK(comm->gather(42) == std::vector<std::uint64_t>{42});
    Rng rng(seed_for("cuda nccl one rank", 0));
    const int vocab = 11, B = 2, N = 6;
    const ModelCase m = trainer_model_case<double>(BlockKind::MAG, BlockKind::LMM, vocab, rng);
    const TrainerConfig tc = trainer_test_config(1.0);
    Trainer<double, Cuda> alone(m.cfg, m.params, tc), joined(m.cfg, m.params, tc);
    joined.set_communicator(comm);
    for (int s = 0; s < 3; ++s) {
        const StepData d = step_data("cuda nccl one rank", static_cast<std::uint64_t>(s), B, N, vocab);
        CHECK(alone.step(d.ids, d.labels, B) == joined.step(d.ids, d.labels, B));
    }
    CHECK(same_trainers(alone, joined));
}
#endif
