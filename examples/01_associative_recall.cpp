// Associative recall: is a deep memory needed? (Titans, sections 3.1 and 5.5)
//
// A neural long-term memory learns key -> value pairs at test time, from the stream alone:
// the outer parameters stay fixed, only the memory weights change (math §3-4). We stream P
// pairs through the memory for several epochs, then read every key back (NeuralMemory::read,
// which leaves the state untouched) and measure how well the stored values come back:
//
//   recall error     mean over keys of ||y - v|| / ||v||
//   recall accuracy  fraction of keys whose read-out y is nearer (cosine) to its own value
//                    than to any other stored value (chance: 1/P)
//
// The memory sees keys and values directly: one head of width d_h, tokens x = [key | value]
// (d_model = 2 d_h), no convolution, identity q/k/v activation, L2-normalised keys,
// W_K = W_Q = [I; 0] (the key half), W_V = [0; I] (the value half), W_O = [I 0] (the head
// output lands in the first d_h columns). Keys are random unit vectors; values are a fixed
// nonlinear function of the key, v = c ((k R1)^2 - 1) R2 (R1, R2 random). It is even in k, so
// it has no linear part: a matrix memory can only memorise pairs (about d_h of them), a memory
// with hidden layers can also pick up the function.
//
// Variants: depth 1 (matrix memory), 2 and 3 (MLP, expansion 4, SiLU), each with and without
// momentum (eta 0.9 / 0) and forgetting (alpha 0.01 / 0). Every variant gets its own learning
// rate theta, picked from a small grid on separate tuning data (other keys, another function),
// so that no variant loses for want of a step size. Independent trials run as one batch (each
// sequence of a batch owns its memory) and are averaged.
//
// Output: two tables (share of keys recalled, error of the answers), an SVG plot written to
// DIR/associative_recall.svg (--out DIR, default build/, created if missing; the path is
// printed) and a short conclusion computed from the numbers.
// --quick: a small problem for CI (a few seconds under ASan).
// --max-grad-norm C: the memory's per-token gradient clipping (math §10; default the
// library's, 1; 0 turns it off, the behaviour before clipping existed).

#include <titans/titans.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>  // isatty: the progress line only on a terminal

namespace {

using titans::Matrixf;

// ---------------------------------------------------------------------------------------------
// Settings.

struct Settings {
    bool quick = false;
    std::string out_dir = "build";  // the plot goes to out_dir/associative_recall.svg
    int d_h = 32;       // head width: keys and values live in R^d_h
    int chunk = 8;      // tokens per chunk of the update (math §4)
    int epochs = 16;    // passes over the P pairs, each in a fresh random order
    int trials = 4;     // independent tasks per point, run as one batch, averaged
    std::vector<int> pairs = {8, 16, 32, 64, 128, 256};
    std::vector<int> tune_pairs = {16, 64};                   // P used to pick theta
    std::vector<double> theta_grid = {0.25, 0.5, 1.0, 2.0, 4.0};  // x base_theta
    double max_grad_norm = titans::MemoryConfig{}.max_grad_norm;  // math §10 clipping (0: off)
};

Settings parse(int argc, char** argv) {
    Settings s;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--help" || a == "-h") {
            std::printf("usage: 01_associative_recall [--quick] [--out DIR] [--max-grad-norm C]\n"
                        "  --quick            a small problem (seconds; what the tests run)\n"
                        "  --out DIR          where the plot goes (default build, created)\n"
                        "  --max-grad-norm C  the memory's per-token gradient clipping (0: off)\n");
            std::exit(0);
        } else if (a == "--quick") {
            s.quick = true;
        } else if (a == "--out") {
            if (i + 1 >= argc) throw std::invalid_argument("--out needs a directory");
            s.out_dir = argv[++i];
        } else if (a.rfind("--out=", 0) == 0) {
            s.out_dir = a.substr(6);
        } else if (a == "--max-grad-norm") {
            if (i + 1 >= argc) throw std::invalid_argument("--max-grad-norm needs a value");
            s.max_grad_norm = std::stod(argv[++i]);
        } else {
            throw std::invalid_argument("unknown argument '" + a +
                                        "' (expected --quick, --out DIR, --max-grad-norm C)");
        }
    }
    if (s.quick) {
        s.d_h = 16;
        s.epochs = 4;
        s.trials = 2;
        s.pairs = {4, 8, 16, 32};
        s.tune_pairs = {8, 16};
        s.theta_grid = {0.5, 1.0, 2.0};
    }
    return s;
}

// ---------------------------------------------------------------------------------------------
// Random numbers, identical on every platform (std:: distributions are not).

class Rng {
public:
    explicit Rng(std::uint64_t seed) : state_(seed) {}
    std::uint64_t next() {  // SplitMix64
        std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
    double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
    double normal() {  // Box-Muller
        const double u1 = uniform(), u2 = uniform();
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    }
    Matrixf gaussian(int rows, int cols, double stddev) {
        Matrixf m(rows, cols);
        for (Eigen::Index i = 0; i < m.size(); ++i) {
            m.data()[i] = static_cast<float>(stddev * normal());
        }
        return m;
    }
    std::vector<int> permutation(int n) {  // Fisher-Yates
        std::vector<int> p(static_cast<std::size_t>(n));
        std::iota(p.begin(), p.end(), 0);
        for (int i = n - 1; i > 0; --i) {
            const auto j = static_cast<std::size_t>(next() % static_cast<std::uint64_t>(i + 1));
            std::swap(p[static_cast<std::size_t>(i)], p[j]);
        }
        return p;
    }

private:
    std::uint64_t state_;
};

// ---------------------------------------------------------------------------------------------
// The task: P random unit keys k and their values v = c ((k R1)^2 - 1) R2.

struct Task {
    Matrixf keys, values;  // P x d_h each
};

Task make_task(int P, int d_h, std::uint64_t seed) {
    Rng rng(seed);
    const Matrixf R1 = rng.gaussian(d_h, 2 * d_h, 1.0);  // k R1 has N(0, 1) entries
    const Matrixf R2 = rng.gaussian(2 * d_h, d_h, 1.0 / std::sqrt(2.0 * d_h));
    Task t;
    t.keys = rng.gaussian(P, d_h, 1.0);
    t.keys.rowwise().normalize();
    // The demo's own products take threads as the library's calls do (one on a busy machine).
    const titans::ThreadScope team({}, 4.0 * P * d_h * d_h);
    const Eigen::ArrayXXf z = (t.keys * R1).array();
    t.values = (z * z - 1.0f).matrix() * R2;
    t.values /= t.values.rowwise().norm().mean();  // c: values of unit mean norm, like the keys
    return t;
}

// One task per trial (each becomes one sequence of the batch).
std::vector<Task> make_tasks(int P, const Settings& s, std::uint64_t seed) {
    std::vector<Task> tasks;
    for (int b = 0; b < s.trials; ++b) {
        tasks.push_back(make_task(P, s.d_h, seed + std::uint64_t{1000003} * static_cast<std::uint64_t>(b + 1)));
    }
    return tasks;
}

// ---------------------------------------------------------------------------------------------
// The memory variants.

struct Variant {
    int depth;
    double eta;    // momentum decay (0: no momentum)
    double alpha;  // forget rate (0: no forgetting)
    double theta = 0;
};

// The grid of candidate learning rates is base_theta * Settings::theta_grid. Momentum 0.9
// multiplies the effective step by up to 1 / (1 - 0.9) = 10, so its base is 10x smaller.
double base_theta(const Variant& v) { return v.eta > 0 ? 0.25 * (1.0 - v.eta) : 0.25; }

titans::MemoryConfig make_config(const Variant& v, const Settings& s) {
    return titans::MemoryConfig{.d_model = 2 * s.d_h,
                                .n_heads = 1,
                                .d_head = s.d_h,
                                .depth = v.depth,
                                .expansion = 4,
                                .activation = titans::Activation::SiLU,
                                .use_conv = false,
                                .qkv_activation = titans::Activation::Identity,
                                .normalize_qk = true,
                                .gates = titans::GateMode::Constant,
                                .constant_theta = v.theta,
                                .constant_eta = v.eta,
                                .constant_alpha = v.alpha,
                                .max_grad_norm = s.max_grad_norm,
                                .update = titans::UpdateMode::Chunked,
                                .retrieval = titans::Retrieval::Lagged,
                                .chunk = s.chunk};
}

// Projections that hand the memory the key and value halves of x = [key | value]; the initial
// memory weights W_l^0 are the library's seeded random draw, N(0, 1/fan_in).
titans::MemoryParams<float> make_params(const titans::MemoryConfig& cfg, std::uint64_t seed) {
    auto p = titans::MemoryParams<float>::random(cfg, seed);
    const int dh = cfg.head_dim();
    const Matrixf I = Matrixf::Identity(dh, dh), Z = Matrixf::Zero(dh, dh);
    p.w_k.resize(2 * dh, dh);
    p.w_k << I, Z;  // stacked: [I; 0]
    p.w_q = p.w_k;
    p.w_v.resize(2 * dh, dh);
    p.w_v << Z, I;
    p.w_o.resize(dh, 2 * dh);
    p.w_o << I, Z;  // side by side: [I 0]
    return p;
}

// Memory weights per head: the matrix memory has d_h^2, the MLPs e d_h^2 + (L-2) e^2 d_h^2 + e d_h^2.
long memory_weights(int depth, int d_h) {
    const long e = 4, d = d_h;
    return depth == 1 ? d * d : 2 * e * d * d + (depth - 2) * e * e * d * d;
}

struct Score {
    double error = 0, accuracy = 0;
    bool diverged = false;
};

// Streams every task's pairs (task b is sequence b of the batch) for s.epochs epochs in fresh
// random orders, then reads all keys back and scores the read-outs.
Score run(const Variant& v, const std::vector<Task>& tasks, const Settings& s,
          std::uint64_t seed) {
    const titans::MemoryConfig cfg = make_config(v, s);
    const titans::NeuralMemory<float> mem(cfg, make_params(cfg, seed));
    const int B = static_cast<int>(tasks.size());
    const int P = static_cast<int>(tasks.front().keys.rows());
    const int dh = s.d_h;
    auto state = mem.make_state(B);

    // Write (test-time learning): sequence b is epochs x P tokens [k | v], sequence-major.
    Rng rng(seed ^ 0x5eedULL);
    const Eigen::Index N = static_cast<Eigen::Index>(s.epochs) * P;
    Matrixf x(B * N, 2 * dh), y;
    for (int b = 0; b < B; ++b) {
        const Task& t = tasks[static_cast<std::size_t>(b)];
        for (int e = 0; e < s.epochs; ++e) {
            const std::vector<int> order = rng.permutation(P);
            for (int i = 0; i < P; ++i) {
                const Eigen::Index r = b * N + static_cast<Eigen::Index>(e) * P + i;
                const int j = order[static_cast<std::size_t>(i)];
                x.row(r) << t.keys.row(j), t.values.row(j);
            }
        }
    }
    // Read: the queries are the keys alone (the value half is zero; W_Q ignores it anyway).
    Matrixf q = Matrixf::Zero(B * P, 2 * dh);
    for (int b = 0; b < B; ++b) {
        q.middleRows(b * P, P).leftCols(dh) = tasks[static_cast<std::size_t>(b)].keys;
    }
    Score sc;
    Matrixf read;
    try {
        mem.forward(state, x, y);  // the outputs y are not needed here
        read = mem.read(state, q);
    } catch (const titans::NonFiniteError&) {  // a too-large theta (possible with clipping off)
        sc.diverged = true;
    }
    for (int b = 0; b < B && !sc.diverged; ++b) {
        const Matrixf& V = tasks[static_cast<std::size_t>(b)].values;
        const Matrixf Y = read.middleRows(b * P, P).leftCols(dh);
        if (!Y.allFinite()) {
            sc.diverged = true;
            break;
        }
        const titans::ThreadScope team({}, static_cast<double>(P) * P * dh);
        const Matrixf cosine = Y.rowwise().normalized() * V.rowwise().normalized().transpose();
        for (int i = 0; i < P; ++i) {
            sc.error += (Y.row(i) - V.row(i)).norm() / V.row(i).norm();
            Eigen::Index nearest = 0;
            cosine.row(i).maxCoeff(&nearest);
            sc.accuracy += nearest == i ? 1.0 : 0.0;
        }
    }
    if (sc.diverged) {
        sc.error = std::numeric_limits<double>::infinity();
        sc.accuracy = 0;
    } else {
        sc.error /= static_cast<double>(B) * P;
        sc.accuracy /= static_cast<double>(B) * P;
    }
    return sc;
}

// Picks theta from base_theta(v) * s.theta_grid: best mean accuracy over s.tune_pairs (ties:
// lowest error), on tasks drawn from other seeds than the evaluation's.
double tune_theta(const Variant& v, const std::vector<std::vector<Task>>& tune_tasks,
                  const Settings& s) {
    double best_acc = -1, best_err = 0, best_theta = base_theta(v);
    for (double g : s.theta_grid) {
        Variant c = v;
        c.theta = base_theta(v) * g;
        double acc = 0, err = 0;
        for (const auto& tasks : tune_tasks) {
            const Score sc = run(c, tasks, s, 99);
            acc += sc.accuracy;
            err += sc.diverged ? 1e9 : sc.error;
        }
        if (acc > best_acc + 1e-9 || (acc > best_acc - 1e-9 && err < best_err)) {
            best_acc = acc;
            best_err = err;
            best_theta = c.theta;
        }
    }
    return best_theta;
}

// ---------------------------------------------------------------------------------------------
// The SVG plot: accuracy (left panel) and error (right panel) against P on a log2 axis.

std::string fmt(const char* f, double v) {
    char buf[512];
    std::snprintf(buf, sizeof buf, f, v);
    return buf;
}

void write_svg(const std::string& path, const Settings& s, const std::vector<Variant>& variants,
               const std::vector<std::vector<Score>>& scores) {
    std::ofstream f(path);
    if (!f) throw std::runtime_error("cannot open " + path + " for writing");
    const double W = 1100, panel_w = 420, panel_h = 300, top = 70, left0 = 85, gap = 130;
    const double legend_top = top + panel_h + 80, H = legend_top + 22.0 * 4 + 20;
    const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c"};  // by depth 1, 2, 3
    const char* dashes[] = {"", "9 5", "2 4", "10 4 2 4"};      // by momentum / forgetting
    const char* style_names[] = {"momentum 0.9, forget 0.01", "momentum 0.9, no forgetting",
                                 "no momentum, forget 0.01", "no momentum, no forgetting"};
    const char* depth_names[] = {"matrix memory (L = 1)", "MLP memory, L = 2", "MLP memory, L = 3"};
    auto style = [](const Variant& v) { return (v.eta > 0 ? 0 : 2) + (v.alpha > 0 ? 0 : 1); };
    auto dash_attr = [&](int st) {
        return *dashes[st] ? std::string(" stroke-dasharray=\"") + dashes[st] + "\"" : std::string();
    };
    const double lx0 = std::log2(s.pairs.front()), lx1 = std::log2(s.pairs.back());
    double err_max = 0.2;
    for (const auto& row : scores) {
        for (const Score& sc : row) {
            if (!sc.diverged) err_max = std::max(err_max, std::ceil(sc.error * 5.0) / 5.0);
        }
    }

    f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
      << "\" viewBox=\"0 0 " << W << ' ' << H
      << "\" font-family=\"Helvetica, Arial, sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << W / 2 << "\" y=\"28\" text-anchor=\"middle\" font-size=\"19\">"
      << "Titans neural memory: associative recall after test-time learning</text>\n"
      << "<text x=\"" << W / 2 << "\" y=\"50\" text-anchor=\"middle\" font-size=\"13\" fill=\"#555\">"
      << "keys in R^" << s.d_h << ", values c((kR1)^2-1)R2; " << s.epochs << " epochs, chunk "
      << s.chunk << "; mean of " << s.trials << " trials; theta tuned per variant</text>\n";

    for (int panel = 0; panel < 2; ++panel) {
        const double x0 = left0 + panel * (panel_w + gap), y0 = top;
        const double ymax = panel == 0 ? 100.0 : err_max;
        auto px = [&](double P) { return x0 + (std::log2(P) - lx0) / (lx1 - lx0) * panel_w; };
        auto py = [&](double v) { return y0 + panel_h - std::min(v, ymax) / ymax * panel_h; };
        auto value = [&](const Score& sc) {
            return panel == 0 ? 100.0 * sc.accuracy : (sc.diverged ? ymax : sc.error);
        };
        f << "<g font-size=\"12\" fill=\"#333\">\n";
        for (int P : s.pairs) {
            f << "<line x1=\"" << px(P) << "\" y1=\"" << y0 << "\" x2=\"" << px(P) << "\" y2=\""
              << y0 + panel_h << "\" stroke=\"#e6e6e6\"/>\n<text x=\"" << px(P) << "\" y=\""
              << y0 + panel_h + 18 << "\" text-anchor=\"middle\">" << P << "</text>\n";
        }
        const int n_ticks = panel == 0 ? 5 : static_cast<int>(std::lround(ymax / 0.2));
        for (int t = 0; t <= n_ticks; ++t) {
            const double v = ymax * t / n_ticks;
            f << "<line x1=\"" << x0 << "\" y1=\"" << py(v) << "\" x2=\"" << x0 + panel_w
              << "\" y2=\"" << py(v) << "\" stroke=\"#e6e6e6\"/>\n<text x=\"" << x0 - 8
              << "\" y=\"" << py(v) + 4 << "\" text-anchor=\"end\">"
              << (panel == 0 ? fmt("%.0f%%", v) : fmt("%.1f", v)) << "</text>\n";
        }
        f << "</g>\n<rect x=\"" << x0 << "\" y=\"" << y0 << "\" width=\"" << panel_w
          << "\" height=\"" << panel_h << "\" fill=\"none\" stroke=\"#333\"/>\n<text x=\""
          << x0 + panel_w / 2 << "\" y=\"" << y0 + panel_h + 42
          << "\" text-anchor=\"middle\" font-size=\"14\">stored pairs P (log2 scale)</text>\n"
          << "<text transform=\"translate(" << x0 - 52 << ',' << y0 + panel_h / 2
          << ") rotate(-90)\" text-anchor=\"middle\" font-size=\"14\">"
          << (panel == 0 ? "recall accuracy (nearest stored value)"
                         : "relative recall error ||y - v|| / ||v||")
          << "</text>\n";
        if (panel == 0) {  // chance level 1/P
            f << "<polyline fill=\"none\" stroke=\"#999\" stroke-width=\"1\" points=\"";
            for (int P : s.pairs) f << px(P) << ',' << py(100.0 / P) << ' ';
            f << "\"/>\n<text x=\"" << px(s.pairs[1]) << "\" y=\"" << py(100.0 / s.pairs[1]) - 6
              << "\" font-size=\"11\" fill=\"#777\">chance 1/P</text>\n";
        }
        for (std::size_t vi = 0; vi < variants.size(); ++vi) {
            const char* color = colors[(variants[vi].depth - 1) % 3];
            f << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\""
              << dash_attr(style(variants[vi])) << " points=\"";
            for (std::size_t pi = 0; pi < s.pairs.size(); ++pi) {
                f << px(s.pairs[pi]) << ',' << py(value(scores[vi][pi])) << ' ';
            }
            f << "\"/>\n";
            for (std::size_t pi = 0; pi < s.pairs.size(); ++pi) {
                f << "<circle cx=\"" << px(s.pairs[pi]) << "\" cy=\"" << py(value(scores[vi][pi]))
                  << "\" r=\"2.5\" fill=\"" << color << "\"/>\n";
            }
        }
    }
    // Legend: a column per depth (color), a row per momentum / forgetting setting (dashes).
    f << "<g font-size=\"13\">\n";
    for (int d = 0; d < 3; ++d) {
        const double lx = left0 + d * 340.0;
        f << "<text x=\"" << lx << "\" y=\"" << legend_top - 10 << "\" font-weight=\"bold\" fill=\""
          << colors[d] << "\">" << depth_names[d] << "</text>\n";
        for (int st = 0; st < 4; ++st) {
            const double ly = legend_top + 8 + 22.0 * st;
            double theta = 0;
            for (const Variant& v : variants) {
                if (v.depth == d + 1 && style(v) == st) theta = v.theta;
            }
            f << "<line x1=\"" << lx << "\" y1=\"" << ly << "\" x2=\"" << lx + 40 << "\" y2=\""
              << ly << "\" stroke=\"" << colors[d] << "\" stroke-width=\"2\"" << dash_attr(st)
              << "/>\n<text x=\"" << lx + 48 << "\" y=\"" << ly + 4 << "\">" << style_names[st]
              << fmt(", theta %.3g", theta) << "</text>\n";
        }
    }
    f << "</g>\n</svg>\n";
    f.close();
    if (!f) throw std::runtime_error("error writing " + path);
}

// ---------------------------------------------------------------------------------------------
// What is printed: plain words, tables a newcomer reads without a legend, a short conclusion.

// Prints `text` wrapped at 80 columns, continuation lines indented by `indent` spaces.
void print_wrapped(const std::string& text, std::size_t indent = 0) {
    std::size_t col = 0;
    std::size_t i = 0;
    while (i < text.size()) {
        const std::size_t j = std::min(text.find(' ', i), text.size());
        const std::string word = text.substr(i, j - i);
        if (col > indent && col + 1 + word.size() > 80) {
            std::printf("\n%s", std::string(indent, ' ').c_str());
            col = indent;
        } else if (col > 0) {
            std::printf(" ");
            ++col;
        }
        std::printf("%s", word.c_str());
        col += word.size();
        i = j + 1;
    }
    std::printf("\n");
}

void print_header(const Settings& s) {
    std::printf("Associative recall: how many key -> value pairs can a Titans memory hold?\n%s\n",
                s.quick ? "(--quick: a small problem, for tests)\n" : "");
    print_wrapped(fmt("What is stored: P pairs, each a random key and its value (vectors of %.0f "
                      "numbers; the value is a fixed nonlinear function of the key). The memory "
                      "reads the pairs ",
                      s.d_h) +
                      std::to_string(s.epochs) +
                      " times in random order and learns them while it reads (test-time "
                      "learning); nothing else is trained.",
                  2);
    print_wrapped("What is asked: each key alone. The answer counts as right when it is closer "
                  "to the key's own value than to any other stored value.",
                  2);
    print_wrapped("Chance: 1 in P (a random guess among the stored values).", 2);
    print_wrapped("Compared: a matrix memory (1 layer, like linear attention) against MLP "
                  "memories of 2 and 3 layers, each with and without momentum and forgetting, "
                  "each with its own learning rate (chosen on separate practice pairs). " +
                      std::to_string(s.trials) + " independent runs per cell, averaged.",
                  2);
}

// One table: a row per memory variant, a column per P; `cell` formats one score.
template <class Cell>
void print_table(const char* title, const Settings& s, const std::vector<Variant>& variants,
                 const std::vector<std::vector<Score>>& scores, const std::string& chance_row,
                 Cell cell) {
    std::printf("\n%s\n%-15s%-10s%-11s|", title, "memory layers", "momentum", "forgetting");
    for (int P : s.pairs) std::printf("%7s", ("P=" + std::to_string(P)).c_str());
    std::printf("\n%s\n", std::string(37 + 7 * s.pairs.size(), '-').c_str());
    for (std::size_t vi = 0; vi < variants.size(); ++vi) {
        const Variant& v = variants[vi];
        const std::string layers = std::to_string(v.depth) + (v.depth == 1 ? " (matrix)" : " (MLP)");
        std::printf("%-15s%-10s%-11s|", layers.c_str(), v.eta > 0 ? "yes" : "no",
                    v.alpha > 0 ? "yes" : "no");
        for (const Score& sc : scores[vi]) std::printf("%7s", cell(sc).c_str());
        std::printf("\n");
    }
    if (!chance_row.empty()) std::printf("%s\n", chance_row.c_str());
}

void print_tables(const Settings& s, const std::vector<Variant>& variants,
                  const std::vector<std::vector<Score>>& scores) {
    std::string chance = "chance (1 in P)" + std::string(21, ' ') + "|";
    for (int P : s.pairs) chance += fmt("%6.1f%%", 100.0 / P);
    print_table("Keys recalled correctly, by number of stored pairs P:", s, variants, scores,
                chance, [](const Score& sc) {
                    return sc.diverged ? std::string("n/a") : fmt("%.0f%%", 100.0 * sc.accuracy);
                });
    print_table("Error of the answers, |answer - value| / |value| (0: exact; 1: as far off\n"
                "as answering zero):",
                s, variants, scores, "", [](const Score& sc) {
                    return sc.diverged ? std::string("n/a") : fmt("%.2f", sc.error);
                });
}

// The conclusion, computed from the tables: compared where it matters, at the largest P at
// which some variant still recalls at least half of the keys.
void print_conclusion(const Settings& s, const std::vector<Variant>& variants,
                      const std::vector<std::vector<Score>>& scores) {
    const std::size_t nv = variants.size(), np = s.pairs.size();
    std::size_t pc = 0;
    for (std::size_t pi = 0; pi < np; ++pi) {
        for (std::size_t vi = 0; vi < nv; ++vi) {
            if (scores[vi][pi].accuracy >= 0.5) pc = pi;
        }
    }
    double acc[3] = {0, 0, 0};  // best accuracy (%) per depth at P = s.pairs[pc]
    for (std::size_t vi = 0; vi < nv; ++vi) {
        double& a = acc[variants[vi].depth - 1];
        a = std::max(a, 100 * scores[vi][pc].accuracy);
    }
    // Mean change of accuracy (points) when momentum / forgetting is switched on, over the
    // pairs of variants that differ only in it (depths in [d0, d1]) and every P.
    auto effect = [&](bool momentum, int d0, int d1) {
        double sum = 0;
        int n = 0;
        for (std::size_t i = 0; i < nv; ++i) {
            for (std::size_t j = 0; j < nv; ++j) {
                const Variant &on = variants[i], &off = variants[j];
                const bool pair =
                    on.depth == off.depth && on.depth >= d0 && on.depth <= d1 &&
                    (momentum ? on.eta > 0 && off.eta == 0 && on.alpha == off.alpha
                              : on.alpha > 0 && off.alpha == 0 && on.eta == off.eta);
                for (std::size_t pi = 0; pair && pi < np; ++pi, ++n) {
                    sum += 100 * (scores[i][pi].accuracy - scores[j][pi].accuracy);
                }
            }
        }
        return n ? sum / n : 0.0;
    };
    const double deep = std::max(acc[1], acc[2]);
    std::string text = fmt("Conclusion: with P = %.0f stored pairs, ", s.pairs[pc]) +
                       fmt("the best 2-layer memory recalls %.0f%% of the keys ", acc[1]) +
                       fmt("and the best 3-layer memory %.0f%%, ", acc[2]) +
                       fmt("against %.0f%% for the best matrix memory ", acc[0]) +
                       fmt("(the matrix holds %.0f weights, ",
                           static_cast<double>(memory_weights(1, s.d_h))) +
                       fmt("the MLPs %.0f ", static_cast<double>(memory_weights(2, s.d_h))) +
                       fmt("and %.0f). ", static_cast<double>(memory_weights(3, s.d_h)));
    if (deep > acc[0] + 5) {
        text += "A deeper memory holds more pairs from the same stream.";
    } else if (acc[0] > deep + 5) {
        text += "Here the matrix memory is the better choice.";
    } else {
        text += "Here depth makes little difference (within 5 points).";
    }
    text += fmt(" On average momentum changes recall by %+.0f points; ", effect(true, 1, 3)) +
            fmt("forgetting by %+.0f points ", effect(false, 1, 3)) +
            "(a stored pair fades between its visits).";
    std::printf("\n");
    print_wrapped(text);
}

int run_demo(const Settings& s) {
    const auto t0 = std::chrono::steady_clock::now();
    print_header(s);
    std::vector<Variant> variants;
    for (int depth : {1, 2, 3}) {
        for (double eta : {0.9, 0.0}) {
            for (double alpha : {0.01, 0.0}) variants.push_back({depth, eta, alpha});
        }
    }
    std::vector<std::vector<Task>> tune_tasks;
    for (int P : s.tune_pairs) {
        tune_tasks.push_back(make_tasks(P, s, 777 + static_cast<std::uint64_t>(P)));
    }
    std::vector<std::vector<Score>> scores(variants.size());
    const bool tty = isatty(fileno(stdout)) != 0;
    for (std::size_t vi = 0; vi < variants.size(); ++vi) {
        if (tty) {  // a progress line, overwritten (not in logs)
            std::printf("\r  running: memory %zu of %zu", vi + 1, variants.size());
            std::fflush(stdout);
        }
        Variant& v = variants[vi];
        v.theta = tune_theta(v, tune_tasks, s);
        for (int P : s.pairs) {
            const auto tasks = make_tasks(P, s, 12345 + static_cast<std::uint64_t>(P));
            scores[vi].push_back(run(v, tasks, s, 2024 + static_cast<std::uint64_t>(P)));
        }
    }
    if (tty) std::printf("\r%40s\r", "");
    print_tables(s, variants, scores);
    print_conclusion(s, variants, scores);

    std::filesystem::create_directories(s.out_dir);
    const std::string plot = (std::filesystem::path(s.out_dir) / "associative_recall.svg").string();
    write_svg(plot, s, variants, scores);
    std::printf("\nPlot of both tables (and each memory's learning rate): %s\n", plot.c_str());
    std::printf("Total time %.1f s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run_demo(parse(argc, argv));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "01_associative_recall: %s\n", e.what());
        return 1;
    }
}
