// 03_checkpoint: save a model's weights, stream half of a token sequence, checkpoint the
// stream, then (as a restarted program would) load the weights and the checkpoint from disk and
// stream the rest. The resumed outputs are compared bit for bit with a run that never stopped
// (fed the same pieces; pieces of other lengths agree to rounding), and a checkpoint offered to
// a model of another configuration is refused with a message naming the setting that differs.
//
//     ./03_checkpoint [--quick] [--tokens N] [--out DIR]
//
// Needs the titans::io component (nlohmann-json3-dev). Files: DIR/model.safetensors (outer
// parameters) and DIR/stream.safetensors (the stream's state), both printed. With --out DIR
// (created if missing) they are kept there; by default DIR is a fresh directory under the
// system temp directory, removed at the end. Layout of both: docs/formats.md.
#include <titans/io/checkpoint.hpp>
#include <titans/titans.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Streams ids[begin, end) through the model in pieces of `piece` tokens; returns the logits.
titans::Matrixf stream(const titans::Model<float>& model, titans::ModelState<float>& st,
                       const std::vector<int>& ids, std::size_t begin, std::size_t end,
                       std::size_t piece) {
    titans::Matrixf out(static_cast<Eigen::Index>(end - begin), model.config().output_dim());
    for (std::size_t t = begin; t < end; t += piece) {
        const std::size_t n = std::min(piece, end - t);
        const std::vector<int> part(ids.begin() + static_cast<std::ptrdiff_t>(t),
                                    ids.begin() + static_cast<std::ptrdiff_t>(t + n));
        out.middleRows(static_cast<Eigen::Index>(t - begin), static_cast<Eigen::Index>(n)) =
            model.forward_tokens(st, part);
    }
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    bool quick = false;
    std::size_t tokens = 4096;
    // A directory of our own under the temp dir, so concurrent runs never share files.
    fs::path dir = fs::temp_directory_path() /
                   ("titans_03_checkpoint_" +
                    std::to_string(Clock::now().time_since_epoch().count()));
    bool own_dir = true;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0) {
            quick = true;
            tokens = 300;
        } else if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
            tokens = std::strtoull(argv[++i], nullptr, 10);
        } else if ((std::strcmp(argv[i], "--out") == 0 || std::strcmp(argv[i], "--dir") == 0) &&
                   i + 1 < argc) {
            dir = argv[++i];
            own_dir = false;
        } else {
            std::fprintf(stderr, "usage: %s [--quick] [--tokens N] [--out DIR]\n", argv[0]);
            return 2;
        }
    }
    if (tokens < 2) tokens = 2;
    fs::create_directories(dir);

    // A three-block model (MAC, MAG, MAL) over a 256-token vocabulary; random weights stand in
    // for trained ones.
    const int d = quick ? 32 : 64;
    auto cfg = titans::ModelConfig::uniform(titans::BlockKind::MAC, 1, d, 4, 2, 32, 256, 16);
    cfg.blocks.push_back(titans::BlockConfig::make(titans::BlockKind::MAG, d, 4, 2, 64, 16));
    cfg.blocks.push_back(titans::BlockConfig::make(titans::BlockKind::MAL, d, 4, 2, 64, 16));
    const titans::Model<float> model(cfg, titans::ModelParams<float>::random(cfg, 2026));

    std::vector<int> ids(tokens);
    std::uint64_t s = 12345;
    for (int& id : ids) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        id = static_cast<int>((s >> 33) % 256);
    }

    const std::size_t half = tokens / 2 + 7;  // not a multiple of the chunk or segment
    const std::size_t piece = 50;

    // The reference: a run that never stops, fed the same pieces as the interrupted one
    // (0..half, then half..end). Pieces of other lengths agree to rounding, not bit for bit:
    // a chunk split differently is summed in another order.
    auto st_ref = model.make_state(1);
    auto t0 = Clock::now();
    titans::Matrixf all(static_cast<Eigen::Index>(tokens), model.config().output_dim());
    all.topRows(static_cast<Eigen::Index>(half)) = stream(model, st_ref, ids, 0, half, piece);
    all.bottomRows(static_cast<Eigen::Index>(tokens - half)) =
        stream(model, st_ref, ids, half, tokens, piece);
    const double t_stream = seconds_since(t0);
    auto st_other = model.make_state(1);
    const titans::Matrixf other_pieces = stream(model, st_other, ids, 0, tokens, piece + 13);

    // Run 1: save the weights, stream the first part, checkpoint the stream, stop.
    const fs::path weights = dir / "model.safetensors", ckpt = dir / "stream.safetensors";
    t0 = Clock::now();
    titans::io::save_parameters(weights, model);
    const double t_save_weights = seconds_since(t0);
    {
        auto st = model.make_state(1);
        (void)stream(model, st, ids, 0, half, piece);
        t0 = Clock::now();
        titans::io::save_checkpoint(ckpt, model, st);
    }
    const double t_save_ckpt = seconds_since(t0);

    // Run 2, as a restarted program: weights and stream state from disk, stream the rest.
    t0 = Clock::now();
    const titans::Model<float> restored(
        cfg, titans::io::load_parameters<titans::ModelParams<float>>(weights, cfg));
    auto st = titans::io::load_checkpoint(ckpt, restored);
    const double t_load = seconds_since(t0);
    const titans::Matrixf rest = stream(restored, st, ids, half, tokens, piece);

    const auto tail = all.bottomRows(static_cast<Eigen::Index>(tokens - half));
    const bool identical =
        std::memcmp(tail.eval().data(), rest.data(), sizeof(float) * static_cast<std::size_t>(rest.size())) == 0;
    std::printf("model: MAC + MAG + MAL blocks, d = %d, vocab 256, %zu tokens streamed in pieces of %zu\n",
                d, tokens, piece);
    std::printf("weights     %-40s %8.1f KiB  saved in %.3f s\n", weights.string().c_str(),
                static_cast<double>(fs::file_size(weights)) / 1024.0, t_save_weights);
    std::printf("checkpoint  %-40s %8.1f KiB  saved in %.3f s (after %zu tokens)\n",
                ckpt.string().c_str(), static_cast<double>(fs::file_size(ckpt)) / 1024.0,
                t_save_ckpt, half);
    std::printf("restart: weights + checkpoint loaded in %.3f s (streaming all tokens took %.3f s)\n",
                t_load, t_stream);
    std::printf("resumed logits for tokens %zu..%zu vs the uninterrupted run: %s\n", half,
                tokens - 1, identical ? "bit-identical" : "DIFFERENT");
    const double scale = all.cwiseAbs().maxCoeff();
    std::printf("(the same stream fed in pieces of %zu instead: max |difference| / max |logit| = "
                "%.1e, rounding)\n",
                piece + 13, static_cast<double>((all - other_pieces).cwiseAbs().maxCoeff()) / scale);

    // A checkpoint is refused by a model it was not written for.
    auto other_cfg = cfg;
    other_cfg.blocks[1].attention.window = 32;
    const titans::Model<float> other(other_cfg, titans::ModelParams<float>::random(other_cfg, 1));
    try {
        (void)titans::io::load_checkpoint(ckpt, other);
        std::printf("a model of another configuration accepted the checkpoint: WRONG\n");
        return 1;
    } catch (const titans::ConfigError& e) {
        std::printf("another configuration is refused:\n  %s\n", e.what());
    }
    if (own_dir) {  // files written to a directory the user named are kept
        fs::remove(weights);
        fs::remove(ckpt);
        fs::remove(dir);
    }
    return identical ? 0 : 1;
}
