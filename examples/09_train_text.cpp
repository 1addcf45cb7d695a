// A byte-level Titans language model trained on real text (math §9), end to end.
//
//     build/release/examples/09_train_text --text build/shakespeare/texts   # tools/get_shakespeare.sh
//     build/release/examples/09_train_text --text my_notes.txt --kind mac --steps 3000
//
// Reads a text file or a folder of them (titans::text::read_documents; --dedupe drops
// near-identical editions of one work, titans::text::drop_near_duplicates), splits training and
// validation by whole documents (split_documents), and trains a Model of vocabulary 256 (one
// token per byte) with titans::Trainer on windows of --length bytes drawn by BatchSampler.
// Prints progress (step, loss, bits per byte, tokens/s, ETA) and the validation bits per byte
// every --eval-every steps; writes OUT/train_text.svg (training and validation curves); saves
// the model to OUT/train_text.safetensors (titans::io::save_parameters: 08_generate --model
// continues text with it); prints validation bits per byte at 1x, 4x and 16x the training
// length (the memory carries context past the attention window: longer is not worse if it
// works), and a sample continuation of a validation prompt.
// Without --text a small text is made up here (runs anywhere; the numbers then mean little).
// --quick: a tiny run for CI (seconds).

#include <titans/io/parameters.hpp>
#include <titans/titans.hpp>

#include "common/line_chart.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace tt = titans::text;

struct Settings {
    std::string text;            // file or folder; empty: a made-up text
    std::string out_dir = "build";
    std::string kind = "mag";    // lmm, mac, mag, mal
    bool dedupe = false;
    int d = 64, heads = 4, blocks = 2, window = 64, chunk = 16;
    int length = 128, batch = 16, steps = 1200, eval_every = 100, eval_batches = 4;
    double lr = 3e-3, valid = 0.1;
    std::uint64_t seed = 1;
};

int int_arg(const std::string& name, const char* v, int lo) {
    const int x = std::stoi(v);
    if (x < lo) throw std::invalid_argument(name + " = " + v + ", expected an integer >= " + std::to_string(lo));
    return x;
}

Settings parse(int argc, char** argv) {
    Settings s;
    bool quick = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const bool has = i + 1 < argc;
        if (a == "--quick") quick = true;
        else if (a == "--dedupe") s.dedupe = true;
        else if (a == "--text" && has) s.text = argv[++i];
        else if (a == "--out" && has) s.out_dir = argv[++i];
        else if (a == "--kind" && has) s.kind = argv[++i];
        else if (a == "--d" && has) s.d = int_arg(a, argv[++i], 1);
        else if (a == "--heads" && has) s.heads = int_arg(a, argv[++i], 1);
        else if (a == "--blocks" && has) s.blocks = int_arg(a, argv[++i], 1);
        else if (a == "--window" && has) s.window = int_arg(a, argv[++i], 1);
        else if (a == "--chunk" && has) s.chunk = int_arg(a, argv[++i], 1);
        else if (a == "--length" && has) s.length = int_arg(a, argv[++i], 2);
        else if (a == "--batch" && has) s.batch = int_arg(a, argv[++i], 1);
        else if (a == "--steps" && has) s.steps = int_arg(a, argv[++i], 1);
        else if (a == "--eval-every" && has) s.eval_every = int_arg(a, argv[++i], 1);
        else if (a == "--lr" && has) s.lr = std::stod(argv[++i]);
        else if (a == "--seed" && has) s.seed = std::stoull(argv[++i]);
        else if (a == "--help" || a == "-h") {
            std::printf("usage: 09_train_text [--text FILE|DIR] [--dedupe] [--out DIR] [--kind lmm|mac|mag|mal]\n"
                        "  [--d D] [--heads H] [--blocks L] [--window W] [--chunk C] [--length N]\n"
                        "  [--batch B] [--steps S] [--eval-every K] [--lr LR] [--seed S] [--quick]\n");
            std::exit(0);
        } else {
            throw std::invalid_argument("unknown argument '" + a + "' (see --help)");
        }
    }
    if (quick) {
        s.d = 8; s.heads = 2; s.blocks = 1; s.window = 8; s.chunk = 4;
        s.length = 16; s.batch = 2; s.steps = 4; s.eval_every = 2; s.eval_batches = 1;
    }
    return s;
}

titans::BlockKind block_kind(const std::string& k) {
    if (k == "lmm") return titans::BlockKind::LMM;
    if (k == "mac") return titans::BlockKind::MAC;
    if (k == "mag") return titans::BlockKind::MAG;
    if (k == "mal") return titans::BlockKind::MAL;
    throw std::invalid_argument("--kind " + k + ", expected lmm, mac, mag or mal");
}

/// A made-up corpus: 12 "documents" of sentences drawn from a small grammar (so there is
/// structure to learn, and whole documents to hold out).
std::vector<tt::Document> made_up_corpus(std::uint64_t seed) {
    const char* who[] = {"the king", "a fool", "my lord", "the queen", "good friar", "this knave"};
    const char* verb[] = {"speaks of", "loves", "hath seen", "will not trust", "fears", "calls"};
    const char* what[] = {"the crown", "a ghost", "the sea", "his honour", "the night", "a rose"};
    std::mt19937_64 rng(seed);
    std::vector<tt::Document> docs;
    for (int d = 0; d < 12; ++d) {
        std::string text;
        while (text.size() < 6000) {
            text += who[rng() % 6];
            text += ' ';
            text += verb[rng() % 6];
            text += ' ';
            text += what[rng() % 6];
            text += rng() % 3 == 0 ? ".\n" : ", and ";
        }
        docs.push_back({"doc" + std::to_string(d), text});
    }
    return docs;
}

titans::ModelConfig model_config(const Settings& s) {
    auto cfg = titans::ModelConfig::uniform(block_kind(s.kind), s.blocks, s.d, s.heads, 2,
                                            s.window, tt::ByteTokenizer::vocab_size, s.chunk);
    for (auto& b : cfg.blocks) b.attention.rope = true;
    return cfg;
}

/// Mean bits per byte of `model` over `n` validation batches of windows of `len` bytes (fixed
/// draws: every evaluation sees the same windows), each from a fresh state.
double bits_per_byte(const titans::Model<float>& model, const std::vector<tt::Document>& docs,
                     int batch, int len, int n) {
    const tt::BatchSampler sampler(docs, batch, len, 2024);
    double sum = 0;
    titans::Matrixf dlogits;
    for (int k = 0; k < n; ++k) {
        const tt::TokenBatch b = sampler.batch_at(static_cast<std::uint64_t>(k));
        auto state = model.make_state(b.batch);
        const titans::Matrixf logits = model.forward_tokens(state, b.ids);
        sum += titans::cross_entropy_loss<float>(logits, b.labels, dlogits);
    }
    return sum / n / std::log(2.0);
}

/// The longest validation document must hold a window of len + 1 bytes.
bool fits(const std::vector<tt::Document>& docs, int len) {
    return std::any_of(docs.begin(), docs.end(), [len](const tt::Document& d) {
        return d.bytes.size() > static_cast<std::size_t>(len);
    });
}

std::string sample_text(const titans::Model<float>& model, const tt::Document& doc, int n) {
    const std::string prompt = doc.bytes.substr(0, std::min<std::size_t>(64, doc.bytes.size()));
    auto g = tt::start_generation(model, std::span<const int>(tt::ByteTokenizer::encode(prompt)),
                                  {.temperature = 0.8, .top_k = 40, .seed = 7});
    std::string out = prompt + "|";
    for (int i = 0; i < n; ++i) out += tt::ByteTokenizer::decode(tt::next_token(model, g));
    return out;
}

}  // namespace

int main(int argc, char** argv) try {
    const Settings s = parse(argc, argv);
    std::filesystem::create_directories(s.out_dir);
    std::vector<tt::Document> docs = s.text.empty() ? made_up_corpus(s.seed) : tt::read_documents(s.text);
    const std::size_t read = docs.size();
    if (s.dedupe) docs = tt::drop_near_duplicates(docs);
    const tt::CorpusSplit split = tt::split_documents(docs, s.valid, s.seed);
    std::size_t train_bytes = 0;
    for (const auto& d : split.train) train_bytes += d.bytes.size();
    std::printf("corpus: %zu documents read, %zu kept; %zu for training (%zu bytes), %zu held out\n",
                read, docs.size(), split.train.size(), train_bytes, split.validation.size());
    if (split.validation.empty() || !fits(split.validation, s.length)) {
        throw std::invalid_argument("the validation documents must hold a window of --length + 1 bytes");
    }

    const titans::ModelConfig cfg = model_config(s);
    titans::TrainerConfig tc;
    tc.schedule = {s.lr, std::max(1, s.steps / 20), s.steps, 0.1};
    titans::Trainer<float> trainer(cfg, titans::ModelParams<float>::random(cfg, s.seed), tc);
    std::int64_t n_params = 0;
    titans::ModelParams<float>::tensors(trainer.params(), cfg,
                                        [&](const std::string&, const auto& t) { n_params += t.size(); });
    std::printf("model: %s, blocks %d, d %d, %d heads, window %d, %lld parameters; batch %d x %d bytes, %d steps\n",
                s.kind.c_str(), s.blocks, s.d, s.heads, s.window, static_cast<long long>(n_params),
                s.batch, s.length, s.steps);

    tt::BatchSampler batches(split.train, s.batch, s.length, s.seed);
    examples::Curve train_curve{"training", "#1f77b4", {}}, valid_curve{"validation", "#d62728", {}};
    const auto t0 = std::chrono::steady_clock::now();
    double ema = 0;
    for (int step = 1; step <= s.steps; ++step) {
        const tt::TokenBatch b = batches.next();
        const double loss = trainer.step(b.ids, b.labels, b.batch);
        ema = step == 1 ? loss : 0.95 * ema + 0.05 * loss;
        train_curve.points.emplace_back(step, loss / std::log(2.0));
        if (step % s.eval_every == 0 || step == s.steps) {
            const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            const double valid = bits_per_byte(trainer.model(), split.validation, s.batch, s.length, s.eval_batches);
            valid_curve.points.emplace_back(step, valid);
            std::printf("step %5d/%d  loss %.4f  %.3f bits/byte (validation %.3f)  %7.0f tokens/s  ETA %4.0f s\n",
                        step, s.steps, ema, ema / std::log(2.0), valid,
                        step * double(s.batch) * s.length / secs, secs / step * (s.steps - step));
            std::fflush(stdout);
        }
    }
    const std::string plot = (std::filesystem::path(s.out_dir) / "train_text.svg").string();
    examples::write_line_chart(plot, "byte-level " + s.kind + " on text", "step", "bits per byte",
                               {train_curve, valid_curve});
    const std::string saved = (std::filesystem::path(s.out_dir) / "train_text.safetensors").string();
    titans::io::save_parameters(saved, trainer.model());
    std::printf("wrote %s and %s\n", plot.c_str(), saved.c_str());

    std::printf("validation bits per byte by length (fresh state per window):\n");
    for (int mult : {1, 4, 16}) {
        const int len = mult * s.length;
        if (!fits(split.validation, len)) {
            std::printf("  %2dx (%6d bytes): no validation document that long\n", mult, len);
            continue;
        }
        const int b = std::max(1, s.batch / mult);
        std::printf("  %2dx (%6d bytes): %.3f\n", mult, len,
                    bits_per_byte(trainer.model(), split.validation, b, len, s.eval_batches));
    }
    std::printf("sample (prompt|continuation):\n%s\n",
                sample_text(trainer.model(), split.validation.front(), s.steps > 10 ? 400 : 16).c_str());
    return 0;
} catch (const std::exception& e) {
    std::fprintf(stderr, "09_train_text: %s\n", e.what());
    return 1;
}
