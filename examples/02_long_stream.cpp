// Long streams: a Titans model reads any number of tokens in constant memory (math §7).
//
// A small model of each variant (LMM, MAC, MAG, MAL: 2 layers, d = 64, 4 heads, memory depth
// 2, window / segment 128, memory chunk 64, vectors in and out) reads one long stream (1M
// tokens by default, --tokens N for another length) in pieces of 1024 tokens, keeping its
// state between pieces. The tokens are random vectors made piece by piece; the whole sequence
// never exists in memory. What the state holds does not grow with the stream: the memory's
// weights and momentum, a conv tail, the attention's last w - 1 keys/values (MAG, MAL) or the
// current segment (MAC). So
//
//   time     grows linearly in N: every 10% of the stream takes about as long as the last
//   memory   stays flat: resident memory (VmRSS from /proc/self/status) at 10% = at 100%.
//
// Each variant prints a progress line every ~10% (tokens so far, tokens/s over the last 10%
// and overall, VmRSS), the mean |output| of its last piece (finite: the stream did not
// diverge), and a summary table ends the run. Times are of Model::forward only (making the
// random inputs is not counted).
//
// Options:
//   --tokens N   tokens per variant (default 1,000,000, see below)
//   --piece N    tokens per forward call (default 1024)
//   --quick      600 tokens through a tiny model (d = 16, 2 heads, span 16, chunk 8) in
//                pieces of 100, for CI (~0.1 s single-threaded in Release, ~1.5 s under ASan)
//   --help       this text
//
// Time: on the shared 2-core machine this was written on, 1M tokens x 4 variants took under 2
// minutes single-threaded (OMP_NUM_THREADS=1), but over 20 minutes with 2 OpenMP threads while
// other jobs kept the cores busy: the parallel regions of a d = 64 model are short, and each
// waits for whichever thread the busy machine has descheduled. On such a machine run it with
// OMP_NUM_THREADS=1, or pass a smaller --tokens.
//
// Parameters: ModelParams<float>::random, with the memory's theta_max = 0.01 and forget-gate
// bias b_alpha = -8 (alpha ~ 3e-4) in every layer (set explicitly; they are also the library's
// defaults). A larger theta_max diverges at chunk 64 (a larger chunk takes a larger step from
// stale weights; math §10), and a stronger forget bias lets some memories decay to zero.

#include <titans/titans.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using titans::BlockKind;
using titans::Matrixf;

constexpr const char* kHelp =
    "Usage: 02_long_stream [--tokens N] [--piece N] [--quick] [--help]\n"
    "\n"
    "Streams N random 64-wide vectors through a 2-layer Titans model of each variant (LMM,\n"
    "MAC, MAG, MAL; d = 64, 4 heads, memory depth 2, span 128), in pieces of --piece tokens\n"
    "(default 1024), and shows that time grows linearly with N while resident memory stays\n"
    "flat.\n"
    "\n"
    "  --tokens N  tokens per variant, default 1,000,000 (~2 minutes for all four variants\n"
    "              single-threaded on a 2-core machine; on a busy machine OMP_NUM_THREADS=1\n"
    "              is much faster than 2 threads)\n"
    "  --piece N   tokens per forward call, default 1024\n"
    "  --quick     600 tokens through a tiny model (d = 16, 2 heads, span 16) in pieces of\n"
    "              100 (for CI)\n";

struct Settings {
    long tokens = 1'000'000;
    long piece = 1024;
    bool quick = false;
    int d = 64, heads = 4, depth = 2, span = 128, chunk = 64, layers = 2;
};

long parse_count(const std::string& flag, const char* text) {
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (end == text || *end != '\0' || v < 1) {
        throw std::invalid_argument(flag + " needs a positive integer, got '" + text + "'");
    }
    return v;
}

Settings parse(int argc, char** argv) {
    Settings s;
    long tokens = -1, piece = -1;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&](const std::string& flag) -> const char* {
            if (a == flag) {
                if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
                return argv[++i];
            }
            return a.c_str() + flag.size() + 1;  // --flag=value
        };
        if (a == "--quick") {
            s.quick = true;
        } else if (a == "--help" || a == "-h") {
            std::fputs(kHelp, stdout);
            std::exit(0);
        } else if (a == "--tokens" || a.rfind("--tokens=", 0) == 0) {
            tokens = parse_count("--tokens", value("--tokens"));
        } else if (a == "--piece" || a.rfind("--piece=", 0) == 0) {
            piece = parse_count("--piece", value("--piece"));
        } else {
            throw std::invalid_argument("unknown argument '" + a +
                                        "' (expected --tokens N, --piece N, --quick, --help)");
        }
    }
    if (s.quick) {
        s.tokens = 600;
        s.piece = 100;
        s.d = 16;
        s.heads = 2;
        s.span = 16;
        s.chunk = 8;
    }
    if (tokens > 0) s.tokens = tokens;
    if (piece > 0) s.piece = piece;
    return s;
}

// ---------------------------------------------------------------------------------------------
// Inputs and measurements.

/// Random tokens, piece by piece: entries uniform in [-sqrt(3), sqrt(3)] (unit variance) from
/// SplitMix64, identical on every platform.
class TokenSource {
public:
    explicit TokenSource(std::uint64_t seed) : state_(seed) {}
    void next_piece(Matrixf& x) {
        for (Eigen::Index i = 0; i < x.size(); ++i) {
            const double u = (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53;  // (0, 1)
            x.data()[i] = static_cast<float>((2.0 * u - 1.0) * 1.7320508075688772);
        }
    }

private:
    std::uint64_t next() {
        std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
    std::uint64_t state_;
};

/// Resident memory of this process in MiB (VmRSS of /proc/self/status), -1 if unavailable.
double rss_mib() {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line)) {
        if (line.rfind("VmRSS:", 0) == 0) {
            return std::strtod(line.c_str() + 6, nullptr) / 1024.0;  // the value is in kB
        }
    }
    return -1.0;
}

std::string mib(double v) {
    char buf[32];
    if (v < 0) return "n/a";
    std::snprintf(buf, sizeof buf, "%.1f MiB", v);
    return buf;
}

std::string grouped(double v) {  // 1234567 -> "1,234,567"
    if (!std::isfinite(v)) return "-";
    std::string digits = std::to_string(static_cast<long long>(std::llround(v)));
    std::string out;
    const int n = static_cast<int>(digits.size());
    for (int i = 0; i < n; ++i) {
        out += digits[static_cast<std::size_t>(i)];
        if (i < n - 1 && (n - 1 - i) % 3 == 0) out += ',';
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// One variant.

struct Result {
    BlockKind kind = BlockKind::LMM;
    double seconds = 0;             // Model::forward time over the whole stream
    double first_half = 0, second_half = 0;  // ... over tokens [0, N/2) and [N/2, N)
    double rss_10 = -1, rss_100 = -1;
    double mean_abs_last = 0;
    bool finite = true;
};

titans::ModelConfig model_config(BlockKind kind, const Settings& s) {
    auto cfg = titans::ModelConfig::uniform(kind, s.layers, s.d, s.heads, s.depth, s.span,
                                            /*vocab=*/0, s.chunk);
    for (auto& b : cfg.blocks) {
        b.memory.theta_max = 0.01;  // see the header comment
    }
    return cfg;
}

Result run_variant(BlockKind kind, const Settings& s) {
    const titans::ModelConfig cfg = model_config(kind, s);
    auto params = titans::ModelParams<float>::random(cfg, 1);
    for (auto& b : params.blocks) {
        b.memory.b_alpha.setConstant(-8.0f);  // see the header comment
    }
    const titans::Model<float> model(cfg, std::move(params));
    auto state = model.make_state(1);
    TokenSource source(0x5eed + static_cast<std::uint64_t>(kind));

    std::printf("\n== %s: %zu layers, d = %d, %d heads, memory depth %d, %s %d, chunk %d ==\n",
                titans::to_string(kind), cfg.blocks.size(), s.d, s.heads, s.depth,
                kind == BlockKind::MAC ? "segment" : "window", s.span, s.chunk);
    std::printf("%12s %10s %14s %14s %12s\n", "tokens", "seconds", "tokens/s last", "tokens/s all",
                "VmRSS");

    Result r;
    r.kind = kind;
    Matrixf x(s.piece, s.d), y;
    long done = 0;
    int next_mark = 1;  // progress at next_mark * 10% of the stream
    double mark_seconds = 0;
    long mark_tokens = 0;
    while (done < s.tokens) {
        const long n = std::min(s.piece, s.tokens - done);
        if (x.rows() != n) x.resize(n, s.d);
        source.next_piece(x);
        const auto t0 = std::chrono::steady_clock::now();
        try {
            y = model.forward(state, x);
        } catch (const titans::NonFiniteError& e) {  // a layer met a NaN the memory produced
            r.finite = false;
            std::printf("diverged in the piece ending at token %ld: %s\n", done + n, e.what());
            break;
        }
        const double dt =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        r.seconds += dt;
        (done < s.tokens / 2 ? r.first_half : r.second_half) += dt;
        done += n;
        if (!y.allFinite()) {
            r.finite = false;
            std::printf("non-finite output in the piece ending at token %ld\n", done);
            break;
        }
        if (done * 10 >= next_mark * s.tokens) {
            const double rss = rss_mib();
            if (next_mark == 1) r.rss_10 = rss;
            const double rate_last =
                static_cast<double>(done - mark_tokens) / (r.seconds - mark_seconds);
            std::printf("%12s %10.2f %14s %14s %12s\n",
                        grouped(static_cast<double>(done)).c_str(), r.seconds,
                        grouped(rate_last).c_str(),
                        grouped(static_cast<double>(done) / r.seconds).c_str(), mib(rss).c_str());
            std::fflush(stdout);  // progress shows up even when stdout is a file or a pipe
            mark_seconds = r.seconds;
            mark_tokens = done;
            while (done * 10 >= next_mark * s.tokens) ++next_mark;
        }
    }
    r.rss_100 = rss_mib();
    r.mean_abs_last = y.size() > 0 ? y.array().abs().mean() : NAN;
    r.finite = r.finite && std::isfinite(r.mean_abs_last);
    std::printf("mean |output| of the last piece: %.4f (%s)\n", r.mean_abs_last,
                r.finite ? "finite" : "NOT FINITE");
    return r;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Settings s = parse(argc, argv);
        std::printf("Streaming %s tokens per variant in pieces of %ld (threads: %d)%s\n",
                    grouped(static_cast<double>(s.tokens)).c_str(), s.piece, Eigen::nbThreads(),
                    s.quick ? ", --quick: tiny model" : "");
        std::vector<Result> results;
        for (BlockKind kind : {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL}) {
            results.push_back(run_variant(kind, s));
        }

        std::printf("\nSummary (%s tokens each; time of Model::forward)\n",
                    grouped(static_cast<double>(s.tokens)).c_str());
        std::printf("%-8s %10s %12s %16s %12s %12s %12s\n", "variant", "seconds", "tokens/s",
                    "2nd/1st half", "RSS at 10%", "RSS at 100%", "mean|out|");
        bool ok = true;
        for (const Result& r : results) {
            ok = ok && r.finite;
            std::printf("%-8s %10.2f %12s %16.2f %12s %12s %12.4f%s\n", titans::to_string(r.kind),
                        r.seconds, grouped(static_cast<double>(s.tokens) / r.seconds).c_str(),
                        r.first_half > 0 ? r.second_half / r.first_half : 0.0,
                        mib(r.rss_10).c_str(), mib(r.rss_100).c_str(), r.mean_abs_last,
                        r.finite ? "" : "  NOT FINITE");
        }
        std::printf("2nd/1st half: time of the second half of the stream over the first "
                    "(1.00 = linear in N).\n");
        return ok ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "02_long_stream: %s\n", e.what());
        return 1;
    }
}
