// examples/08_generate.cpp: text from a byte-level model, token by token through the decode
// path, and the same continuation from a checkpoint taken mid-stream.
//
//     ./08_generate [--quick] [--model FILE] [--prompt TEXT] [--tokens N] [--temperature T]
//                   [--top-k K] [--top-p P] [--seed S] [--out DIR]
//
// --model FILE: a model saved with titans::io::save_parameters(FILE, model) (vocabulary 256:
// one token per byte, titans/text/byte_tokenizer.hpp); its configuration is read from the file
// (titans::io::load_model). Without it, a small random model is made, saved and loaded back:
// untrained, so expect noise, but every step below runs (CI runs it with --quick, which also
// generates fewer tokens).
//
// The prompt goes through the model in one call; then each step feeds one token and samples
// the next (temperature, top-k, top-p, seed: titans::text::Sampler), and the byte is printed
// as it comes (bytes that are not printable text are shown as \xNN). Printed after: tokens/s
// of the prompt and of the generation. Halfway, the generation (the model's stream state, the
// sampler's state and the pending token) is checkpointed to DIR/generation.safetensors
// (titans::io::save_generation); at the end the model and the checkpoint are loaded again, as a
// restarted program would, and the rest is generated once more: "checkpoint continuation:
// identical" when it repeats the first run byte for byte (the exit status is 1 otherwise).
// DIR: --out (kept), or a fresh directory under the system temp directory (removed).
#include <titans/io/generation.hpp>
#include <titans/io/model_file.hpp>
#include <titans/titans.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Options {
    std::string model;
    std::string prompt = "To be, or not to be, that is the question:\n";
    int tokens = 400;
    titans::text::SamplerConfig sampler{.temperature = 0.8, .top_k = 0, .top_p = 0.95, .seed = 1};
    std::string out;
};

double parse_number(const char* flag, const char* text, double lo, double hi) {
    char* end = nullptr;
    const double v = std::strtod(text, &end);
    if (end == text || *end != '\0' || !(v >= lo && v <= hi)) {
        std::ostringstream why;
        why << flag << " '" << text << "' (expected a number in [" << lo << ", " << hi << "])";
        throw std::invalid_argument(why.str());
    }
    return v;
}

int parse_int(const char* flag, const char* text, int lo, int hi) {
    const double v = parse_number(flag, text, lo, hi);
    if (v != static_cast<int>(v)) {
        throw std::invalid_argument(std::string(flag) + " '" + text + "' (expected an integer)");
    }
    return static_cast<int>(v);
}

Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const bool has_value = i + 1 < argc;
        if (a == "--quick") {
            o.tokens = 48;
        } else if (a == "--help" || a == "-h") {
            std::printf("usage: 08_generate [--quick] [--model FILE] [--prompt TEXT] [--tokens N] "
                        "[--temperature T] [--top-k K] [--top-p P] [--seed S] [--out DIR]\n");
            std::exit(0);
        } else if (a == "--model" && has_value) {
            o.model = argv[++i];
        } else if (a == "--prompt" && has_value) {
            o.prompt = argv[++i];
        } else if (a == "--tokens" && has_value) {
            o.tokens = parse_int("--tokens", argv[++i], 2, 1000000);
        } else if (a == "--temperature" && has_value) {
            o.sampler.temperature = parse_number("--temperature", argv[++i], 0, 1e6);
        } else if (a == "--top-k" && has_value) {
            o.sampler.top_k = parse_int("--top-k", argv[++i], 0, 1 << 26);
        } else if (a == "--top-p" && has_value) {
            o.sampler.top_p = parse_number("--top-p", argv[++i], 0, 1);
        } else if (a == "--seed" && has_value) {
            o.sampler.seed = static_cast<std::uint64_t>(parse_number("--seed", argv[++i], 0, 1e15));
        } else if (a == "--out" && has_value) {
            o.out = argv[++i];
        } else {
            throw std::invalid_argument("unknown or incomplete argument '" + a + "' (try --help)");
        }
    }
    o.sampler.validate();  // ConfigError naming the setting
    return o;
}

/// Prints bytes as they come: printable ASCII, newlines, tabs and complete UTF-8 sequences (a
/// lead byte and its continuation bytes) as they are, anything else as \xNN; the bytes of a
/// sequence not yet complete are held back.
class BytePrinter {
public:
    void put(unsigned char b) {
        if (!held_.empty() && (b & 0xC0) == 0x80) {  // a continuation byte
            held_ += static_cast<char>(b);
            if (held_.size() == want_) flush(true);
            return;
        }
        flush(false);
        if (b >= 0xC2 && b <= 0xF4) {  // the lead byte of a 2-4 byte character
            held_ = std::string(1, static_cast<char>(b));
            want_ = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
        } else if ((b >= 0x20 && b < 0x7F) || b == '\n' || b == '\t') {
            std::fputc(b, stdout);
        } else {
            std::printf("\\x%02X", b);
        }
        std::fflush(stdout);
    }
    /// Prints what is held: as it is if complete, as \xNN otherwise.
    void flush(bool complete) {
        for (const char c : held_) {
            if (complete) {
                std::fputc(c, stdout);
            } else {
                std::printf("\\x%02X", static_cast<unsigned char>(c));
            }
        }
        held_.clear();
        std::fflush(stdout);
    }

private:
    std::string held_;
    std::size_t want_ = 0;
};

/// A small random byte-level model (untrained) saved to `path`.
void save_random_model(const fs::path& path) {
    auto cfg = titans::ModelConfig::uniform(titans::BlockKind::MAC, 1, 64, 4, 2, 32, 256, 16);
    cfg.blocks.push_back(titans::BlockConfig::make(titans::BlockKind::MAG, 64, 4, 2, 64, 16));
    titans::io::save_parameters(path, cfg, titans::ModelParams<float>::random(cfg, 8));
}

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Generates `n` tokens, printing them if `printer` is given; returns them. At step `cut`,
/// checkpoints the generation to `ckpt` (if not empty). `secs` receives the time spent in
/// next_token.
std::string generate(const titans::Model<float>& model, titans::text::Generation<float>& g, int n,
                     BytePrinter* printer, int cut, const fs::path& ckpt, double& secs) {
    std::string out;
    secs = 0;
    for (int i = 0; i < n; ++i) {
        if (i == cut && !ckpt.empty()) titans::io::save_generation(ckpt, model, g);
        const auto t0 = Clock::now();
        const int id = titans::text::next_token(model, g);
        secs += seconds_since(t0);
        out += titans::text::ByteTokenizer::decode(id);
        if (printer != nullptr) printer->put(static_cast<unsigned char>(id));
    }
    if (printer != nullptr) printer->flush(false);
    return out;
}

}  // namespace

int main(int argc, char** argv) try {
    const Options o = parse(argc, argv);
    const bool own_dir = o.out.empty();
    const fs::path dir = own_dir ? fs::temp_directory_path() /
                                       ("titans_08_generate_" +
                                        std::to_string(Clock::now().time_since_epoch().count()))
                                 : fs::path(o.out);
    fs::create_directories(dir);
    fs::path model_path = o.model;
    if (model_path.empty()) {
        model_path = dir / "random_model.safetensors";
        save_random_model(model_path);
        std::printf("No --model given: a random (untrained) model, saved to %s and loaded back.\n",
                    model_path.string().c_str());
    }
    const titans::Model<float> model = titans::io::load_model<float>(model_path);
    if (model.config().vocab_size != titans::text::ByteTokenizer::vocab_size) {
        throw std::invalid_argument(model_path.string() + ": vocab_size " +
                                    std::to_string(model.config().vocab_size) +
                                    ", expected 256 (a byte-level model)");
    }
    const auto& s = o.sampler;
    std::printf("model %s: %zu blocks, d_model %d, %lld parameters; temperature %g, top-k %d, "
                "top-p %g, seed %llu\n\n",
                model_path.string().c_str(), model.config().blocks.size(), model.config().d_model,
                static_cast<long long>(model.config().parameter_count()), s.temperature, s.top_k,
                s.top_p, static_cast<unsigned long long>(s.seed));

    const std::vector<int> prompt = titans::text::ByteTokenizer::encode(o.prompt);
    auto t0 = Clock::now();
    auto g = titans::text::start_generation(model, prompt, o.sampler);
    const double prompt_secs = seconds_since(t0);
    BytePrinter printer;
    for (const int id : prompt) printer.put(static_cast<unsigned char>(id));
    const int cut = o.tokens / 2;
    const fs::path ckpt = dir / "generation.safetensors";
    double secs = 0;
    const std::string text = generate(model, g, o.tokens, &printer, cut, ckpt, secs);
    std::printf("\n\nprompt: %zu tokens in %.3f s (%.0f tokens/s, one call); generated: %d tokens "
                "in %.3f s (%.1f tokens/s, one token per call)\n",
                prompt.size(), prompt_secs, static_cast<double>(prompt.size()) / prompt_secs,
                o.tokens, secs, o.tokens / secs);

    // As a restarted program: the model and the generation checkpointed at token `cut`.
    const titans::Model<float> reloaded = titans::io::load_model<float>(model_path);
    auto resumed = titans::io::load_generation(ckpt, reloaded);
    const std::string rest = generate(reloaded, resumed, o.tokens - cut, nullptr, -1, {}, secs);
    const bool identical = rest == text.substr(static_cast<std::size_t>(cut));
    std::printf("checkpoint after %d tokens: %s (%.1f KiB); checkpoint continuation: %s\n", cut,
                ckpt.string().c_str(), static_cast<double>(fs::file_size(ckpt)) / 1024.0,
                identical ? "identical" : "DIFFERENT");
    if (own_dir) fs::remove_all(dir);
    return identical ? 0 : 1;
} catch (const std::exception& e) {
    std::fprintf(stderr, "08_generate: %s\n", e.what());
    return 1;
}
