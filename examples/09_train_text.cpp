// A byte-level Titans language model trained on real text (math §9), end to end.
//
//     build/release/examples/09_train_text --text build/shakespeare/texts   # tools/get_shakespeare.sh
//     build/release/examples/09_train_text --text my_notes.txt --kind mac --steps 3000
//     build/release/examples/09_train_text --kind swa --params 120000   # the attention-only baseline
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
// works), a needle in a haystack at the same lengths (examples/common/needle.hpp: a pass key,
// a number and a word stated once in validation text, asked for at its end: exact answers and
// the answer's bits per byte with and without the needle), and a sample continuation of a
// validation prompt. --result FILE writes those figures as one JSON object (what
// tools/text_study.py collects); --params N widens or narrows the feed-forward so the model
// has about N parameters (equal sizes for the attention-only baseline and the memory kinds);
// --depth 1 makes the memory linear, --no-momentum and --no-forget turn off its momentum and
// forget gate (the paper's ablations: MemoryConfig::momentum / forget, the other gates kept
// data-dependent), --constant-gates makes every gate a constant (see model_config).
// Without --text a small text is made up here (runs anywhere; the numbers then mean little).
// --quick: a tiny run for CI (seconds).

#include <titans/io/parameters.hpp>
#include <titans/titans.hpp>
#if defined(TITANS_EXAMPLE_MPI) && TITANS_EXAMPLE_MPI
#include <titans/mpi/mpi.hpp>
#endif

#include "common/line_chart.hpp"
#include "common/needle.hpp"
#include "common/parameter_budget.hpp"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace tt = titans::text;

struct Settings {
    std::string text;            // file or folder; empty: a made-up text
    std::string out_dir = "build";
    std::string kind = "mag";    // lmm, mac, mag, mal, swa
    std::string result;          // JSON file of the final figures; empty: none
    bool dedupe = false, constant_gates = false, momentum = true, forget = true, dry_run = false;
    bool mpi = false;            // --mpi: one rank of a data-parallel run (mpirun -np N)
    int d = 64, heads = 4, blocks = 2, window = 64, chunk = 16, depth = 2;
    int length = 128, batch = 16, steps = 1200, eval_every = 100, eval_batches = 4, niah = 2;
    long long params = 0;        // > 0: the feed-forward sized for about this many parameters
    double lr = 3e-3, valid = 0.1;
    std::optional<double> theta_max;  // the memory's theta_max (its test-time learning rate)
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
        else if (a == "--constant-gates") s.constant_gates = true;
        else if (a == "--dry-run") s.dry_run = true;
        else if (a == "--mpi") s.mpi = true;
        else if (a == "--no-momentum") s.momentum = false;
        else if (a == "--no-forget") s.forget = false;
        else if (a == "--result" && has) s.result = argv[++i];
        else if (a == "--depth" && has) s.depth = int_arg(a, argv[++i], 1);
        else if (a == "--niah" && has) s.niah = int_arg(a, argv[++i], 0);
        else if (a == "--params" && has) s.params = int_arg(a, argv[++i], 1);
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
        else if (a == "--theta-max" && has) s.theta_max = std::stod(argv[++i]);
        else if (a == "--seed" && has) s.seed = std::stoull(argv[++i]);
        else if (a == "--help" || a == "-h") {
            std::printf("usage: 09_train_text [--text FILE|DIR] [--dedupe] [--out DIR]\n"
                        "  [--kind lmm|mac|mag|mal|swa] [--d D] [--heads H] [--blocks L] [--window W]\n"
                        "  [--chunk C] [--depth L] [--constant-gates] [--no-momentum] [--no-forget]\n"
                        "  [--theta-max X]\n"
                        "  [--params N]\n"
                        "  [--length N] [--batch B] [--steps S] [--eval-every K] [--lr LR] [--seed S]\n"
                        "  [--niah TRIALS] [--result FILE.json] [--dry-run] [--quick] [--mpi]\n");
            std::exit(0);
        } else {
            throw std::invalid_argument("unknown argument '" + a + "' (see --help)");
        }
    }
    if (quick) {
        s.d = 8; s.heads = 2; s.blocks = 1; s.window = 8; s.chunk = 4;
        s.length = 16; s.batch = 2; s.steps = 4; s.eval_every = 2; s.eval_batches = 1; s.niah = 1;
    }
    return s;
}

titans::BlockKind block_kind(const std::string& k) {
    std::string upper = k;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    titans::BlockKind kind{};
    if (!titans::from_string(upper, kind)) {
        throw std::invalid_argument("--kind " + k + ", expected lmm, mac, mag, mal or swa");
    }
    return kind;
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

/// The model of the settings. The ablations: --constant-gates makes the memory's gates
/// constant (GateMode::Constant: theta = theta_max / 2, where the data-dependent gate starts
/// with a zero logit; eta 0.9; alpha 0.01); --no-momentum (eta = 0) and --no-forget (alpha = 0)
/// switch one gate off and leave the others as they are (MemoryConfig::momentum, forget);
/// --depth 1 a linear memory; --theta-max X the memory's largest test-time learning rate (0:
/// no writes; with --no-forget too the memory never changes, a fixed MLP of its trained
/// initial weights). --params N: the feed-forward's hidden width that brings the count
/// nearest N.
titans::ModelConfig model_config(const Settings& s) {
    auto cfg = titans::ModelConfig::uniform(block_kind(s.kind), s.blocks, s.d, s.heads, s.depth,
                                            s.window, tt::ByteTokenizer::vocab_size, s.chunk);
    for (auto& b : cfg.blocks) {
        b.attention.rope = true;
        if (s.theta_max) b.memory.theta_max = *s.theta_max;  // validated by the Model
        if (s.constant_gates) {
            b.memory.gates = titans::GateMode::Constant;
            b.memory.constant_theta = b.memory.theta_max / 2;
            b.memory.constant_eta = 0.9;
            b.memory.constant_alpha = 0.01;
        }
        b.memory.momentum = s.momentum;
        b.memory.forget = s.forget;
    }
    if (s.params > 0) examples::fit_feed_forward(cfg, s.params);
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

/// --mpi: MPI started, the trainer joined to every rank of the run (each steps on its shard
/// of every batch); every rank but 0 prints and writes nothing. Without the component: an
/// error saying so.
struct Ranks {
#if defined(TITANS_EXAMPLE_MPI) && TITANS_EXAMPLE_MPI
    std::optional<titans::mpi::Session> session;
    std::shared_ptr<titans::mpi::Communicator> comm;
#endif
    int rank = 0, size = 1;

    Ranks(bool mpi, int& argc, char**& argv) {
        if (!mpi) return;
#if defined(TITANS_EXAMPLE_MPI) && TITANS_EXAMPLE_MPI
        session.emplace(argc, argv);
        comm = std::make_shared<titans::mpi::Communicator>();
        rank = comm->rank();
        size = comm->size();
        if (rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) {
            throw std::runtime_error("cannot silence rank " + std::to_string(rank));
        }
#else
        (void)argc;
        (void)argv;
        throw std::invalid_argument("--mpi: this build has no titans::mpi (install an MPI, e.g. "
                                    "openmpi-bin libopenmpi-dev, and configure again)");
#endif
    }
    template <class Trainer>
    void join(Trainer& trainer) const {
#if defined(TITANS_EXAMPLE_MPI) && TITANS_EXAMPLE_MPI
        if (comm) trainer.set_communicator(comm);
#else
        (void)trainer;
#endif
    }
};

int main(int argc, char** argv) try {
    const Settings s = parse(argc, argv);
    const Ranks ranks(s.mpi, argc, argv);
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
    ranks.join(trainer);
    std::int64_t n_params = 0;
    titans::ModelParams<float>::tensors(trainer.params(), cfg,
                                        [&](const std::string&, const auto& t) { n_params += t.size(); });
    std::printf("model: %s, blocks %d, d %d, %d heads, window %d, %lld parameters; batch %d x %d bytes, %d steps"
                "%s\n",
                s.kind.c_str(), s.blocks, s.d, s.heads, s.window, static_cast<long long>(n_params),
                s.batch, s.length, s.steps,
                ranks.size > 1 ? (", " + std::to_string(ranks.size) + " ranks").c_str() : "");
    if (s.dry_run) return 0;  // the model line alone (tools/text_study.py sizes the variants)

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
    if (ranks.rank != 0) return 0;  // the model is the same bits on every rank: 0 reports it
    const std::string plot = (std::filesystem::path(s.out_dir) / "train_text.svg").string();
    examples::write_line_chart(plot, "byte-level " + s.kind + " on text", "step", "bits per byte",
                               {train_curve, valid_curve});
    const std::string saved = (std::filesystem::path(s.out_dir) / "train_text.safetensors").string();
    titans::io::save_parameters(saved, trainer.model());
    std::printf("wrote %s and %s\n", plot.c_str(), saved.c_str());

    const double train_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string json = "{\"kind\": \"" + s.kind + "\", \"seed\": " + std::to_string(s.seed) +
                       ", \"parameters\": " + std::to_string(n_params) + ", \"steps\": " +
                       std::to_string(s.steps) + ", \"train_seconds\": " + std::to_string(train_secs);
    std::printf("validation by length (fresh state per window): bits per byte; needle in a haystack: "
                "exact answers, answer bits per byte with / without the needle\n");
    for (int mult : {1, 4, 16}) {
        const int len = mult * s.length;
        if (!fits(split.validation, len)) {
            std::printf("  %2dx (%6d bytes): no validation document that long\n", mult, len);
            continue;
        }
        const int b = std::max(1, s.batch / mult);
        const double bpb = bits_per_byte(trainer.model(), split.validation, b, len, s.eval_batches);
        const examples::NeedleScore n =
            examples::needle_in_haystack(trainer.model(), split.validation, len, s.niah, s.seed + 77);
        const std::string m = std::to_string(mult) + "x";
        json += ", \"bpb_" + m + "\": " + std::to_string(bpb);
        if (n.trials == 0) {
            std::printf("  %2dx (%6d bytes): %.3f bits/byte; needle: none (too short)\n", mult, len, bpb);
            continue;
        }
        std::printf("  %2dx (%6d bytes): %.3f bits/byte; needle %d/%d, %.2f / %.2f bits\n", mult, len,
                    bpb, n.correct, n.trials, n.bits_with, n.bits_without);
        json += ", \"niah_acc_" + m + "\": " + std::to_string(n.accuracy()) + ", \"niah_bits_with_" +
                m + "\": " + std::to_string(n.bits_with) + ", \"niah_bits_without_" + m + "\": " +
                std::to_string(n.bits_without);
    }
    if (!s.result.empty()) {
        std::ofstream(s.result) << json << "}\n";
        std::printf("wrote %s\n", s.result.c_str());
    }
    std::printf("sample (prompt|continuation):\n%s\n",
                sample_text(trainer.model(), split.validation.front(), s.steps > 10 ? 400 : 16).c_str());
    return 0;
} catch (const std::exception& e) {
    std::fprintf(stderr, "09_train_text: %s\n", e.what());
#if defined(TITANS_EXAMPLE_MPI) && TITANS_EXAMPLE_MPI
    int ready = 0, done = 0, size = 1;
    MPI_Initialized(&ready);
    MPI_Finalized(&done);
    if (ready != 0 && done == 0) MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > 1) MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks may wait in a collective
#endif
    return 1;
}
