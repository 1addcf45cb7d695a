// Hostile streams: the default memory and every block kind stay finite on the inputs real
// streams carry (math §10).
//
// Random parameters, default settings (theta_max 0.01, forget bias -8, max_grad_norm 1), fed in
// pieces of the sizes given (default 1, 64 and 1000 tokens per call) with the state kept
// between pieces, on eight streams:
//
//   random      unit-variance noise                 zeros      all entries 0
//   constant    one vector repeated (padding,       period4    four vectors in turn
//               silence, a stuck sensor)            big        noise x 1e3
//   tiny        noise x 1e-30                       burst      noise x 100 on every other
//   const+rand  constant for 4096 tokens, then noise           256-token stretch
//
// Objects: the headline memory (d 512, 8 heads, depth 2, chunk 64), and at the sizes of
// 02_long_stream (d 64, 4 heads, depth 2, window / segment 128, chunk 64) the memory alone and a
// 2-layer model of each block kind (LMM, MAC, MAG, MAL). For each (object, stream, piece size)
// it prints the largest |output| over the run, or where a NonFiniteError stopped it; the exit
// status is 1 if any run did not finish finite.
//
// Without max_grad_norm (--max-grad-norm 0, the settings before it existed) the headline memory
// diverges on the constant stream within ~300 tokens.
//
// Options:
//   --tokens N          tokens per run of the d 64 objects (default 1,000,000)
//   --headline-tokens N tokens per run of the d 512 memory (default 65,536)
//   --pieces A,B,...    piece sizes (default 1,64,1000)
//   --max-grad-norm C   the memory's clipping threshold (default: the library's, 1)
//   --objects LIST      a subset of: mem512,mem64,LMM,MAC,MAG,MAL (comma-separated)
//   --quick             600 tokens, d 16 models and a d 64 "headline", for CI
// Time: the full default run takes hours on 2 cores; the closing figures were taken with
// pieces of 1000 for 1M tokens and pieces of 1 and 64 for 65,536 tokens.

#include <titans/titans.hpp>

#include <Eigen/Core>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <algorithm>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using titans::BlockKind;
using titans::Matrixf;

struct Settings {
    long tokens = 1'000'000;
    long headline_tokens = 65'536;
    std::vector<long> pieces = {1, 64, 1000};
    double max_grad_norm = titans::MemoryConfig{}.max_grad_norm;
    std::vector<std::string> objects = {"mem512", "mem64", "LMM", "MAC", "MAG", "MAL"};
    bool quick = false;
};

std::vector<std::string> split(const std::string& text) {
    std::vector<std::string> out;
    std::stringstream ss(text);
    for (std::string item; std::getline(ss, item, ',');) {
        if (!item.empty()) out.push_back(item);
    }
    return out;
}

long positive(const std::string& flag, const std::string& text) {
    char* end = nullptr;
    const long v = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || v < 1) {
        throw std::invalid_argument(flag + " needs a positive integer, got '" + text + "'");
    }
    return v;
}

Settings parse(int argc, char** argv) {
    Settings s;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
            return argv[++i];
        };
        if (a == "--quick") {
            s.quick = true;
            s.tokens = s.headline_tokens = 600;
        } else if (a == "--tokens") {
            s.tokens = positive(a, value());
        } else if (a == "--headline-tokens") {
            s.headline_tokens = positive(a, value());
        } else if (a == "--pieces") {
            s.pieces.clear();
            for (const auto& p : split(value())) s.pieces.push_back(positive(a, p));
        } else if (a == "--max-grad-norm") {
            s.max_grad_norm = std::stod(value());
        } else if (a == "--objects") {
            s.objects = split(value());
        } else {
            throw std::invalid_argument("unknown argument '" + a + "' (see the file's header)");
        }
    }
    return s;
}

// ---------------------------------------------------------------------------------------------
// The streams.

const std::vector<std::string> kStreams = {"random", "constant", "zeros",  "period4",
                                           "big",    "tiny",     "burst",  "const+rand"};

/// Token t of a stream, written into row `row` of x. Noise from SplitMix64 (platform-independent).
class StreamSource {
public:
    StreamSource(std::string kind, int d, std::uint64_t seed)
        : kind_(std::move(kind)), fixed_(4, d), state_(seed) {
        for (Eigen::Index i = 0; i < fixed_.size(); ++i) fixed_.data()[i] = noise();
    }
    void next(Matrixf& x) {
        for (Eigen::Index r = 0; r < x.rows(); ++r, ++t_) fill(x, r);
    }

private:
    void fill(Matrixf& x, Eigen::Index r) {
        const bool noisy = kind_ == "random" || kind_ == "big" || kind_ == "tiny" ||
                           kind_ == "burst" || (kind_ == "const+rand" && t_ >= 4096);
        if (noisy) {
            float scale = 1.0f;
            if (kind_ == "big") scale = 1e3f;
            if (kind_ == "tiny") scale = 1e-30f;
            if (kind_ == "burst" && (t_ / 256) % 2 == 1) scale = 100.0f;
            for (Eigen::Index j = 0; j < x.cols(); ++j) x(r, j) = scale * noise();
        } else if (kind_ == "zeros") {
            x.row(r).setZero();
        } else if (kind_ == "period4") {
            x.row(r) = fixed_.row(t_ % 4);
        } else {  // constant, and const+rand before 4096
            x.row(r) = fixed_.row(0);
        }
    }
    float noise() {  // uniform with unit variance
        std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const double u = (static_cast<double>(z >> 11) + 0.5) * 0x1.0p-53;
        return static_cast<float>((2.0 * u - 1.0) * 1.7320508075688772);
    }

    std::string kind_;
    Matrixf fixed_;
    std::uint64_t state_;
    long t_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The objects: one step function per object, over a fresh state.

using Step = std::function<void(const Matrixf&, Matrixf&)>;

struct Object {
    std::string name;
    int d;
    long tokens;
    std::function<Step()> fresh;  // a new state, wrapped in a step
};

Object memory_object(const std::string& name, int d, int heads, int chunk, long tokens,
                     double clip) {
    titans::MemoryConfig cfg{.d_model = d, .n_heads = heads, .depth = 2, .chunk = chunk};
    cfg.max_grad_norm = clip;
    auto mem = std::make_shared<titans::NeuralMemory<float>>(
        cfg, titans::MemoryParams<float>::random(cfg, 42));
    return {name, d, tokens, [mem] {
                auto st = std::make_shared<titans::MemoryState<float>>(mem->make_state(1));
                return Step([mem, st](const Matrixf& x, Matrixf& y) { mem->forward(*st, x, y); });
            }};
}

Object model_object(BlockKind kind, int d, int heads, int span, int chunk, long tokens,
                    double clip) {
    auto cfg = titans::ModelConfig::uniform(kind, 2, d, heads, 2, span, 0, chunk);
    for (auto& b : cfg.blocks) b.memory.max_grad_norm = clip;
    auto model = std::make_shared<titans::Model<float>>(
        cfg, titans::ModelParams<float>::random(cfg, 7));
    return {titans::to_string(kind), d, tokens, [model] {
                auto st = std::make_shared<titans::ModelState<float>>(model->make_state(1));
                return Step([model, st](const Matrixf& x, Matrixf& y) { y = model->forward(*st, x); });
            }};
}

std::vector<Object> make_objects(const Settings& s) {
    const int d = s.quick ? 16 : 64, heads = s.quick ? 2 : 4, span = s.quick ? 16 : 128;
    const int chunk = s.quick ? 8 : 64;
    std::vector<Object> out;
    for (const std::string& o : s.objects) {
        if (o == "mem512") {
            out.push_back(s.quick ? memory_object("mem64h", 64, 8, 64, s.headline_tokens, s.max_grad_norm)
                                  : memory_object("mem512", 512, 8, 64, s.headline_tokens,
                                                  s.max_grad_norm));
        } else if (o == "mem64") {
            out.push_back(memory_object("mem" + std::to_string(d), d, heads, chunk, s.tokens,
                                        s.max_grad_norm));
        } else {
            BlockKind kind{};
            if (!titans::from_string(o, kind)) {
                throw std::invalid_argument("unknown object '" + o + "'");
            }
            out.push_back(model_object(kind, d, heads, span, chunk, s.tokens, s.max_grad_norm));
        }
    }
    return out;
}

/// Feeds `tokens` tokens of `stream` to a fresh state of `obj` in pieces of `piece`; returns the
/// table cell: the largest |output|, or where it stopped.
std::string run(const Object& obj, const std::string& stream, long piece, bool* ok) {
    StreamSource src(stream, obj.d, 1234);
    Step step = obj.fresh();
    Matrixf x, y;
    double peak = 0;
    for (long t = 0; t < obj.tokens; t += piece) {
        x.resize(std::min(piece, obj.tokens - t), obj.d);
        src.next(x);
        try {
            step(x, y);
        } catch (const titans::NonFiniteError& e) {
            *ok = false;
            std::fprintf(stderr, "  %s / %s / piece %ld: %s\n", obj.name.c_str(), stream.c_str(),
                         piece, e.what());
            return "NaN@" + std::to_string(t);
        }
        if (!y.allFinite()) {  // never: forward throws first
            *ok = false;
            return "nonfinite!";
        }
        peak = std::max(peak, static_cast<double>(y.cwiseAbs().maxCoeff()));
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g", peak);
    return buf;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Settings s = parse(argc, argv);
        const auto objects = make_objects(s);
        std::printf("Hostile streams (math §10): largest |output| per run, max_grad_norm = %g\n",
                    s.max_grad_norm);
        std::printf("%-8s %7s %8s", "object", "piece", "tokens");
        for (const auto& st : kStreams) std::printf(" %10s", st.c_str());
        std::printf("  seconds\n");
        bool ok = true;
        for (const Object& obj : objects) {
            for (long piece : s.pieces) {
                const auto t0 = std::chrono::steady_clock::now();
                std::printf("%-8s %7ld %8ld", obj.name.c_str(), piece, obj.tokens);
                std::fflush(stdout);
                for (const auto& st : kStreams) {
                    std::printf(" %10s", run(obj, st, piece, &ok).c_str());
                    std::fflush(stdout);
                }
                const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
                std::printf("  %.1f\n", dt.count());
            }
        }
        std::printf(ok ? "Every run stayed finite.\n"
                       : "Some runs stopped with a NonFiniteError (see above).\n");
        return ok ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "04_hostile_streams: %s\n", e.what());
        return 2;
    }
}
