// examples/05_serve.cpp: serving many streams token by token, as an inference server does.
//
//     ./05_serve [--quick] [--streams B] [--steps S] [--kind MAG|MAC|MAL|LMM] [--threads N]
//                [--out DIR]
//
// A 2-block model (d 256, 4 heads, memory depth 2) keeps B independent streams in one state.
// Each step, a generator (a random walk per stream, with bursts and repeats) produces the next
// token of every stream, and the model processes all B of them in one call: a B x d input, so
// the projections are B-row products instead of B separate vector products. Printed: a
// progress line (on a terminal), then throughput (tokens/s over all streams), the latency of
// a step (p50, p90, p99, max: the time from a token's arrival to its output), and the same
// streams fed one at a time for comparison. At the end every stream is checkpointed to
// DIR/serve_streams.safetensors (default build/), reloaded, and one more step is checked to
// continue bit-identically.
//
// --threads N caps the threads of every call (0 = automatic: one thread for small calls, and
// fewer on a machine whose CPUs other programs keep busy; see docs/design.md, "Threads").

#include <titans/io/checkpoint.hpp>
#include <titans/titans.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>  // isatty: the progress line only on a terminal

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
    int streams = 64;
    int steps = 512;
    titans::BlockKind kind = titans::BlockKind::MAG;
    int threads = 0;
    std::filesystem::path out = "build";
};

titans::BlockKind parse_kind(const std::string& s) {
    if (s == "MAG") return titans::BlockKind::MAG;
    if (s == "MAC") return titans::BlockKind::MAC;
    if (s == "MAL") return titans::BlockKind::MAL;
    if (s == "LMM") return titans::BlockKind::LMM;
    throw std::invalid_argument("--kind '" + s + "' (expected MAG, MAC, MAL or LMM)");
}

int parse_int(const char* flag, const char* text, int lo, int hi) {
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (end == text || *end != '\0' || v < lo || v > hi) {
        throw std::invalid_argument(std::string(flag) + " '" + text + "' (expected an integer in [" +
                                    std::to_string(lo) + ", " + std::to_string(hi) + "])");
    }
    return static_cast<int>(v);
}

Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const bool has_value = i + 1 < argc;
        if (a == "--quick") {
            o.streams = 8;
            o.steps = 96;
        } else if (a == "--help" || a == "-h") {
            std::printf("usage: 05_serve [--quick] [--streams B] [--steps S] [--kind K] "
                        "[--threads N] [--out DIR]\n");
            std::exit(0);
        } else if (a == "--streams" && has_value) {
            o.streams = parse_int("--streams", argv[++i], 1, 4096);
        } else if (a == "--steps" && has_value) {
            o.steps = parse_int("--steps", argv[++i], 1, 1 << 20);
        } else if (a == "--kind" && has_value) {
            o.kind = parse_kind(argv[++i]);
        } else if (a == "--threads" && has_value) {
            o.threads = parse_int("--threads", argv[++i], 0, 1024);
        } else if (a == "--out" && has_value) {
            o.out = argv[++i];
        } else {
            throw std::invalid_argument("unknown or incomplete argument '" + a +
                                        "' (try --help)");
        }
    }
    return o;
}

/// The next token of every stream: a random walk with occasional bursts (x 20) and repeats.
class Generator {
public:
    Generator(int streams, int d, unsigned seed)
        : rng_(seed), walk_(titans::Matrixf::Zero(streams, d)) {}
    const titans::Matrixf& next() {
        std::normal_distribution<float> n(0.0f, 0.3f);
        std::uniform_real_distribution<float> u(0.0f, 1.0f);
        for (Eigen::Index b = 0; b < walk_.rows(); ++b) {
            const float r = u(rng_);
            if (r < 0.05f) continue;  // a repeat: the same token again
            for (Eigen::Index j = 0; j < walk_.cols(); ++j) walk_(b, j) = 0.9f * walk_(b, j) + n(rng_);
            if (r > 0.99f) walk_.row(b) *= 20.0f;  // a burst
        }
        return walk_;
    }

private:
    std::mt19937 rng_;
    titans::Matrixf walk_;
};

double percentile(std::vector<double> v, double p) {
    std::sort(v.begin(), v.end());
    const auto i = static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
}

titans::Model<float> make_model(titans::BlockKind kind) {
    auto cfg = titans::ModelConfig::uniform(kind, 2, 256, 4, 2, 128);
    for (auto& b : cfg.blocks) b.memory.theta_max = 0.01;
    auto p = titans::ModelParams<float>::random(cfg, 7);
    for (auto& b : p.blocks) b.memory.b_alpha.setConstant(-8.0f);
    return titans::Model<float>(cfg, std::move(p));
}

/// Feeds `steps` steps of all streams (one call each); returns each step's latency (ms).
std::vector<double> serve(const titans::Model<float>& model, titans::ModelState<float>& st,
                          Generator& gen, int steps, bool tty) {
    std::vector<double> ms;
    ms.reserve(static_cast<std::size_t>(steps));
    const auto start = Clock::now();
    for (int s = 0; s < steps; ++s) {
        const titans::Matrixf& x = gen.next();
        const auto t0 = Clock::now();
        const titans::Matrixf y = model.forward(st, x);
        ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        if (tty && (s % 16 == 15 || s + 1 == steps)) {
            const double secs = std::chrono::duration<double>(Clock::now() - start).count();
            std::printf("\r  step %d/%d, %.0f tokens/s   ", s + 1, steps,
                        static_cast<double>(x.rows()) * (s + 1) / secs);
            std::fflush(stdout);
        }
    }
    if (tty) std::printf("\n");
    return ms;
}

void report(const char* what, const std::vector<double>& ms, int streams) {
    double total = 0;
    for (double v : ms) total += v;
    std::printf("  %-26s %9.0f tokens/s   step latency ms: p50 %.2f  p90 %.2f  p99 %.2f  max %.2f\n",
                what, streams * static_cast<double>(ms.size()) / (total / 1e3), percentile(ms, 50),
                percentile(ms, 90), percentile(ms, 99), percentile(ms, 100));
}

}  // namespace

int main(int argc, char** argv) try {
    const Options o = parse(argc, argv);
    const bool tty = isatty(fileno(stdout)) != 0;
    titans::Model<float> model = make_model(o.kind);
    model.set_threads(titans::Threads{.max = o.threads});
    const int d = model.config().d_model;
    std::printf("Serving %d streams, one token per stream per step, %d steps (%s blocks, d %d).\n",
                o.streams, o.steps, titans::to_string(o.kind), d);

    auto st = model.make_state(o.streams);
    Generator gen(o.streams, d, 1);
    const auto batched = serve(model, st, gen, o.steps, tty);
    report("all streams in one call:", batched, o.streams);

    // The same work one stream per call (first streams only, to keep it short).
    const int alone = std::min(o.streams, 4);
    auto st1 = model.make_state(1);
    Generator gen1(1, d, 2);
    const int steps1 = std::min(o.steps, 128);
    std::vector<double> single;
    for (int i = 0; i < alone; ++i) {
        const auto ms = serve(model, st1, gen1, steps1, false);
        single.insert(single.end(), ms.begin(), ms.end());
    }
    report("one stream per call:", single, 1);

    // Checkpoint every stream, reload, and check that the next step continues exactly.
    std::filesystem::create_directories(o.out);
    const auto path = o.out / "serve_streams.safetensors";
    titans::io::save_checkpoint(path, model, st);
    auto restored = titans::io::load_checkpoint(path, model);
    const titans::Matrixf x = gen.next();
    const titans::Matrixf a = model.forward(st, x), b = model.forward(restored, x);
    const bool same = std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
    std::printf("Checkpoint of all %d streams: %s (%.1f MB); the next step after reloading is %s.\n",
                o.streams, path.string().c_str(),
                static_cast<double>(std::filesystem::file_size(path)) / 1e6,
                same ? "bit-identical" : "DIFFERENT");
    return same ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "05_serve: %s\n", e.what());
    return 1;
}
