// Training Titans models from scratch on recall beyond the attention window (math §9).
//
// Task, multi-query associative recall: each sequence plants P key-value pairs
// (k_1 v_1 ... k_P v_P; keys distinct), then distractor tokens, then asks for every key again,
// in another order (k v k v ...): at each asked key the model must predict its value (the only
// positions scored). A pair asked `gap` tokens after it was planted is beyond a window of w
// tokens when gap >= w: sliding-window attention cannot see it, only the memory can carry it.
//
// Models, trained with the same steps, data, optimiser (AdamW, warm-up + cosine, global
// clipping) and about the same parameter count: two blocks of one kind each, SWA (sliding-
// window attention with a feed-forward, no memory: BlockKind::SWA, its feed-forward widened to
// the largest Titans model's count) and the Titans kinds LMM, MAC, MAG, MAL (MAC's segment is
// the window), every one a titans::Model trained by titans::Trainer.
//
// Output: progress lines (step, loss, tokens/s, ETA); DIR/train_recall.svg, the loss curves;
// a table of query accuracy by distance (inside the window, 2x, 8x, 32x the window); a table
// by evaluation length (a long distractor stream, then pairs asked inside the window: does a
// model stay sound over streams up to 16x the training length?); the Titans trainers saved
// (titans::io::save_trainer: parameters, optimiser, progress), reloaded and evaluated again,
// identically.
// --quick: a tiny run for CI (seconds; the numbers mean nothing then).

#include <titans/io/trainer.hpp>
#include <titans/titans.hpp>

#include "common/parameter_budget.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using titans::Matrixf;

struct Settings {
    bool quick = false;
    std::string out_dir = "build";
    int d = 64, heads = 4, window = 32, chunk = 16;
    int keys = 16, values = 16, distractors = 32;  // vocabulary: keys, values, distractors
    int pairs = 4, train_len = 96, batch = 16, steps = 600;
    double lr = 3e-3;
    std::vector<int> eval_gaps;   // filled from window: w/2, 2w, 8w, 32w
    std::vector<int> eval_lens;   // 1x, 4x, 16x train_len
    int eval_batch = 32;
    [[nodiscard]] int vocab() const { return keys + values + distractors; }
};

Settings parse(int argc, char** argv) {
    Settings s;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--quick") {
            s.quick = true;
        } else if (a == "--out" && i + 1 < argc) {
            s.out_dir = argv[++i];
        } else if (a == "--steps" && i + 1 < argc) {
            s.steps = std::stoi(argv[++i]);
        } else if (a == "--help" || a == "-h") {
            std::printf("usage: 06_train_recall [--quick] [--out DIR] [--steps N]\n");
            std::exit(0);
        } else {
            throw std::invalid_argument("unknown argument '" + a +
                                        "' (expected --quick, --out DIR, --steps N)");
        }
    }
    if (s.quick) {
        s.d = 8; s.heads = 2; s.window = 4; s.chunk = 4;
        s.keys = s.values = s.distractors = 4;
        s.pairs = 2; s.train_len = 16; s.batch = 2; s.steps = 3; s.eval_batch = 2;
    }
    s.eval_gaps = {s.window / 2, 2 * s.window, 8 * s.window, 32 * s.window};
    s.eval_lens = {s.train_len, 4 * s.train_len, 16 * s.train_len};
    return s;
}

class Rng {  // SplitMix64: the same numbers on every platform
public:
    explicit Rng(std::uint64_t seed) : state_(seed) {}
    std::uint64_t next() {
        std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
    int below(int n) { return static_cast<int>(next() % static_cast<std::uint64_t>(n)); }

private:
    std::uint64_t state_;
};

// ---------------------------------------------------------------------------------------------
// Data: B sequences of `len` tokens, sequence-major; labels -1 except at asked keys.

struct Batch {
    std::vector<int> ids, labels, gaps;  // gaps: per scored row, tokens since its pair
};

/// One sequence: `lead` distractors, the pairs, `gap` distractors, the questions, distractors
/// up to len. Appends to b.
void add_sequence(const Settings& s, Rng& rng, int lead, int gap, int len, Batch& b) {
    std::vector<int> k(static_cast<std::size_t>(s.keys));
    for (int i = 0; i < s.keys; ++i) k[static_cast<std::size_t>(i)] = i;
    for (int i = s.keys - 1; i > 0; --i) std::swap(k[static_cast<std::size_t>(i)], k[static_cast<std::size_t>(rng.below(i + 1))]);
    std::vector<int> v(static_cast<std::size_t>(s.pairs)), order(static_cast<std::size_t>(s.pairs));
    for (int p = 0; p < s.pairs; ++p) {
        v[static_cast<std::size_t>(p)] = s.keys + rng.below(s.values);
        order[static_cast<std::size_t>(p)] = p;
    }
    for (int i = s.pairs - 1; i > 0; --i) std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(rng.below(i + 1))]);
    const std::size_t start = b.ids.size();
    const auto put = [&](int id, int label) {
        b.ids.push_back(id);
        b.labels.push_back(label);
    };
    const auto noise = [&](int n) {
        for (int i = 0; i < n; ++i) put(s.keys + s.values + rng.below(s.distractors), -1);
    };
    noise(lead);
    for (int p = 0; p < s.pairs; ++p) {
        put(k[static_cast<std::size_t>(p)], -1);
        put(v[static_cast<std::size_t>(p)], -1);
    }
    noise(gap);
    for (int j = 0; j < s.pairs; ++j) {
        const int p = order[static_cast<std::size_t>(j)];
        b.gaps.push_back(2 * (s.pairs - p) + gap + 2 * j);
        put(k[static_cast<std::size_t>(p)], v[static_cast<std::size_t>(p)]);
        put(v[static_cast<std::size_t>(p)], -1);
    }
    noise(len - static_cast<int>(b.ids.size() - start));
}

Batch training_batch(const Settings& s, Rng& rng) {
    Batch b;
    const int room = s.train_len - 4 * s.pairs;
    for (int i = 0; i < s.batch; ++i) {
        const int gap = rng.below(room + 1);
        add_sequence(s, rng, rng.below(room - gap + 1), gap, s.train_len, b);
    }
    return b;
}

// ---------------------------------------------------------------------------------------------
// A model being trained: its step (forward, cross-entropy on the asked keys, backward,
// clipping, AdamW) and its inference.

struct Learner {
    std::string name;
    std::int64_t n_params = 0;
    std::function<double(const Batch&, int)> step;                  // batch, B -> loss
    std::function<Matrixf(const std::vector<int>&, int)> infer;      // ids, B -> logits
    std::vector<double> losses;
};

/// Logits of a Titans model over B fresh sequences.
Matrixf titans_infer(const titans::Model<float>& m, const std::vector<int>& ids, int B) {
    auto st = m.make_state(B);
    return m.forward_tokens(st, ids);
}

titans::ModelConfig titans_config(const Settings& s, titans::BlockKind kind) {
    auto cfg = titans::ModelConfig::uniform(kind, 2, s.d, s.heads, 2, s.window, s.vocab(), s.chunk);
    for (auto& b : cfg.blocks) b.attention.rope = true;
    return cfg;
}

// ---------------------------------------------------------------------------------------------
// Training and evaluation.

/// Warm-up over the first tenth of the steps, then a cosine down to a tenth of the peak.
titans::WarmupCosine schedule(const Settings& s) {
    return {s.lr, std::max<std::int64_t>(1, s.steps / 10), s.steps, 0.1};
}

void train(const Settings& s, Learner& l) {
    Rng rng(12345);  // every model sees the same batches
    const auto t0 = std::chrono::steady_clock::now();
    double ema = 0;
    for (int step = 1; step <= s.steps; ++step) {
        const Batch b = training_batch(s, rng);
        const double loss = l.step(b, s.batch);
        l.losses.push_back(loss);
        ema = step == 1 ? loss : 0.95 * ema + 0.05 * loss;
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (step % std::max(1, s.steps / 10) == 0 || step == s.steps) {
            std::printf("  %-4s step %5d/%d  loss %.4f  %7.0f tokens/s  ETA %4.0f s\n", l.name.c_str(), step,
                        s.steps, ema, step * double(s.batch * s.train_len) / secs,
                        secs / step * (s.steps - step));
            std::fflush(stdout);
        }
    }
}

/// Share of asked keys answered with their value, over sequences built by `make`.
double accuracy(const Settings& s, const Learner& l, const std::function<void(Rng&, Batch&)>& make) {
    Rng rng(777);
    Batch b;
    for (int i = 0; i < s.eval_batch; ++i) make(rng, b);
    const Matrixf logits = l.infer(b.ids, s.eval_batch);
    int right = 0, asked = 0;
    for (std::size_t r = 0; r < b.labels.size(); ++r) {
        if (b.labels[r] < 0) continue;
        Eigen::Index best = 0;
        logits.row(static_cast<Eigen::Index>(r)).maxCoeff(&best);
        right += best == b.labels[r];
        ++asked;
    }
    return asked > 0 ? double(right) / asked : 0.0;
}

std::vector<double> by_distance(const Settings& s, const Learner& l) {
    std::vector<double> out;
    for (int gap : s.eval_gaps) {
        const int len = 4 * s.pairs + gap;
        out.push_back(accuracy(s, l, [&](Rng& r, Batch& b) { add_sequence(s, r, 0, gap, len, b); }));
    }
    return out;
}

std::vector<double> by_length(const Settings& s, const Learner& l) {
    std::vector<double> out;
    for (int len : s.eval_lens) {  // a long distractor stream, then pairs asked in the window
        const int gap = std::min(s.window / 4, 4);
        const int lead = len - 4 * s.pairs - gap;
        out.push_back(accuracy(s, l, [&](Rng& r, Batch& b) { add_sequence(s, r, lead, gap, len, b); }));
    }
    return out;
}

void write_svg(const std::string& path, const std::vector<Learner>& ls) {
    const double W = 720, H = 420, x0 = 60, y0 = 20, pw = 620, ph = 340;
    double top = 0;
    for (const auto& l : ls) for (double v : l.losses) top = std::max(top, v);
    std::ofstream f(path);
    if (!f) throw std::runtime_error("cannot write " + path);
    f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << x0 << "\" y=\"14\">training loss (cross-entropy on the asked keys, moving average) by step</text>\n"
      << "<rect x=\"" << x0 << "\" y=\"" << y0 << "\" width=\"" << pw << "\" height=\"" << ph << "\" fill=\"none\" stroke=\"#888\"/>\n"
      << "<text x=\"" << x0 - 50 << "\" y=\"" << y0 + 10 << "\">" << top << "</text><text x=\"" << x0 - 20 << "\" y=\"" << y0 + ph << "\">0</text>\n";
    const char* colors[] = {"#444444", "#1f77b4", "#d62728", "#2ca02c", "#9467bd"};
    for (std::size_t i = 0; i < ls.size(); ++i) {
        const auto& v = ls[i].losses;
        f << "<polyline fill=\"none\" stroke=\"" << colors[i % 5] << "\" stroke-width=\"1.5\" points=\"";
        double ema = v.empty() ? 0 : v[0];
        for (std::size_t k = 0; k < v.size(); ++k) {
            ema = 0.95 * ema + 0.05 * v[k];
            f << x0 + pw * double(k) / double(std::max<std::size_t>(1, v.size() - 1)) << "," << y0 + ph * (1 - ema / top) << " ";
        }
        f << "\"/>\n<text x=\"" << x0 + pw - 60 << "\" y=\"" << y0 + 20 + 16 * double(i) << "\" fill=\"" << colors[i % 5] << "\">" << ls[i].name << "</text>\n";
    }
    f << "<text x=\"" << x0 + pw / 2 << "\" y=\"" << H - 20 << "\">step</text>\n</svg>\n";
}

void print_table(const std::string& title, const std::vector<std::string>& cols, const std::vector<Learner>& ls,
                 const std::vector<std::vector<double>>& acc) {
    std::printf("\n%s\n  %-6s", title.c_str(), "model");
    for (const auto& c : cols) std::printf(" %12s", c.c_str());
    std::printf("\n");
    for (std::size_t i = 0; i < ls.size(); ++i) {
        std::printf("  %-6s", ls[i].name.c_str());
        for (double a : acc[i]) std::printf(" %11.1f%%", 100 * a);
        std::printf("\n");
    }
}

}  // namespace

int main(int argc, char** argv) try {
    const Settings s = parse(argc, argv);
    std::filesystem::create_directories(s.out_dir);
    const titans::AdamWConfig adam{0.9, 0.98, 1e-8, 0.01, false};
    const titans::TrainerConfig tc{.adamw = adam, .schedule = schedule(s), .clip_norm = 1.0};
    // The Titans models, then the attention-only baseline widened to the largest of them.
    std::vector<titans::ModelConfig> cfgs;
    std::int64_t budget = 0;
    for (auto kind : {titans::BlockKind::LMM, titans::BlockKind::MAC, titans::BlockKind::MAG,
                      titans::BlockKind::MAL}) {
        cfgs.push_back(titans_config(s, kind));
        budget = std::max(budget, cfgs.back().parameter_count());
    }
    cfgs.insert(cfgs.begin(), titans_config(s, titans::BlockKind::SWA));
    examples::fit_feed_forward(cfgs.front(), budget);
    std::vector<titans::Trainer<float>> trainers;
    for (const auto& cfg : cfgs) trainers.emplace_back(cfg, titans::ModelParams<float>::random(cfg, 1), tc);

    std::vector<Learner> ls;
    for (auto& t : trainers) {
        const titans::ModelConfig& cfg = t.model().config();
        ls.push_back({titans::to_string(cfg.blocks[0].kind), cfg.parameter_count(),
                      [&t](const Batch& b, int B) { return t.step(b.ids, b.labels, B); },
                      [&t](const std::vector<int>& ids, int B) { return titans_infer(t.model(), ids, B); },
                      {}});
    }
    std::printf("multi-query associative recall: %d pairs, window %d, training length %d, batch %d, %d steps\n",
                s.pairs, s.window, s.train_len, s.batch, s.steps);
    for (auto& l : ls) {
        std::printf("%s: %lld parameters\n", l.name.c_str(), static_cast<long long>(l.n_params));
        train(s, l);
    }
    const std::string svg = (std::filesystem::path(s.out_dir) / "train_recall.svg").string();
    write_svg(svg, ls);
    std::printf("loss curves: %s\n", svg.c_str());

    std::vector<std::vector<double>> dist, len;
    for (const auto& l : ls) {
        dist.push_back(by_distance(s, l));
        len.push_back(by_length(s, l));
    }
    std::vector<std::string> dcols, lcols;
    for (int g : s.eval_gaps) dcols.push_back("gap " + std::to_string(g));
    for (int n : s.eval_lens) lcols.push_back("len " + std::to_string(n));
    print_table("accuracy by distance between pair and question (window " + std::to_string(s.window) + ")",
                dcols, ls, dist);
    print_table("accuracy by stream length (pairs asked inside the window at the end; trained on " +
                    std::to_string(s.train_len) + ")",
                lcols, ls, len);

    // Save, reload, evaluate again: the same answers (and the same trainer: parameters,
    // optimiser, progress).
    bool same = true;
    for (std::size_t i = 0; i < trainers.size(); ++i) {
        const auto& t = trainers[i];
        const auto dir = std::filesystem::path(s.out_dir) / ("train_recall_" + ls[i].name);
        titans::io::save_trainer(dir, t);
        const auto back = titans::io::load_trainer<float>(dir, t.model().config());
        Learner lb = ls[i];
        lb.infer = [&back](const std::vector<int>& ids, int B) { return titans_infer(back.model(), ids, B); };
        same = same && by_distance(s, lb) == dist[i] && back.steps() == t.steps() &&
               back.data_position() == t.data_position();
    }
    std::printf("\nsaved, reloaded and evaluated again: %s\n", same ? "identical" : "DIFFERENT");
    return same ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "06_train_recall: %s\n", e.what());
    return 1;
}
