// bench/cuda/bench_cuda.cu: the neural memory on the CUDA backend (float), read against the
// same run's cuBLAS rates.
//
//   BM_CublasSgemm/n/tf32     n x n x n SGEMM, TF32 tensor cores off (0) or on (1): the GPU's
//                             dense-product rate in this run
//   BM_CudaRowsProduct/m/k/n/rows
//                             C = A B, A m x k, B k x n (a decoded token's product: the decode
//                             model's output projections, [q k v], [W1 | W3], W2), 20 back to
//                             back, on cuBLAS (rows 0) or in rows_product_kernel (1); counters
//                             us_per_product, GBps and frac_copy (of a 256 MB device copy's
//                             rate in this run)
//   BM_CudaChecks/rows/cols/flat
//                             the non-finite check (flag_rows_kernel) over rows x cols floats,
//                             20 back to back: rows end to end (flat 1, a warp per 512
//                             entries) or padded by one (0, a warp per row); us_per_check,
//                             GBps, frac_copy
//   BM_CudaMemory/B/N/tf32/fused
//                             the headline memory (d 512, H 8, d_h 64, L 2, e 4, b 64, lagged,
//                             data-dependent gates, conv) over B sequences of N tokens, device
//                             input and output (the kernel seam, no host copies), each call
//                             timed alone (manual time: the state reset is outside it); TF32
//                             allowed (1) or not (0); full chunks in the fused kernel
//                             (memory_fused.cuh, 1; 2 with its products on bfloat16 operands,
//                             FusedOperands::BF16; 3 as clusters of blocks a pair, W and S in
//                             shared memory, memory_cluster.cuh) or as batched cuBLAS
//                             products (0);
//                             counters tokens_per_second, GFLOPS (bench/memory_flops.hpp),
//                             frac_sgemm and frac_tf32 (GFLOPS over BM_CublasSgemm/4096's)
//   BM_CudaMemoryTrain/B/N/fbwd/cl
//                             the same memory's training step: training forward with its trace
//                             and backward, device x, dy and dx, gradients to the host, TF32;
//                             the backward's full chunks in the fused kernel (fbwd 1,
//                             memory_fused_backward.cuh; 2 with both passes' fused products
//                             on bfloat16 operands, FusedOperands::BF16) or the sweep's
//                             stages (0); the training forward's full chunks as clusters
//                             (cl 1: set_fused_cluster(-1), memory_cluster.cuh) or one block
//                             a pair (0);
//                             GFLOPS and the fractions count memory_training_flops (3x the
//                             forward's)
//   BM_CudaDecode/B/decode/rows
//                             the same memory fed one token per sequence per call (serving);
//                             decode 1: the read and the key pass in decode_rows_kernel
//                             (memory_decode.cuh), 0: as batched cuBLAS products; rows 1: the
//                             products of <= 8 rows in rows_product_kernel (rows_product.cuh);
//                             cluster 2, 4, 8: the decode kernel as clusters of that many
//                             blocks a pair (set_decode_cluster), 0: a block a pair
//   BM_CudaBlock/kind/B/N     one Block<float, Cuda> of each kind, SWA (4) too (d 512, H 8,
//                             L 2, window = segment 512, b 64, SwiGLU FFN, 4 persistent
//                             tokens; SWA none) over B
//                             sequences of N tokens in one call, host input and output (the
//                             public API); MAC's segment attention in tiles (docs/cuda.md)
//   BM_CudaModel/B/N          a 4-block model (MAC, MAG, MAL, LMM) of those blocks, the same way
//   BM_CudaAttention/B/N/path
//                             the attention layer (d 512, H 8, d_h 64, window 512, RoPE) over B
//                             sequences of N tokens from a fresh state, device input and output;
//                             its attention a thread per (row, head) (path 0), in scalar tiles
//                             (attention_tiled.cuh, 1), in warp tiles (attention_warp_tiles.cuh)
//                             with FMAs (2) or TF32 (3, the projections TF32 too); counters
//                             tokens_per_second, GFLOPS (projections and the attention's two
//                             products over the keys each query sees), frac_sgemm and frac_tf32
//                             (of BM_CublasSgemm/4096's)
//   BM_CudaAttentionTiles/B/N/path/backward
//                             the attention kernels alone (d_h 64, H 8, window 512), forward or
//                             the backward's passes, paths 1-3 as above; GFLOPS (2 products
//                             forward, 5 backward) and frac_tf32 (of BM_CublasSgemm/4096/1's)
//   BM_CudaDecodeAttention/B/split
//                             a decoded token's attention kernel alone (d_h 64, H 8, a full
//                             window of 512): the scalar tiles' one-query launch (split 0) or
//                             decode_split_kernel (1); us_per_call, GBps, frac_copy
//   BM_CudaTrainStep/mac/B/N  a Trainer step of that model with a vocabulary of 512 (mac 0: its
//                             MAC block an LMM one, so that nothing runs on the host)
//   BM_CudaMacLayer/B/N/train a one-block MAC model (that block, an embedding and a head,
//                             vocabulary 512; titans-pytorch's MAC transformer of depth 1 in
//                             size): a forward on token ids (train 0) or a Trainer step (1), TF32
//   BM_CudaModelDecode/B/pooled/graphs/ffn/opt
//                             that model with the LMM block for MAC fed one token per sequence
//                             per call (host vectors in and out: serving), its device buffers
//                             from the stream-ordered pool (1, the default) or from cudaMalloc /
//                             cudaFree (0, DeviceMemory::Direct), its work launched (graphs 0)
//                             or as CUDA graphs (1: set_call_graphs, call_graph.cuh; counters
//                             graph_launches_per_call, graph_updates_per_call), its
//                             feed-forwards of B <= 16 rows on cuBLAS (ffn 0) or in one launch
//                             (1: set_fused_feed_forward); opt 1: its products of <= 8 rows in
//                             rows_product_kernel (set_rows_product), 2: its attention's keys
//                             split across blocks (set_split_decode), 3: both, 0: neither;
//                             real time per call. B at most
//                             256: the state of B = 1024 sequences (29.4 GB in float) is over
//                             the 16 GiB state limit (limits.hpp), and make_state refuses it
//
// Run: build/.../bench_cuda --benchmark_counters_tabular=true (tools/gpu_check.sh does).

#include <benchmark/benchmark.h>

#include <titans/titans.hpp>
#include <titans/backend/cuda/cuda.cuh>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "../memory_flops.hpp"

namespace {

using titans::backend::Cuda;
namespace tc = titans::backend::cuda;
using Kernels = titans::backend::MemoryKernels<Cuda, float>;
using Transfer = titans::backend::Transfer<Cuda, float>;

/// SGEMM GFLOPS at n (cached per (n, tf32)): 3 warm-ups, then 10 timed products.
double sgemm_rate(int n, bool tf32) {
    static std::map<std::pair<int, bool>, double> cache;
    const auto key = std::make_pair(n, tf32);
    if (auto it = cache.find(key); it != cache.end()) {
        return it->second;
    }
    tc::set_allow_tf32(tf32);
    const tc::StreamContext cx;
    tc::set_allow_tf32(false);
    const auto nn = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
    const titans::Matrixf host = titans::Matrixf::Random(n, n);  // never time on zeros
    tc::DeviceBuffer<float> a = tc::upload_array(host.data(), nn), b = a, c(nn);
    auto product = [&] {
        tc::gemm<float>(cx.blas(), false, false, n, n, n, 1.0f, {a.data(), n}, {b.data(), n},
                        0.0f, c.data(), n, 0, 1);
    };
    for (int i = 0; i < 3; ++i) {
        product();
    }
    cx.synchronize();
    cudaEvent_t t0, t1;
    tc::check(cudaEventCreate(&t0), "event");
    tc::check(cudaEventCreate(&t1), "event");
    tc::check(cudaEventRecord(t0, cx.stream()), "event");
    for (int i = 0; i < 10; ++i) {
        product();
    }
    tc::check(cudaEventRecord(t1, cx.stream()), "event");
    tc::check(cudaEventSynchronize(t1), "event");
    float ms = 0;
    tc::check(cudaEventElapsedTime(&ms, t0, t1), "event");
    (void)cudaEventDestroy(t0);
    (void)cudaEventDestroy(t1);
    const double rate = 10.0 * 2.0 * n * static_cast<double>(n) * n / (ms * 1e-3) / 1e9;
    cache[key] = rate;
    return rate;
}

/// The benchmark's loop over run(), each iteration's device time on `stream` (an event pair
/// around it) set as its manual time. Returns the seconds timed in all.
template <class F>
double event_timed(benchmark::State& state, cudaStream_t stream, F&& run) {
    cudaEvent_t t0, t1;
    tc::check(cudaEventCreate(&t0), "event");
    tc::check(cudaEventCreate(&t1), "event");
    double seconds = 0;
    for (auto _ : state) {
        tc::check(cudaEventRecord(t0, stream), "event");
        run();
        tc::check(cudaEventRecord(t1, stream), "event");
        tc::check(cudaEventSynchronize(t1), "event");
        float ms = 0;
        tc::check(cudaEventElapsedTime(&ms, t0, t1), "event");
        state.SetIterationTime(ms * 1e-3);
        seconds += ms * 1e-3;
    }
    (void)cudaEventDestroy(t0);
    (void)cudaEventDestroy(t1);
    return seconds;
}

/// The device's copy rate in GB/s (read + write bytes of a 256 MB device-to-device copy; 2
/// warm-ups, then 5 timed), cached: what a stream through memory can reach in this run.
double copy_rate() {
    static double rate = 0;
    if (rate > 0) {
        return rate;
    }
    const tc::StreamContext cx;
    const std::size_t n = std::size_t{64} << 20;  // floats
    tc::DeviceBuffer<float> a(n), b(n);
    tc::set_now(a.data(), 1, n * sizeof(float), "cudaMemset");
    const auto copy = [&] {
        tc::check(cudaMemcpyAsync(b.data(), a.data(), n * sizeof(float), cudaMemcpyDeviceToDevice,
                                  cx.stream()),
                  "cudaMemcpyAsync");
    };
    copy();
    copy();
    cx.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 5; ++i) {
        copy();
    }
    cx.synchronize();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rate = 5.0 * 2.0 * static_cast<double>(n * sizeof(float)) / dt / 1e9;
    return rate;
}

/// C = A B for m rows (a decoded token's product), 20 back to back a timed iteration (event
/// pair: the launches' gaps count, as in a decoded token), on cuBLAS (path 0) or in
/// rows_product_kernel (1); FP32, TF32 off. Counters: us_per_product, GBps (A, B and C's
/// bytes once) and frac_copy (of copy_rate's).
void BM_CudaRowsProduct(benchmark::State& state) {
    const int m = static_cast<int>(state.range(0)), k = static_cast<int>(state.range(1)),
              n = static_cast<int>(state.range(2));
    const bool rows_was = tc::rows_product();
    tc::set_rows_product(state.range(3) != 0);
    const double copy = copy_rate();
    const tc::StreamContext cx;
    const titans::Matrixf host = titans::Matrixf::Random(k + m, n > k ? n : k);
    const auto size = static_cast<std::size_t>(host.size());
    tc::DeviceBuffer<float> ab = tc::upload_array(host.data(), size),
                            c(static_cast<std::size_t>(m) * static_cast<std::size_t>(n));
    const float* a = ab.data() + static_cast<std::size_t>(k) * static_cast<std::size_t>(n);
    constexpr int reps = 20;
    const auto run = [&] {
        for (int i = 0; i < reps; ++i) {
            tc::gemm<float>(cx.blas(), false, false, m, n, k, 1.0f, {a, k}, {ab.data(), n}, 0.0f,
                            c.data(), n, 0, 1);
        }
    };
    run();
    cx.synchronize();
    const double seconds = event_timed(state, cx.stream(), run);
    tc::set_rows_product(rows_was);
    const double products = static_cast<double>(state.iterations()) * reps;
    const double bytes = 4.0 * (static_cast<double>(k) * n + static_cast<double>(m) * (k + n));
    state.counters["us_per_product"] = seconds / products * 1e6;
    state.counters["GBps"] = bytes * products / seconds / 1e9;
    state.counters["frac_copy"] = bytes * products / seconds / 1e9 / copy;
}

/// The non-finite check (flag_rows_kernel) over `rows` rows of `cols` floats, 20 launches back
/// to back a timed iteration: rows end to end (flat 1: a warp per 512 entries) or each row
/// padded by one entry (flat 0: a warp per row, the path of a strided set). The forward's
/// shapes at B 256 x N 512: q, k, v and the reads (1 M rows of 64), the gate logits (1 M of 3),
/// the output (131,072 of 512). Counters: us_per_check, GBps (the checked entries' bytes) and
/// frac_copy (of copy_rate's).
void BM_CudaChecks(benchmark::State& state) {
    const long long rows = state.range(0);
    const int cols = static_cast<int>(state.range(1));
    const bool flat = state.range(2) != 0;
    const double copy = copy_rate();
    const tc::StreamContext cx;
    const long long ld = flat ? cols : cols + 1;
    tc::DeviceBuffer<float> x(static_cast<std::size_t>(rows * ld));
    tc::set_now(x.data(), 0, x.size() * sizeof(float), "cudaMemset");  // zeros: finite
    tc::DeviceBuffer<int> flags(1);
    tc::FlagSets<float> sets{};
    sets.set[0] = tc::FlagRows<float>{x.data(), 1, rows, cols, ld, 0, 0, 1, 0, 1};
    sets.first[0] = 0;
    sets.first[1] = tc::flag_warps(sets.set[0]);
    sets.count = 1;
    constexpr int reps = 20;
    const auto run = [&] {
        for (int i = 0; i < reps; ++i) {
            tc::launch(tc::flag_rows_kernel<float>, tc::warp_blocks(sets.first[1]), 256,
                       cx.stream(), sets, flags.data(), 0x7f7f7f7f, nullptr);
        }
    };
    run();
    cx.synchronize();
    const double seconds = event_timed(state, cx.stream(), run);
    const double checks = static_cast<double>(state.iterations()) * reps;
    const double bytes = 4.0 * static_cast<double>(rows) * cols;
    state.counters["us_per_check"] = seconds / checks * 1e6;
    state.counters["GBps"] = bytes * checks / seconds / 1e9;
    state.counters["frac_copy"] = bytes * checks / seconds / 1e9 / copy;
}

void BM_CublasSgemm(benchmark::State& state) {
    const int n = static_cast<int>(state.range(0));
    const bool tf32 = state.range(1) != 0;
    double rate = 0;
    for (auto _ : state) {
        rate = sgemm_rate(n, tf32);
    }
    state.counters["GFLOPS"] = rate;
}

titans::MemoryConfig headline() {
    titans::MemoryConfig cfg{};
    cfg.d_model = 512;
    cfg.n_heads = 8;
    cfg.d_head = 64;
    cfg.depth = 2;
    cfg.expansion = 4;
    cfg.chunk = 64;
    cfg.retrieval = titans::Retrieval::Lagged;
    return cfg;
}

/// A memory, a device input of B*N random rows and a device output.
struct Setup {
    titans::MemoryConfig cfg = headline();
    std::shared_ptr<const titans::MemoryParams<float>> params;
    Kernels::Prepared prepared;
    Transfer::Buffer x, y;
    Setup(int B, long N) {
        auto p = titans::MemoryParams<float>::random(cfg, 1);
        p.b_alpha.setConstant(-8.0f);
        params = std::make_shared<const titans::MemoryParams<float>>(std::move(p));
        prepared = Kernels::prepare(cfg, params);
        const titans::Matrixf host = titans::Matrixf::Random(B * N, cfg.d_model);
        x = Transfer::upload(titans::view_of(host));
        y = Transfer::allocate(B * N, cfg.d_model);
    }
    void forward(Kernels::State& st) {
        Kernels::forward(cfg, prepared, st, Transfer::view(std::as_const(x)), Transfer::view(y),
                         nullptr);
    }
};

/// tokens/s and GFLOPS of the memory's forward (or, train, its training step's FLOP model).
void counters(benchmark::State& state, const titans::MemoryConfig& cfg, int B, long N,
              bool train = false) {
    const double iters = static_cast<double>(state.iterations());
    const double flops = train ? titans_bench::memory_training_flops(cfg, B, N)
                               : titans_bench::memory_forward_flops(cfg, B, N);
    state.counters["tokens_per_second"] =
        benchmark::Counter(iters * B * static_cast<double>(N), benchmark::Counter::kIsRate);
    state.counters["GFLOPS"] = benchmark::Counter(iters * flops / 1e9, benchmark::Counter::kIsRate);
}

/// The benchmark's loop over f(), which works on st and returns with the device idle: st reset
/// to `fresh` before each iteration outside the timer, each iteration's wall time set as its
/// manual time (the counters' rates use it). Returns the seconds timed in all.
template <class State, class F>
double timed_from_fresh(benchmark::State& state, const State& fresh, State& st, F&& f) {
    double seconds = 0;
    for (auto _ : state) {
        state.PauseTiming();
        st = fresh;
        cudaDeviceSynchronize();
        state.ResumeTiming();
        const auto t0 = std::chrono::steady_clock::now();
        f();
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        state.SetIterationTime(dt);
        seconds += dt;
    }
    return seconds;
}

/// frac_sgemm and frac_tf32: the rate of `flops` an iteration over `seconds` in all (the
/// iterations' manual times), over the same run's cuBLAS GEMM rates (GFLOPS).
void fractions(benchmark::State& state, double flops, double seconds, double sgemm, double tf32) {
    const double gflops = static_cast<double>(state.iterations()) * flops / 1e9 / seconds;
    state.counters["frac_sgemm"] = gflops / sgemm;
    state.counters["frac_tf32"] = gflops / tf32;
}

void BM_CudaMemory(benchmark::State& state) {
    const int B = static_cast<int>(state.range(0));
    const long N = state.range(1);
    const bool tf32 = state.range(2) != 0;
    const bool fused = state.range(3) != 0;
    const bool bf16 = state.range(3) == 2;
    const bool cluster = state.range(3) == 3;
    const double sgemm = sgemm_rate(4096, false), tf32_rate = sgemm_rate(4096, true);
    Setup s(B, N);
    tc::set_allow_tf32(tf32);
    const Kernels::State fresh = Kernels::make_state(s.cfg, s.prepared, B);
    tc::set_allow_tf32(false);
    tc::set_fused_memory(fused ? tc::FusedMemory::On : tc::FusedMemory::Off);
    tc::set_fused_operands(bf16 ? tc::FusedOperands::BF16 : tc::FusedOperands::Float);
    tc::set_fused_cluster(cluster ? -1 : 0);
    Kernels::State st = fresh;
    const long long launches = tc::fused_launches(), clusters = tc::fused_cluster_launches();
    s.forward(st);  // warm-up: workspaces, cuBLAS heuristics
    if ((tc::fused_launches() > launches) != fused ||
        (tc::fused_cluster_launches() > clusters) != cluster) {
        state.SkipWithError("the fused kernel did not run as asked");
    }
    const double seconds = timed_from_fresh(state, fresh, st, [&] { s.forward(st); });
    counters(state, s.cfg, B, N);
    fractions(state, titans_bench::memory_forward_flops(s.cfg, B, N), seconds, sgemm, tf32_rate);
    tc::set_fused_memory(tc::FusedMemory::Auto);
    tc::set_fused_operands(tc::FusedOperands::Float);
    tc::set_fused_cluster(0);
}

/// The memory's training step at B x N: the training forward (trace in device memory) and the
/// backward (dx in device memory, the parameter gradients added to a flat gradient buffer in
/// device memory, as a block's backward adds them), from a fresh state each iteration (reset
/// outside the timer);
/// TF32 allowed in both passes. GFLOPS counts the step's FLOP model (memory_training_flops: 3x
/// the forward's; until 2026-12-02 the forward's alone, a third of the step's rate).
void BM_CudaMemoryTrain(benchmark::State& state) {
    using Training = titans::backend::MemoryTraining<Cuda, float>;
    const int B = static_cast<int>(state.range(0));
    const long N = state.range(1);
    const double sgemm = sgemm_rate(4096, false), tf32_rate = sgemm_rate(4096, true);
    const bool fused_backward_was = tc::fused_backward_flag().load();
    tc::set_fused_backward(state.range(2) != 0);
    tc::set_fused_operands(state.range(2) == 2 ? tc::FusedOperands::BF16
                                               : tc::FusedOperands::Float);
    tc::set_fused_cluster(state.range(3) != 0 ? -1 : 0);
    Setup s(B, N);
    tc::set_allow_tf32(true);  // the state's context, and the thread's (the backward's) when
                               // the warm-up below makes it (nothing earlier in bench_cuda does)
    const Kernels::State fresh = Kernels::make_state(s.cfg, s.prepared, B);
    const titans::Matrixf dy_host = titans::Matrixf::Random(B * N, s.cfg.d_model) / N;
    const Transfer::Buffer dy = Transfer::upload(titans::view_of(dy_host));
    Transfer::Buffer dx = Transfer::allocate(B * N, s.cfg.d_model);
    const titans::Matrixf zeros = titans::Matrixf::Zero(
        1, titans::detail::flat_size(titans::MemoryParams<float>::zeros(s.cfg), s.cfg));
    Transfer::Buffer grads = Transfer::upload(titans::view_of(zeros));
    const auto step = [&](Kernels::State& st) {
        Training::Trace trace;
        Training::forward(s.cfg, s.prepared, st, Transfer::view(std::as_const(s.x)),
                          Transfer::view(s.y), trace);
        (void)Training::backward(s.cfg, s.prepared, trace, Transfer::view(dy),
                                 Transfer::view(dx), Transfer::view(grads));
        cudaDeviceSynchronize();
    };
    Kernels::State st = fresh;
    const long long launches = tc::fused_backward_launches(),
                    clusters = tc::fused_cluster_launches();
    step(st);  // warm-up: workspaces, cuBLAS heuristics
    tc::set_allow_tf32(false);
    if ((tc::fused_backward_launches() > launches) != (state.range(2) != 0) ||
        (tc::fused_cluster_launches() > clusters) != (state.range(3) != 0)) {
        state.SkipWithError("the fused backward or the clusters did not run as asked");
    }
    const double seconds = timed_from_fresh(state, fresh, st, [&] { step(st); });
    tc::set_fused_backward(fused_backward_was);
    tc::set_fused_operands(tc::FusedOperands::Float);
    tc::set_fused_cluster(0);
    counters(state, s.cfg, B, N, true);
    fractions(state, titans_bench::memory_training_flops(s.cfg, B, N), seconds, sgemm, tf32_rate);
}

void BM_CudaDecode(benchmark::State& state) {
    const int B = static_cast<int>(state.range(0));
    // decode 1: the read and key pass in decode_rows_kernel; 0: the batched products
    tc::set_fused_memory(state.range(1) != 0 ? tc::FusedMemory::Auto : tc::FusedMemory::Off);
    const bool rows_was = tc::rows_product();
    tc::set_rows_product(state.range(2) != 0);  // rows 1: the projections in rows_product
    const int cluster_was = tc::decode_cluster();
    tc::set_decode_cluster(static_cast<int>(state.range(3)));  // blocks a pair (0: one)
    Setup s(B, 1);
    Kernels::State st = Kernels::make_state(s.cfg, s.prepared, B);
    s.forward(st);
    for (auto _ : state) {
        s.forward(st);
    }
    tc::set_fused_memory(tc::FusedMemory::Auto);
    tc::set_rows_product(rows_was);
    tc::set_decode_cluster(cluster_was);
    counters(state, s.cfg, B, 1);
}

/// The blocks of bench_blocks.cpp (d 512, H 8, L 2, span 512, b 64), memory lr cap 0.01 and
/// forget-gate bias -8 (a memory that neither decays to 0 nor diverges over long streams).
titans::BlockConfig bench_block(titans::BlockKind kind) {
    titans::BlockConfig cfg = titans::BlockConfig::make(kind, 512, 8, 2, 512, 64);
    cfg.memory.theta_max = 0.01;
    return cfg;
}
titans::BlockParams<float> bench_block_params(const titans::BlockConfig& cfg, std::uint64_t seed) {
    auto p = titans::BlockParams<float>::random(cfg, seed);
    p.memory.b_alpha.setConstant(-8.0f);
    return p;
}

/// Times f(state) from a fresh copy of `fresh` per iteration (the copy outside the timer);
/// tokens_per_second over B*N tokens.
template <class State, class F>
void stream_timed(benchmark::State& state, const State& fresh, int B, long N, F&& f) {
    State st = fresh;
    f(st);  // warm-up: workspaces, cuBLAS heuristics
    for (auto _ : state) {
        state.PauseTiming();
        st = fresh;
        cudaDeviceSynchronize();
        state.ResumeTiming();
        f(st);
    }
    state.counters["tokens_per_second"] = benchmark::Counter(
        static_cast<double>(state.iterations()) * B * static_cast<double>(N),
        benchmark::Counter::kIsRate);
}

void BM_CudaBlock(benchmark::State& state) {
    const auto kind = static_cast<titans::BlockKind>(state.range(0));
    const int B = static_cast<int>(state.range(1));
    const long N = state.range(2);
    const titans::BlockConfig cfg = bench_block(kind);
    const titans::Block<float, Cuda> block(cfg, bench_block_params(cfg, 1));
    const titans::Matrixf x = titans::Matrixf::Random(B * N, cfg.d_model);
    stream_timed(state, block.make_state(B), B, N,
                 [&](auto& st) { benchmark::DoNotOptimize(block.forward(st, x)); });
    state.SetLabel(titans::to_string(kind));
}

/// The 4-block model (MAC, MAG, MAL, LMM) of bench_block's blocks, d 512; with `mac` false its
/// MAC block is an LMM one (nothing of it then runs on the host); vocab 0: vectors in.
std::pair<titans::ModelConfig, titans::ModelParams<float>> bench_model(bool mac, int vocab) {
    titans::ModelConfig cfg;
    cfg.d_model = 512;
    cfg.vocab_size = vocab;
    for (auto kind : {mac ? titans::BlockKind::MAC : titans::BlockKind::LMM,
                      titans::BlockKind::MAG, titans::BlockKind::MAL, titans::BlockKind::LMM}) {
        cfg.blocks.push_back(bench_block(kind));
    }
    auto params = titans::ModelParams<float>::random(cfg, 1);
    for (std::size_t i = 0; i < cfg.blocks.size(); ++i) {
        params.blocks[i] = bench_block_params(cfg.blocks[i], i + 1);
    }
    return {cfg, params};
}

void BM_CudaModel(benchmark::State& state) {
    const int B = static_cast<int>(state.range(0));
    const long N = state.range(1);
    const auto [cfg, params] = bench_model(true, 0);
    const titans::Model<float, Cuda> model(cfg, params);
    const titans::Matrixf x = titans::Matrixf::Random(B * N, cfg.d_model);
    stream_timed(state, model.make_state(B), B, N,
                 [&](auto& st) { benchmark::DoNotOptimize(model.forward(st, x)); });
}

/// The attention layer's FLOPs for B fresh sequences of N tokens: the four projections and,
/// per query at position t, q k^T and p v over the min(t + 1, w) keys it sees.
double attention_flops(const titans::AttentionConfig& cfg, int B, long N) {
    const double d = cfg.d_model, D = cfg.inner_dim(), w = cfg.window;
    double keys = 0;
    for (long t = 0; t < N; ++t) {
        keys += std::min<double>(static_cast<double>(t) + 1, w);
    }
    return B * (8.0 * N * d * D + 4.0 * keys * D);
}

/// The attention's path for a benchmark argument: 0 a thread per (row, head), 1 the scalar
/// tiles, 2 warp tiles with FMAs, 3 warp tiles on the tensor cores (TF32).
tc::TiledAttentionMode attention_mode(long path) {
    return path == 0   ? tc::TiledAttentionMode::Off
           : path == 1 ? tc::TiledAttentionMode::Scalar
                       : tc::TiledAttentionMode::Auto;
}

void BM_CudaAttention(benchmark::State& state) {
    using AK = titans::backend::AttentionKernels<Cuda, float>;
    const int B = static_cast<int>(state.range(0));
    const long N = state.range(1);
    const long path = state.range(2);
    const titans::AttentionConfig cfg{.d_model = 512, .n_heads = 8, .window = 512, .rope = true};
    const auto params = std::make_shared<const titans::AttentionParams<float>>(
        titans::AttentionParams<float>::random(cfg, 1));
    const AK::Prepared prepared = AK::prepare(cfg, params);
    const titans::Matrixf host = titans::Matrixf::Random(B * N, cfg.d_model);
    const Transfer::Buffer x = Transfer::upload(titans::view_of(host));
    Transfer::Buffer y = Transfer::allocate(B * N, cfg.d_model);
    tc::set_tiled_attention(attention_mode(path));
    tc::set_allow_tf32(path == 3);
    const AK::State fresh = AK::make_state(cfg, B);
    tc::set_allow_tf32(false);
    AK::State st = fresh;
    const auto run = [&] {
        AK::forward(cfg, prepared, st, Transfer::view(x), Transfer::view(y), nullptr);
    };
    run();  // warm-up: workspaces, cuBLAS heuristics
    const double seconds = timed_from_fresh(state, fresh, st, run);
    tc::set_tiled_attention(tc::TiledAttentionMode::Auto);
    const double gflops =
        static_cast<double>(state.iterations()) * attention_flops(cfg, B, N) / seconds / 1e9;
    state.counters["tokens_per_second"] = benchmark::Counter(
        static_cast<double>(state.iterations()) * B * static_cast<double>(N),
        benchmark::Counter::kIsRate);
    state.counters["GFLOPS"] = gflops;
    state.counters["frac_sgemm"] = gflops / sgemm_rate(4096, false);
    state.counters["frac_tf32"] = gflops / sgemm_rate(4096, true);
}

/// The attention kernels alone (d_h 64, H 8, window 512, no prefix) over B sequences of N
/// queries on device buffers: the forward (backward 0) or the backward's three passes
/// (backward 1), on `path` 1-3 of attention_mode. GFLOPS count the products over the keys
/// each query sees: 2 in the forward, 5 in the backward (flash-attention's convention: the
/// query pass's second S and the key pass's P, recomputed, are not counted).
void BM_CudaAttentionTiles(benchmark::State& state) {
    const int B = static_cast<int>(state.range(0)), H = 8, dh = 64, w = 512;
    const long N = state.range(1);
    const long path = state.range(2);
    const bool backward = state.range(3) != 0;
    const long long D = static_cast<long long>(H) * dh, rows = B * N;
    const titans::Matrixf host = titans::Matrixf::Random(rows, 3 * D);  // q, k, v; dout; out
    tc::DeviceBuffer<float> q = tc::upload_array(host.data(), static_cast<std::size_t>(host.size()));
    tc::DeviceBuffer<float> o(static_cast<std::size_t>(rows * D)), dq(o.size()), dk(o.size()),
        dv(o.size()), stats(static_cast<std::size_t>(3 * rows * H));
    const tc::TiledAttentionArgs<float> f{
        q.data(), D, q.data(), q.data(), 0, D, D, true, q.data() + rows * D, q.data() + 2 * rows * D,
        N, D, N, 0, 1, H, dh, w, 1.0f / std::sqrt(static_cast<float>(dh)), o.data(), D};
    const tc::TiledBackwardArgs<float> a{f, q.data() + rows * D, D, o.data(), D, stats.data(),
                                         stats.data() + rows * H, stats.data() + 2 * rows * H};
    const tc::StreamContext cx;
    const tc::TiledKeyGrads<float> grads{dk.data(), dv.data(), D};  // (no prefix rows)
    const auto forward = [&] {
        if (path == 1) {
            tc::tiled_attention(cx.stream(), f, B, tc::tiled_shape(dh, N, sizeof(float)));
        } else {
            tc::warp_tiled_attention(cx.stream(), f, B, path == 3);
        }
    };
    const auto run = [&] {
        if (!backward) {
            forward();
        } else if (path == 1) {
            const tc::TiledShape sh = tc::tiled_backward_shape(dh, sizeof(float));
            tc::tiled_query_backward(cx.stream(), a, B, sh, dq.data(), D);
            tc::tiled_key_backward(cx.stream(), a, B, sh, false, grads);
        } else {
            tc::warp_backward(cx.stream(), a, B, dq.data(), D, grads, grads, path == 3);
        }
    };
    forward();  // the output the backward reads
    run();
    cx.synchronize();
    const double seconds = event_timed(state, cx.stream(), run);
    double keys = 0;
    for (long t = 0; t < N; ++t) {
        keys += std::min<double>(static_cast<double>(t) + 1, w);
    }
    const double flops = (backward ? 10.0 : 4.0) * B * keys * static_cast<double>(D);
    const double gflops = flops * static_cast<double>(state.iterations()) / seconds / 1e9;
    state.counters["GFLOPS"] = gflops;
    state.counters["frac_tf32"] = gflops / sgemm_rate(4096, true);
}

/// A decoded token's attention alone (d_h 64, H 8, a full window of 512 keys, no prefix): B
/// sequences' one query each, in the scalar tiles' one-query launch (split 0) or in
/// decode_split_kernel (1, attention_decode.cuh), 20 back to back a timed iteration. Counters:
/// us_per_call, GBps (the keys' and values' bytes once) and frac_copy (of copy_rate's).
void BM_CudaDecodeAttention(benchmark::State& state) {
    const int B = static_cast<int>(state.range(0)), H = 8, dh = 64, w = 512;
    const bool split = state.range(1) != 0;
    const double copy = copy_rate();
    const long long D = static_cast<long long>(H) * dh, rows = static_cast<long long>(B) * w;
    const titans::Matrixf host = titans::Matrixf::Random(2 * rows + B, D);  // k, v; q
    tc::DeviceBuffer<float> kv =
        tc::upload_array(host.data(), static_cast<std::size_t>(host.size()));
    tc::DeviceBuffer<float> o(static_cast<std::size_t>(B * D));
    const float* k = kv.data();
    const float* v = k + rows * D;
    const float* q = v + rows * D;
    const tc::TiledAttentionArgs<float> a{
        q, D, k, v, 0, D, D, true, k, v, w, D, 1, w - 1, 1, H, dh, w,
        1.0f / std::sqrt(static_cast<float>(dh)), o.data(), D};
    const tc::StreamContext cx;
    constexpr int reps = 20;
    const auto run = [&] {
        for (int i = 0; i < reps; ++i) {
            if (split) {
                tc::decode_split(cx.stream(), a, B);
            } else {
                tc::tiled_attention(cx.stream(), a, B, tc::tiled_shape(dh, 1, sizeof(float)));
            }
        }
    };
    run();
    cx.synchronize();
    const double seconds = event_timed(state, cx.stream(), run);
    const double calls = static_cast<double>(state.iterations()) * reps;
    const double bytes = 2.0 * static_cast<double>(rows) * static_cast<double>(D) * 4.0;
    state.counters["us_per_call"] = seconds / calls * 1e6;
    state.counters["GBps"] = bytes * calls / seconds / 1e9;
    state.counters["frac_copy"] = bytes * calls / seconds / 1e9 / copy;
}

/// One Trainer<float, Cuda> step (forward on token ids, cross-entropy, backward, clipping,
/// AdamW and the model taking the values, all on the device; the loss, norm and AdamW's
/// verdict back in one download) of bench_model with a vocabulary of 512, B sequences of N
/// ids, each labelled with the next.
void BM_CudaTrainStep(benchmark::State& state) {
    const bool mac = state.range(0) != 0;
    const int B = static_cast<int>(state.range(1));
    const long N = state.range(2);
    const auto [cfg, params] = bench_model(mac, 512);
    std::vector<int> ids, labels;
    for (long i = 0; i < B * N; ++i) {
        ids.push_back(static_cast<int>((i * 7919) % 512));
        labels.push_back(static_cast<int>(((i + 1) * 7919) % 512));
    }
    titans::Trainer<float, Cuda> trainer(cfg, params,
                                         {.schedule = {.peak = 1e-4}, .clip_norm = 1.0});
    double loss = trainer.step(ids, labels, B);  // warm-up: workspaces, cuBLAS heuristics
    for (auto _ : state) {
        loss = trainer.step(ids, labels, B);
    }
    if (!std::isfinite(loss)) state.SkipWithError("non-finite loss");
    state.counters["tokens_per_second"] = benchmark::Counter(
        static_cast<double>(state.iterations()) * B * static_cast<double>(N),
        benchmark::Counter::kIsRate);
    state.SetLabel(mac ? "MAC MAG MAL LMM" : "LMM MAG MAL LMM");
}

/// A one-layer MAC model (bench_block's MAC block between an embedding and a head, vocabulary
/// 512), titans-pytorch's MemoryAsContextTransformer of depth 1 in size
/// (tools/compare_pytorch_gpu.py --mac): a forward on B sequences of N token ids from a fresh
/// state (train 0), or a Trainer step on them (train 1); TF32 products.
void BM_CudaMacLayer(benchmark::State& state) {
    const int B = static_cast<int>(state.range(0));
    const long N = state.range(1);
    const bool train = state.range(2) != 0;
    titans::ModelConfig cfg;
    cfg.d_model = 512;
    cfg.vocab_size = 512;
    cfg.blocks.push_back(bench_block(titans::BlockKind::MAC));
    auto params = titans::ModelParams<float>::random(cfg, 1);
    params.blocks[0] = bench_block_params(cfg.blocks[0], 1);
    std::vector<int> ids, labels;
    for (long i = 0; i < B * N; ++i) {
        ids.push_back(static_cast<int>((i * 7919) % 512));
        labels.push_back(static_cast<int>(((i + 1) * 7919) % 512));
    }
    tc::set_allow_tf32(true);
    if (train) {
        titans::Trainer<float, Cuda> trainer(cfg, params,
                                             {.schedule = {.peak = 1e-4}, .clip_norm = 1.0});
        double loss = trainer.step(ids, labels, B);  // warm-up
        for (auto _ : state) {
            loss = trainer.step(ids, labels, B);
        }
        if (!std::isfinite(loss)) state.SkipWithError("non-finite loss");
    } else {
        const titans::Model<float, Cuda> model(cfg, params);
        stream_timed(state, model.make_state(B), B, N, [&](auto& st) {
            benchmark::DoNotOptimize(model.forward_tokens(st, ids));
        });
    }
    tc::set_allow_tf32(false);
    state.counters["tokens_per_second"] = benchmark::Counter(
        static_cast<double>(state.iterations()) * B * static_cast<double>(N),
        benchmark::Counter::kIsRate);
    state.SetLabel(train ? "MAC layer, Trainer step" : "MAC layer, forward");
}

void BM_CudaModelDecode(benchmark::State& state) {
    const int B = static_cast<int>(state.range(0));
    tc::set_device_memory(state.range(1) != 0 ? tc::DeviceMemory::Pooled
                                              : tc::DeviceMemory::Direct);
    const bool graphs_were = tc::call_graphs(), ffn_was = tc::fused_feed_forward(),
               rows_was = tc::rows_product();
    tc::set_call_graphs(state.range(2) != 0);
    tc::set_fused_feed_forward(state.range(3) != 0);
    const bool split_was = tc::split_decode();
    tc::set_rows_product((state.range(4) & 1) != 0);  // opt: 1 few-row products, 2 split
    tc::set_split_decode((state.range(4) & 2) != 0);  // decode attention, 3 both
    const auto [cfg, params] = bench_model(false, 0);
    const titans::Model<float, Cuda> model(cfg, params);
    auto st = model.make_state(B);
    const titans::Matrixf x = titans::Matrixf::Random(B, cfg.d_model);
    // warm-up: workspaces, cuBLAS heuristics, and (graphs 1) every shape of a chunk's tokens
    // seen twice, so that each has its graph
    for (int t = 0; t < 2 * cfg.blocks[0].memory.effective_chunk() + 2; ++t) {
        benchmark::DoNotOptimize(model.forward(st, x));
    }
    const tc::CallGraphStats g0 = tc::call_graph_stats();
    for (auto _ : state) {
        benchmark::DoNotOptimize(model.forward(st, x));
    }
    const tc::CallGraphStats& g = tc::call_graph_stats();
    tc::set_device_memory(tc::DeviceMemory::Pooled);
    tc::set_call_graphs(graphs_were);
    tc::set_fused_feed_forward(ffn_was);
    tc::set_rows_product(rows_was);
    tc::set_split_decode(split_was);
    const auto calls = static_cast<double>(std::max<std::int64_t>(state.iterations(), 1));
    state.counters["tokens_per_second"] = benchmark::Counter(
        static_cast<double>(state.iterations()) * B, benchmark::Counter::kIsRate);
    state.counters["graph_launches_per_call"] = static_cast<double>(g.launched - g0.launched) / calls;
    state.counters["graph_updates_per_call"] = static_cast<double>(g.updated - g0.updated) / calls;
}

}  // namespace

BENCHMARK(BM_CublasSgemm)->Args({4096, 0})->Args({4096, 1})->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaRowsProduct)->ArgNames({"m", "k", "n", "rows"})
    ->ArgsProduct({{1, 8}, {512}, {512, 1536, 2736}, {0, 1}})
    ->ArgsProduct({{1}, {1368}, {512}, {0, 1}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaChecks)->ArgNames({"rows", "cols", "flat"})
    ->ArgsProduct({{1048576}, {64, 3}, {0, 1}})->ArgsProduct({{131072}, {512}, {0, 1}})
    ->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaMemory)
    ->ArgNames({"B", "N", "tf32", "fused"})
    ->Args({1, 2048, 0, 0})->Args({16, 2048, 0, 0})->Args({64, 1024, 0, 0})->Args({256, 512, 0, 0})
    ->Args({64, 1024, 1, 0})->Args({256, 512, 1, 0})
    ->Args({1, 2048, 1, 1})->Args({16, 2048, 1, 1})->Args({64, 1024, 1, 1})->Args({256, 512, 1, 1})
    ->Args({256, 512, 0, 1})
    ->Args({64, 1024, 1, 2})->Args({256, 512, 1, 2})
    ->Args({64, 1024, 1, 3})->Args({256, 512, 1, 3})
    ->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_CudaMemoryTrain)
    ->ArgNames({"B", "N", "fbwd", "cl"})
    ->Args({1, 2048, 1, 0})->Args({1, 2048, 0, 0})->Args({1, 2048, 1, 1})
    ->Args({64, 1024, 1, 0})->Args({256, 512, 1, 0})->Args({256, 512, 0, 0})
    ->Args({256, 512, 2, 0})->Args({256, 512, 1, 1})
    ->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_CudaDecode)->ArgNames({"B", "decode", "rows", "cluster"})
    ->ArgsProduct({{1, 64, 1024}, {0, 1}, {0}, {0}})->Args({1, 1, 1, 0})->Args({64, 1, 1, 0})
    ->Args({1, 1, 0, 2})->Args({1, 1, 0, 4})->Args({1, 1, 0, 8})->Args({16, 1, 0, 4})
    ->Args({1, 1, 1, 4})
    ->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_CudaBlock)
    ->ArgNames({"kind", "B", "N"})
    ->ArgsProduct({{0, 1, 2, 3, 4}, {1, 16}, {2048}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CudaModel)->ArgNames({"B", "N"})->Args({1, 2048})->Args({16, 2048})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CudaAttention)
    ->ArgNames({"B", "N", "path"})
    ->ArgsProduct({{1, 16}, {2048}, {0, 1, 2, 3}})
    ->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_CudaAttentionTiles)
    ->ArgNames({"B", "N", "path", "backward"})
    ->ArgsProduct({{16}, {4096}, {1, 2, 3}, {0, 1}})
    ->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_CudaDecodeAttention)->ArgNames({"B", "split"})
    ->ArgsProduct({{1, 16, 256}, {0, 1}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaTrainStep)->ArgNames({"mac", "B", "N"})->Args({0, 1, 1024})->Args({1, 1, 1024})
    ->Args({0, 8, 1024})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CudaMacLayer)->ArgNames({"B", "N", "train"})->ArgsProduct({{1, 8}, {2048}, {0, 1}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CudaModelDecode)->ArgNames({"B", "pooled", "graphs", "ffn", "opt"})
    ->Args({1, 0, 0, 0, 0})->Args({64, 0, 0, 0, 0})
    ->Args({1, 1, 0, 0, 0})->Args({64, 1, 0, 0, 0})->Args({256, 1, 0, 0, 0})
    ->Args({1, 1, 1, 0, 0})->Args({64, 1, 1, 0, 0})->Args({256, 1, 1, 0, 0})
    ->Args({1, 1, 0, 1, 0})->Args({16, 1, 0, 1, 0})->Args({1, 1, 1, 1, 0})->Args({16, 1, 1, 1, 0})
    ->Args({1, 1, 0, 0, 1})->Args({8, 1, 0, 0, 1})->Args({1, 1, 1, 0, 1})->Args({1, 1, 0, 1, 1})
    ->Args({1, 1, 1, 1, 1})->Args({1, 1, 0, 0, 2})->Args({1, 1, 0, 0, 3})->Args({64, 1, 0, 0, 3})
    ->Args({1, 1, 1, 0, 3})
    ->Unit(benchmark::kMicrosecond)->UseRealTime();

BENCHMARK_MAIN();
