// bench/bench_blocks.cpp: streaming throughput of the four Titans blocks (math §7) against
// full causal attention over the same stream, on the CPU backend.
//
//   BM_Gemm                      float 512 x 512 x 512 row-major GEMM, C.noalias() = A * B:
//                                the reference rate of this machine on dense products.
//   BM_Block/<kind>              one Block<float> of kind LMM, MAC, MAG, MAL or SWA (pre-norm,
//                                residual, SwiGLU FFN), streamed over N tokens.
//   BM_FullAttention             the same Attention layer as the blocks use, with window = N:
//                                exact causal softmax attention over the whole stream
//                                (quadratic in N), streamed the same way.
//   BM_FullAttentionBlock        a plain pre-norm Transformer block around it,
//                                x + Attn(RMSNorm(x)), then + FFN(RMSNorm(.)) with the blocks'
//                                FFN: what a Titans block replaces, like for like.
//
// Configuration: float, d = 512, H = 8 (d_h = 64) for memory and attention, memory depth
// L = 2 (expansion 4), memory chunk b = 64, window (MAG, MAL) = segment (MAC) = 512,
// N_p = 4 persistent tokens, B = 1, no RoPE. The full-attention baselines have no persistent
// tokens (no prefix).
//
// Timing: one iteration streams N tokens from a fresh state (a copy of a state made once,
// restored with the timer paused) in pieces of `piece` tokens, keeping the state across the
// pieces, exactly as a long stream is consumed. N runs over 1K, 4K, 16K, 64K, 256K for the
// blocks (a block's cost per token is constant: work linear in N, state of fixed size; add 1M
// with --max_tokens=1048576, 2-6 minutes per kind on 2 cores) and over 1K, 2K, ..., 32K for
// full attention (its cost per token grows with N). Pieces of 1024 tokens, plus pieces of 512
// at N = 16K. The inputs cycle through 8 random pieces made once, so a 1M-token stream needs
// no 2 GB input. N >= 64K runs one iteration.
// Everything is wall-clock time (UseRealTime): OpenMP runs the heads on several threads. On a
// shared machine whose cores are busy, run with OMP_NUM_THREADS=1: with 2 threads there every
// benchmark ran 3-6x slower than with one (each parallel region waits for a descheduled
// thread), and far less steadily.
//
// Counters:
//   tokens_per_second   N tokens per iteration (B = 1), per second of wall-clock time
//   us_per_token        wall-clock microseconds per token, its inverse
//   mean_abs_output     mean |y| over the last piece of the stream
//   memory_weight_rms   RMS of the memory weights (all heads and layers) at the end of the
//                       stream (blocks only): whether the memory decayed towards 0 or grew
// A NaN or infinite output in any piece fails the benchmark (SkipWithError).
//
// Ratios across benchmarks (where full attention falls below a block, fraction of BM_Gemm)
// are not counters: one benchmark cannot see another's result. Compute them from the JSON of
// ONE run (--benchmark_format=json --benchmark_out=FILE), so both sides saw the same load.
//
// Parameters: BlockParams<float>::random(cfg, 1) with two memory settings changed, as in
// bench_memory.cpp:
//   theta_max = 0.01   With the default 0.1 and chunk 64, every block's output is NaN within
//                      its first 1024 tokens (the chunked write takes b gradient steps from the
//                      chunk-start weights; 0.03 still diverges within 32K tokens here).
//   b_alpha = -8       forget gate alpha ~ 3e-4 instead of random()'s -5 (alpha ~ 7e-3). With
//                      -5 the untrained memory's writes barely keep up with forgetting: its
//                      weights fall from RMS ~0.1 to ~0.003 (and to 0 in smaller models), so
//                      the memory path would be a near no-op. With -8 they settle near 0.03
//                      (LMM, MAG, MAL); MAC's memory, written with the attention output,
//                      still decays (to ~0.001 at 256K tokens) but stays finite.
// The counters memory_weight_rms and mean_abs_output show where a run ended up.

#include <benchmark/benchmark.h>

#include <titans/titans.hpp>

#include "bench_common.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace {

using titans::BlockKind;
using titans::Matrixf;

constexpr int kD = 512;        // d_model
constexpr int kHeads = 8;      // H, memory and attention
constexpr int kDepth = 2;      // memory MLP depth L
constexpr int kSpan = 512;     // window (MAG, MAL) = segment (MAC)
constexpr int kChunk = 64;     // memory chunk b
constexpr int kPoolSize = 8;   // distinct input pieces the stream cycles through
// Memory learning-rate cap and forget-gate bias (see the header comment); override with
// -DTITANS_BENCH_THETA_MAX=... / -DTITANS_BENCH_FORGET_BIAS=... to compare.
#ifndef TITANS_BENCH_THETA_MAX
#define TITANS_BENCH_THETA_MAX 0.01
#endif
#ifndef TITANS_BENCH_FORGET_BIAS
#define TITANS_BENCH_FORGET_BIAS -8.0f
#endif
constexpr double kThetaMax = TITANS_BENCH_THETA_MAX;
constexpr float kForgetBias = TITANS_BENCH_FORGET_BIAS;

titans::BlockConfig block_config(BlockKind kind) {
    titans::BlockConfig cfg = titans::BlockConfig::make(kind, kD, kHeads, kDepth, kSpan, kChunk);
    cfg.memory.theta_max = kThetaMax;
    return cfg;
}

titans::BlockParams<float> block_params(const titans::BlockConfig& cfg) {
    auto p = titans::BlockParams<float>::random(cfg, 1);
    p.memory.b_alpha.setConstant(kForgetBias);
    return p;
}

std::vector<Matrixf> input_pool(Eigen::Index piece) {
    std::vector<Matrixf> pool;
    for (int i = 0; i < kPoolSize; ++i) {
        pool.push_back(Matrixf::Random(piece, kD));
    }
    return pool;
}

// Streams `tokens` tokens through `step` (a callable Matrixf -> Matrixf that advances its own
// state) in pieces of `piece`; the last piece may be shorter. Returns false if an output was
// not finite; `last` receives the last output.
template <class Step>
bool stream(Step&& step, const std::vector<Matrixf>& pool, long tokens, Eigen::Index piece,
            Matrixf& last) {
    bool finite = true;
    long done = 0;
    for (std::size_t i = 0; done < tokens; ++i) {
        const Matrixf& x = pool[i % pool.size()];
        const Eigen::Index n = std::min<Eigen::Index>(piece, tokens - done);
        last = n == piece ? step(x) : step(Matrixf(x.topRows(n)));
        finite = finite && titans::detail::all_finite(last);
        done += n;
    }
    return finite;
}

// `seconds`: the streaming time of all iterations, measured like the timed region.
void set_rate_counters(benchmark::State& state, long tokens, double seconds) {
    const double t = static_cast<double>(state.iterations()) * static_cast<double>(tokens);
    state.counters["tokens_per_second"] = benchmark::Counter(t, benchmark::Counter::kIsRate);
    state.counters["us_per_token"] = benchmark::Counter(seconds * 1e6 / t);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The timed loop shared by every streaming benchmark: each iteration restores `st` from
// `fresh` (untimed), then streams `tokens` tokens through `step` in pieces of `piece`.
// Skips the benchmark with `what` if an output is not finite or a layer throws; otherwise
// sets the rate counters and mean_abs_output and returns true.
template <class State, class Step>
bool time_stream(benchmark::State& state, State& st, const State& fresh, Step&& step,
                 const char* what) {
    const Eigen::Index piece = state.range(0);
    const long tokens = static_cast<long>(state.range(1));
    const std::vector<Matrixf> pool = input_pool(piece);
    Matrixf y;
    bool finite = true;
    double seconds = 0.0;
    try {
        for (auto _ : state) {
            state.PauseTiming();
            st = fresh;
            state.ResumeTiming();
            const auto t0 = std::chrono::steady_clock::now();
            finite = stream(step, pool, tokens, piece, y) && finite;
            benchmark::DoNotOptimize(y.data());
            benchmark::ClobberMemory();
            seconds += seconds_since(t0);
        }
    } catch (const titans::Error& e) {  // a layer met a NaN from a diverged state
        state.SkipWithError(e.what());
        return false;
    }
    if (!finite) {
        state.SkipWithError(what);
        return false;
    }
    set_rate_counters(state, tokens, seconds);
    state.counters["mean_abs_output"] = benchmark::Counter(y.array().abs().mean());
    return true;
}

void BM_Block(benchmark::State& state, BlockKind kind) {
    const titans::BlockConfig cfg = block_config(kind);
    const titans::Block<float> block(cfg, block_params(cfg));
    const auto fresh = block.make_state(1);
    auto st = fresh;
    if (!time_stream(state, st, fresh, [&](const Matrixf& x) { return block.forward(st, x); },
                     "non-finite block output (state diverged)")) {
        return;
    }
    if (!titans::has_memory(kind)) return;  // SWA: no memory weights to report
    double sq = 0.0, count = 0.0;
    for (int h = 0; h < kHeads; ++h) {
        for (const Matrixf& w : block.memory().current_weights(st.memory(), 0, h)) {
            sq += static_cast<double>(w.squaredNorm());
            count += static_cast<double>(w.size());
        }
    }
    state.counters["memory_weight_rms"] = benchmark::Counter(std::sqrt(sq / count));
}

titans::AttentionConfig full_attention_config(long tokens) {
    titans::AttentionConfig a = block_config(BlockKind::MAG).attention;
    a.window = static_cast<int>(tokens);  // every query sees the whole stream so far
    return a;
}

void BM_FullAttention(benchmark::State& state) {
    const titans::AttentionConfig cfg = full_attention_config(static_cast<long>(state.range(1)));
    const titans::Attention<float> attn(cfg, titans::AttentionParams<float>::random(cfg, 2));
    const auto fresh = attn.make_state(1);
    auto st = fresh;
    time_stream(state, st, fresh, [&](const Matrixf& x) { return attn.forward(st, x); },
                "non-finite attention output");
}

void BM_FullAttentionBlock(benchmark::State& state) {
    const titans::AttentionConfig cfg = full_attention_config(static_cast<long>(state.range(1)));
    const titans::Attention<float> attn(cfg, titans::AttentionParams<float>::random(cfg, 2));
    const titans::FeedForwardConfig fcfg = block_config(BlockKind::MAG).ffn;
    const titans::FeedForward<float> ffn(fcfg, titans::FeedForwardParams<float>::random(fcfg, 3));
    const titans::RMSNorm<float> norm_mix(kD), norm_ffn(kD);
    const auto fresh = attn.make_state(1);
    auto st = fresh;
    auto step = [&](const Matrixf& x) {
        Matrixf h = x + attn.forward(st, norm_mix.forward(x));
        h += ffn.forward(norm_ffn.forward(h));
        return h;
    };
    time_stream(state, st, fresh, step, "non-finite attention block output");
}


// Streams of N >= kLongStream tokens run one iteration: at ~10^4 tokens/s that is already
// seconds to minutes.
constexpr long kLongStream = 64 * 1024;

// Default longest streams. 1M tokens takes 2-5 minutes per block kind on the 2-core machine
// this was written on (~4-8K tokens/s single-threaded), so the default sweep stops at 256K;
// --max_tokens=1048576 runs the full 1K..1M sweep. Full attention's cost per token grows with
// N: 32K is ~20 s there.
constexpr long kDefaultMaxTokens = 256 * 1024;
constexpr long kDefaultMaxAttentionTokens = 32 * 1024;

// Removes "--<name>=<value>" from argv (before Google Benchmark sees it) and returns the value.
long take_flag(int& argc, char** argv, const std::string& name, long fallback) {
    const std::string prefix = "--" + name + "=";
    long value = fallback;
    int out = 1;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a.rfind(prefix, 0) == 0) {
            value = std::strtol(a.c_str() + prefix.size(), nullptr, 10);
        } else {
            argv[out++] = argv[i];
        }
    }
    argc = out;
    return value;
}

std::vector<long> lengths(long first, long factor, long last) {
    std::vector<long> n;
    for (long v = first; v <= last; v *= factor) {
        n.push_back(v);
    }
    return n;
}

// Google Benchmark picks the iteration count per benchmark family, not per argument, so
// short and long streams are registered separately (the long ones with Iterations(1)).
template <class Fn>
void register_stream(const std::string& name, Fn fn, const std::vector<long>& lengths) {
    std::vector<long> shorter, longer;
    for (long n : lengths) {
        (n < kLongStream ? shorter : longer).push_back(n);
    }
    auto* s = benchmark::RegisterBenchmark(name.c_str(), fn);
    s->ArgNames({"piece", "N"});
    for (long n : shorter) {
        s->Args({1024, n});
    }
    if (std::find(lengths.begin(), lengths.end(), 16 * 1024) != lengths.end()) {
        s->Args({512, 16 * 1024});  // piece size: 512 against 1024 at one length
    }
    s->Unit(benchmark::kMillisecond)->UseRealTime();
    if (!longer.empty()) {
        auto* l = benchmark::RegisterBenchmark(name.c_str(), fn);
        l->ArgNames({"piece", "N"});
        for (long n : longer) {
            l->Args({1024, n});
        }
        l->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();
    }
}

}  // namespace

// Extra flags (besides Google Benchmark's):
//   --max_tokens=N            longest block stream (1K, 4K, 16K, ... up to N; default 256K)
//   --max_attention_tokens=N  longest full-attention stream (1K, 2K, 4K, ... ; default 32K)
int main(int argc, char** argv) {
    const long max_tokens = take_flag(argc, argv, "max_tokens", kDefaultMaxTokens);
    const long max_attention = take_flag(argc, argv, "max_attention_tokens",
                                         kDefaultMaxAttentionTokens);

    benchmark::RegisterBenchmark("BM_Gemm", titans_bench::BM_Gemm)
        ->Arg(512)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (BlockKind kind : titans::all_block_kinds) {
        register_stream(std::string("BM_Block/") + titans::to_string(kind),
                        [kind](benchmark::State& s) { BM_Block(s, kind); },
                        lengths(1024, 4, max_tokens));
    }
    register_stream("BM_FullAttention", BM_FullAttention, lengths(1024, 2, max_attention));
    register_stream("BM_FullAttentionBlock", BM_FullAttentionBlock,
                    lengths(1024, 2, max_attention));

    return titans_bench::run(argc, argv);
}
