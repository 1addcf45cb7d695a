#pragma once
// bench/memory_flops.hpp: the FLOP model of the memory's forward, shared by bench_memory and
// bench_train (so both count the same work).

#include <titans/memory/config.hpp>

namespace titans_bench {

using titans::MemoryConfig;

/// FLOP model of one NeuralMemory forward over B sequences of N tokens (multiply-add = 2
/// flops). Counts the dense products the algorithm needs, not what an implementation happens
/// to execute: element-wise work (conv, activations, L2 norms, gate sigmoids, chunk
/// coefficients, the diagonal scalings) is not counted, and neither is the upper (masked)
/// triangle of the in-chunk score matrix.
///
/// Notation: d = d_model, H heads, d_h head width, D = H d_h, L layers of the memory MLP with
/// layer l mapping in_l -> out_l, and P = sum_l in_l out_l (weights per head per matrix).
/// Per token:
///   projections     q, k, v: 3 * 2 d D;  gates: 3 * 2 d H (none for GateMode::Constant);
///                   output W_O: 2 D d
///   per head, chunked (math §4), chunk b:
///     key forward       2 P                    (Z_l = A_{l-1} W^s_l)
///     error backprop    2 (P - in_1 out_1)     (Delta_{l-1} = Delta_l W_l^T, l >= 2)
///     chunk-end update  4 P                    (A^T diag(g) Delta for W and A^T diag(s) Delta
///                                               for S: 2 in out per token each)
///     retrieval, lagged 2 P                    (one forward at W^s)
///     retrieval, in-chunk, per layer: H W^s and H S^s: 2 * 2 in out; H A^T and
///                       (G . scores) Delta over the average causal prefix of a full chunk,
///                       pbar = (b + 1) / 2 keys: pbar * 2 in + pbar * 2 out
///   per head, per token (math §3):
///     forward 2 P, backward 2 (P - in_1 out_1), two rank-1 updates per layer 4 P
///     (S -= theta a^T delta, W = (1 - alpha) W + S), retrieval one forward 2 P
///     (lagged: at M_{t-1}; in-chunk: at M_t).
/// Chunked with lagged retrieval and the per-token path have the same count: their ratio of
/// tokens/s is the ratio of achieved GFLOPS.
inline double memory_forward_flops(const MemoryConfig& cfg, int B, long N) {
    const double d = cfg.d_model, H = cfg.n_heads, D = cfg.inner_dim();
    double P = 0.0, first = 0.0, in_sum = 0.0, out_sum = 0.0;
    for (int l = 1; l <= cfg.depth; ++l) {
        const double in = cfg.layer_in(l), out = cfg.layer_out(l);
        P += in * out;
        in_sum += in;
        out_sum += out;
        if (l == 1) {
            first = in * out;
        }
    }
    double proj = 3.0 * 2.0 * d * D + 2.0 * D * d;
    if (cfg.gates != titans::GateMode::Constant) {
        proj += 3.0 * 2.0 * d * H;
    }
    const double forward = 2.0 * P;
    const double backward = 2.0 * (P - first);
    const double update = 4.0 * P;  // two products (W and S) per layer, 2 in out each
    double retrieval = 2.0 * P;     // lagged (and both per-token modes): one forward
    if (cfg.update == titans::UpdateMode::Chunked && cfg.retrieval == titans::Retrieval::InChunk) {
        const double pbar = (cfg.chunk + 1) / 2.0;  // average causal prefix, diagonal included
        retrieval = 4.0 * P + pbar * 2.0 * in_sum + pbar * 2.0 * out_sum;
    }
    const double per_token = proj + H * (forward + backward + update + retrieval);
    return per_token * static_cast<double>(B) * static_cast<double>(N);
}

/// FLOP model of one NeuralMemory training step (training forward and backward) over B
/// sequences of N tokens: 3x the forward's model. Each product of the forward is reversed by
/// two of its size (its input's adjoint and its weight's; the memory's own key pass, error
/// and update products as well, math §9): 9 products of b x in x out a chunk and head forward
/// (lagged, depth 2), 18 backward. Work an implementation recomputes (the CUDA backward runs
/// the chunk's key pass and read again: 23 products a chunk, memory_sweep.cuh) is not counted:
/// the model is what the algorithm needs, so its rate over the GEMM rate is the fraction of
/// the machine the step achieves.
inline double memory_training_flops(const MemoryConfig& cfg, int B, long N) {
    return 3.0 * memory_forward_flops(cfg, B, N);
}

}  // namespace titans_bench
