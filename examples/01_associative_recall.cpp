// Associative recall: is a deep memory needed? (Titans, sections 3.1 and 5.5)
//
// A neural long-term memory learns key -> value pairs at test time, from the stream alone:
// the outer parameters stay fixed, only the memory weights change (SPEC §3-4). We stream P
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
// Output: a table, an SVG plot (associative_recall.svg, or --out FILE) and a conclusion
// computed from the numbers. --quick: a small problem for CI (a few seconds under ASan).
// --max-grad-norm C: the memory's per-token gradient clipping (SPEC §10; default the
// library's, 1; 0 turns it off, the behaviour before clipping existed).

#include <titans/titans.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using titans::Matrixf;

// ---------------------------------------------------------------------------------------------
// Settings.

struct Settings {
    bool quick = false;
    std::string out = "associative_recall.svg";
    int d_h = 32;       // head width: keys and values live in R^d_h
    int chunk = 8;      // tokens per chunk of the update (SPEC §4)
    int epochs = 16;    // passes over the P pairs, each in a fresh random order
    int trials = 4;     // independent tasks per point, run as one batch, averaged
    std::vector<int> pairs = {8, 16, 32, 64, 128, 256};
    std::vector<int> tune_pairs = {16, 64};                   // P used to pick theta
    std::vector<double> theta_grid = {0.25, 0.5, 1.0, 2.0, 4.0};  // x base_theta
    double max_grad_norm = titans::MemoryConfig{}.max_grad_norm;  // SPEC §10 clipping (0: off)
};

Settings parse(int argc, char** argv) {
    Settings s;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--quick") {
            s.quick = true;
        } else if (a == "--out") {
            if (i + 1 >= argc) throw std::invalid_argument("--out needs a file name");
            s.out = argv[++i];
        } else if (a.rfind("--out=", 0) == 0) {
            s.out = a.substr(6);
        } else if (a == "--max-grad-norm") {
            if (i + 1 >= argc) throw std::invalid_argument("--max-grad-norm needs a value");
            s.max_grad_norm = std::stod(argv[++i]);
        } else {
            throw std::invalid_argument("unknown argument '" + a +
                                        "' (expected --quick, --out FILE, --max-grad-norm C)");
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
    [[nodiscard]] std::string label() const {
        return "L" + std::to_string(depth) + (eta > 0 ? " +mom" : " -mom") +
               (alpha > 0 ? " +fgt" : " -fgt");
    }
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
// The conclusion, computed from the table.

void print_conclusion(const Settings& s, const std::vector<Variant>& variants,
                      const std::vector<std::vector<Score>>& scores) {
    const std::size_t nv = variants.size(), np = s.pairs.size();
    auto better = [](const Score& a, const Score& b) {
        return a.accuracy > b.accuracy || (a.accuracy == b.accuracy && a.error < b.error);
    };
    auto best_of_depth = [&](int depth, std::size_t pi) {
        std::size_t best = nv;
        for (std::size_t vi = 0; vi < nv; ++vi) {
            if (variants[vi].depth == depth &&
                (best == nv || better(scores[vi][pi], scores[best][pi]))) {
                best = vi;
            }
        }
        return best;
    };
    // Compare where it matters: the largest P at which some variant still recalls >= 50 %.
    std::size_t pc = 0;
    for (std::size_t pi = 0; pi < np; ++pi) {
        for (std::size_t vi = 0; vi < nv; ++vi) {
            if (scores[vi][pi].accuracy >= 0.5) pc = pi;
        }
    }
    const std::size_t pb = pc > 0 ? pc - 1 : pc;  // and one step smaller
    std::size_t best[3];
    double acc[3], err[3], acc_b[3];
    for (int d = 0; d < 3; ++d) {
        best[d] = best_of_depth(d + 1, pc);
        acc[d] = 100 * scores[best[d]][pc].accuracy;
        err[d] = scores[best[d]][pc].error;
        acc_b[d] = 100 * scores[best_of_depth(d + 1, pb)][pb].accuracy;
    }
    // Mean change of accuracy (points) when momentum / forgetting is switched on, over the
    // pairs of variants that differ only in it, and every P; per depth for forgetting.
    auto effect = [&](bool momentum, int depth) {
        double sum = 0;
        int n = 0;
        for (std::size_t i = 0; i < nv; ++i) {
            for (std::size_t j = 0; j < nv; ++j) {
                const Variant &on = variants[i], &off = variants[j];
                const bool pair =
                    on.depth == off.depth && (depth == 0 || on.depth == depth) &&
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
    std::string verdict;
    if (deep > acc[0] + 5) {
        verdict = fmt("So on this task a deep memory is worth it: same keys, same stream, and the "
                      "best MLP memory recalls %.0f points more than the best matrix memory.",
                      deep - acc[0]);
    } else if (acc[0] > deep + 5) {
        verdict = fmt("So on this task the matrix memory is the better choice, by %.0f points.",
                      acc[0] - deep);
    } else {
        verdict = "So on this task depth makes little difference (within 5 points).";
    }
    std::printf(
        "\nConclusion: at P = %d pairs (keys in R^%d) the best 2-layer memory (%s) recalls "
        "%.1f%% of the keys and the best 3-layer memory (%s) %.1f%%, against %.1f%% for the best "
        "matrix memory (%s); mean relative errors %.3f, %.3f and %.3f. At P = %d the best of each "
        "depth recalls %.1f%% (L = 1), %.1f%% (L = 2) and %.1f%% (L = 3). The memories hold %ld "
        "(L = 1), %ld (L = 2) and %ld (L = 3) weights. Averaged over depths and P, momentum "
        "changes accuracy by %+.1f points; forgetting (alpha 0.01 per token) by %+.1f points for "
        "the matrix memory and %+.1f / %+.1f points for L = 2 / 3: every pair fades between its "
        "visits, and decay on every layer of an MLP compounds. %s\n",
        s.pairs[pc], s.d_h, variants[best[1]].label().c_str(), acc[1],
        variants[best[2]].label().c_str(), acc[2], acc[0], variants[best[0]].label().c_str(),
        err[1], err[2], err[0], s.pairs[pb], acc_b[0], acc_b[1], acc_b[2],
        memory_weights(1, s.d_h), memory_weights(2, s.d_h), memory_weights(3, s.d_h),
        effect(true, 0), effect(false, 1), effect(false, 2), effect(false, 3), verdict.c_str());
}

// ---------------------------------------------------------------------------------------------

int run_demo(const Settings& s) {
    const auto t0 = std::chrono::steady_clock::now();
    std::printf("Associative recall with the Titans neural memory%s\n",
                s.quick ? " (--quick: small problem)" : "");
    std::printf("  task:   P random unit keys k in R^%d, values v = c ((k R1)^2 - 1) R2 "
                "(R1 %dx%d, R2 %dx%d random, c: unit mean norm)\n",
                s.d_h, s.d_h, 2 * s.d_h, 2 * s.d_h, s.d_h);
    std::printf("  memory: 1 head, d_h %d, d_model %d, no conv, identity phi, L2-normalised q/k, "
                "W_K = W_Q = [I;0], W_V = [0;I], W_O = [I 0]\n",
                s.d_h, 2 * s.d_h);
    std::printf("  write:  %d epochs over the pairs (fresh order each), chunked update (chunk %d), "
                "constant gates; read: NeuralMemory::read\n",
                s.epochs, s.chunk);
    std::printf("  %d trials per point (one batch of %d sequences), float\n\n", s.trials, s.trials);

    std::vector<Variant> variants;
    for (int depth : {1, 2, 3}) {
        for (double eta : {0.9, 0.0}) {
            for (double alpha : {0.01, 0.0}) variants.push_back({depth, eta, alpha});
        }
    }

    std::printf("Learning rate theta per variant: best accuracy on separate data at P =");
    for (int P : s.tune_pairs) std::printf(" %d", P);
    std::printf(", from 0.25 x {");
    for (std::size_t i = 0; i < s.theta_grid.size(); ++i) {
        std::printf("%s%g", i ? ", " : "", s.theta_grid[i]);
    }
    std::printf("} (x 0.1 with momentum)\n");
    std::vector<std::vector<Task>> tune_tasks;
    for (int P : s.tune_pairs) {
        tune_tasks.push_back(make_tasks(P, s, 777 + static_cast<std::uint64_t>(P)));
    }
    for (Variant& v : variants) {
        v.theta = tune_theta(v, tune_tasks, s);
        std::printf("  %-15s depth %d  eta %.1f  alpha %.2f  theta %.4g\n", v.label().c_str(),
                    v.depth, v.eta, v.alpha, v.theta);
    }

    std::vector<std::vector<Score>> scores(variants.size());
    for (int P : s.pairs) {
        const auto tasks = make_tasks(P, s, 12345 + static_cast<std::uint64_t>(P));
        for (std::size_t vi = 0; vi < variants.size(); ++vi) {
            scores[vi].push_back(run(variants[vi], tasks, s, 2024 + static_cast<std::uint64_t>(P)));
        }
    }

    std::printf("\nRecall after test-time learning: mean relative error, accuracy (chance 1/P)\n");
    std::printf("%-15s", "variant");
    for (int P : s.pairs) std::printf(" | P = %-9d", P);
    std::printf("\n%s\n", std::string(15 + 15 * s.pairs.size(), '-').c_str());
    for (std::size_t vi = 0; vi < variants.size(); ++vi) {
        std::printf("%-15s", variants[vi].label().c_str());
        for (const Score& sc : scores[vi]) {
            if (sc.diverged) {
                std::printf(" | %-12s", "diverged");
            } else {
                std::printf(" | %5.3f %5.1f%%", sc.error, 100.0 * sc.accuracy);
            }
        }
        std::printf("\n");
    }
    std::printf("L = depth (1: matrix memory); +mom: eta 0.9, -mom: eta 0; +fgt: alpha 0.01, "
                "-fgt: alpha 0\n");

    write_svg(s.out, s, variants, scores);
    std::printf("\nPlot written to %s\n", s.out.c_str());
    print_conclusion(s, variants, scores);
    std::printf("\nTotal time %.1f s\n",
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
