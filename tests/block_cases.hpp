#pragma once
// tests/block_cases.hpp: random block and model cases shared by the block tests and the
// backend tests: parameter casts between float and double, random_block_config /
// random_block_params (every kind, rounded through T) and make_model_case (two layers).
#include "test_common.hpp"

#include <vector>

namespace titans_test {

using titans::AttentionConfig;
using titans::AttentionParams;
using titans::BlockConfig;
using titans::BlockKind;
using titans::BlockParams;
using titans::FeedForwardKind;
using titans::FeedForwardParams;
using titans::ModelConfig;
using titans::ModelParams;

// ---------------------------------------------------------------------------------------------
// Parameter casts.

template <class To, class From>
AttentionParams<To> cast_attention(const AttentionParams<From>& p) {
    AttentionParams<To> r;
    r.w_q = p.w_q.template cast<To>();
    r.w_k = p.w_k.template cast<To>();
    r.w_v = p.w_v.template cast<To>();
    r.w_o = p.w_o.template cast<To>();
    return r;
}

template <class To, class From>
FeedForwardParams<To> cast_ffn(const FeedForwardParams<From>& p) {
    FeedForwardParams<To> r;
    r.w1 = p.w1.template cast<To>();
    r.w3 = p.w3.template cast<To>();
    r.w2 = p.w2.template cast<To>();
    return r;
}

template <class To, class From>
BlockParams<To> cast_block(const BlockParams<From>& p) {
    BlockParams<To> r;
    r.norm_mix = p.norm_mix.template cast<To>();
    r.norm_ffn = p.norm_ffn.template cast<To>();
    r.memory = cast_params<To>(p.memory);
    r.attention = cast_attention<To>(p.attention);
    r.persistent = p.persistent.template cast<To>();
    r.norm_y = p.norm_y.template cast<To>();
    r.norm_m = p.norm_m.template cast<To>();
    r.ffn = cast_ffn<To>(p.ffn);
    return r;
}

template <class To, class From>
ModelParams<To> cast_model(const ModelParams<From>& p) {
    ModelParams<To> r;
    r.embedding = p.embedding.template cast<To>();
    for (const auto& b : p.blocks) r.blocks.push_back(cast_block<To>(b));
    r.norm_final = p.norm_final.template cast<To>();
    r.head = p.head.template cast<To>();
    return r;
}

template <class T>
double round_scalar(double v) {
    return static_cast<double>(static_cast<T>(v));
}

// ---------------------------------------------------------------------------------------------
// Random configurations, parameters and cases.

struct BlockOptions {
    BlockKind kind = BlockKind::MAG;
    int batch = 1;
    bool use_ffn = true;
    int n_persistent = 2;
    Retrieval retrieval = Retrieval::Lagged;
    int d_model = 0;       // 0: drawn from {8, 12, 16}
    int max_tokens = 30;
};

/// A random block configuration: d in {8, 12, 16}, memory H 1-2 (d_head derived or explicit),
/// depth 1-2, random flags / gates / update / chunk 1-4, attention H 1-2 (RoPE on or off),
/// window = segment in 3..7 (MAC: attention.window 1-2, which MAC must not use), FFN SwiGLU or
/// GELU with a small hidden width. Scalars the library rounds to T are rounded here too.
template <class T>
BlockConfig random_block_config(const BlockOptions& o, Rng& rng) {
    BlockConfig c;
    c.kind = o.kind;
    const int d = o.d_model > 0 ? o.d_model : pick(rng, std::vector<int>{8, 12, 16});
    c.d_model = d;
    MemoryConfig& m = c.memory;
    m.d_model = d;
    m.n_heads = uniform_int(rng, 1, 2);
    m.d_head = uniform_int(rng, 0, 2) == 0 ? uniform_int(rng, 2, 5) : 0;
    m.depth = uniform_int(rng, 1, 2);
    m.expansion = pick(rng, std::vector<int>{1, 2, 4});
    const Modes flags = random_flags(Modes{}, rng);
    m.activation = flags.activation;
    m.residual = flags.residual;
    m.use_conv = flags.use_conv;
    m.qkv_activation = flags.qkv_activation;
    m.normalize_qk = flags.normalize_qk;
    m.conv_kernel = uniform_int(rng, 1, 4);
    m.retrieval = o.retrieval;
    m.update = uniform_int(rng, 0, 4) == 0 ? UpdateMode::PerToken : UpdateMode::Chunked;
    switch (uniform_int(rng, 0, 2)) {
        case 0: m.gates = GateMode::DataDependent; break;
        case 1: m.gates = GateMode::Constant; break;
        default:
            m.gates = (o.retrieval == Retrieval::Lagged && m.update == UpdateMode::Chunked)
                          ? GateMode::PerChunk
                          : GateMode::DataDependent;
            break;
    }
    m.theta_max = round_scalar<T>(uniform(rng, 0.02, 0.15));
    m.constant_theta = round_scalar<T>(uniform(rng, 0.02, 0.15));
    m.constant_eta = round_scalar<T>(uniform(rng, 0.0, 0.8));
    m.constant_alpha = round_scalar<T>(uniform(rng, 0.0, 0.3));
    m.momentum = uniform_int(rng, 0, 5) != 0;  // the ablations (Table 5), now and then
    m.forget = uniform_int(rng, 0, 5) != 0;
    m.chunk = pick(rng, std::vector<int>{1, 2, 3, 3, 4, 4});
    AttentionConfig& a = c.attention;
    a.d_model = d;
    a.n_heads = uniform_int(rng, 1, 2);
    a.d_head = uniform_int(rng, 0, 3) == 0 ? pick(rng, std::vector<int>{2, 4}) : 0;
    a.rope = uniform_int(rng, 0, 1) == 1;
    a.rope_base = pick(rng, std::vector<double>{10000.0, 100.0, 10.0});
    const int span = uniform_int(rng, 3, 7);
    a.window = o.kind == BlockKind::MAC ? uniform_int(rng, 1, 2) : span;
    c.segment = span;
    c.n_persistent = o.n_persistent;
    c.use_ffn = o.use_ffn;
    c.ffn.d_model = d;
    c.ffn.kind = uniform_int(rng, 0, 1) == 0 ? FeedForwardKind::SwiGLU : FeedForwardKind::GELU;
    c.ffn.hidden = pick(rng, std::vector<int>{0, 6, 12});
    c.norm_eps = round_scalar<T>(pick(rng, std::vector<double>{1e-6, 1e-5}));
    c.validate();
    return c;
}

/// Random parameters, rounded through T: memory as in test_common's random_params (random gate
/// biases, values of norm about 1), attention and FFN from the library's seeded init, norm
/// weights uniform in [0.5, 1.5] (so that a missing weight is seen), P uniform in [-1.5, 1.5].
template <class T>
BlockParams<double> random_block_params(const BlockConfig& cfg, Rng& rng) {
    BlockParams<double> p = BlockParams<double>::random(cfg, rng());
    const int d = cfg.d_model;
    p.memory = random_params(cfg.memory, rng);
    p.norm_mix = random_matrix(1, d, rng, 0.5, 1.5);
    p.norm_ffn = random_matrix(1, d, rng, 0.5, 1.5);
    if (cfg.kind != BlockKind::LMM) {
        p.persistent = random_matrix(cfg.n_persistent, d, rng, -1.5, 1.5);
    }
    if (cfg.kind == BlockKind::MAG) {
        p.norm_y = random_matrix(1, d, rng, 0.5, 1.5);
        p.norm_m = random_matrix(1, d, rng, 0.5, 1.5);
    }
    return cast_block<double>(cast_block<T>(p));
}

struct ModelCase {
    ModelConfig cfg;
    ModelParams<double> params;
};

/// A 2-layer model of the given kinds, width d, rounded through T.
template <class T>
ModelCase make_model_case(BlockKind k0, BlockKind k1, int d, int vocab, int d_out, Rng& rng) {
    ModelCase m;
    m.cfg.vocab_size = vocab;
    m.cfg.d_model = d;
    m.cfg.d_out = d_out;
    m.cfg.norm_eps = round_scalar<T>(1e-5);
    int layer = 0;
    for (BlockKind k : {k0, k1}) {
        BlockOptions o;
        o.kind = k;
        o.d_model = d;
        o.use_ffn = layer == 0;
        o.n_persistent = 2;
        o.retrieval = k == BlockKind::MAC ? Retrieval::InChunk : Retrieval::Lagged;
        m.cfg.blocks.push_back(random_block_config<T>(o, rng));
        ++layer;
    }
    m.params = ModelParams<double>::random(m.cfg, rng());
    for (std::size_t i = 0; i < m.cfg.blocks.size(); ++i) {
        m.params.blocks[i] = random_block_params<T>(m.cfg.blocks[i], rng);
    }
    m.params.norm_final = random_matrix(1, d, rng, 0.5, 1.5);
    m.params = cast_model<double>(cast_model<T>(m.params));
    return m;
}

/// Cuts of N tokens into pieces, every inner cut where each block's memory (which counts the
/// persistent tokens first for MAG and MAL) is at a chunk boundary, about half of those taken
/// (MAC's cuts fall inside and at the ends of segments); the last piece may end mid-chunk.
inline std::vector<Eigen::Index> chunk_cuts(const std::vector<BlockConfig>& blocks, Eigen::Index N,
                                     Rng& rng) {
    std::vector<Eigen::Index> cuts{0};
    for (Eigen::Index t = 1; t < N; ++t) {
        bool aligned = true;
        for (const BlockConfig& cfg : blocks) {
            if (!titans::has_memory(cfg.kind)) continue;  // SWA: cut anywhere
            const bool fed_p = cfg.kind == BlockKind::MAG || cfg.kind == BlockKind::MAL;
            const Eigen::Index pm = fed_p ? cfg.n_persistent : 0;
            aligned = aligned && (pm + t) % cfg.memory.effective_chunk() == 0;
        }
        if (aligned && uniform_int(rng, 0, 1) == 1) cuts.push_back(t);
        if (aligned && uniform_int(rng, 0, 5) == 0) cuts.push_back(t);  // an empty piece
    }
    cuts.push_back(N);
    if (uniform_int(rng, 0, 5) == 0) cuts.insert(cuts.begin(), 0);  // an empty first piece
    return cuts;
}

/// Cuts of [0, N) anywhere (a memory may be left mid-chunk; the CPU trains from there), empty
/// pieces included: what chunk_cuts draws without the alignment.
inline std::vector<Eigen::Index> any_cuts(Eigen::Index N, Rng& rng) {
    std::vector<Eigen::Index> cuts{0};
    for (Eigen::Index t = 1; t < N; ++t) {
        if (uniform_int(rng, 0, 1) == 1) cuts.push_back(t);
        if (uniform_int(rng, 0, 7) == 0) cuts.push_back(t);  // an empty piece
    }
    cuts.push_back(N);
    return cuts;
}

/// A block training case: a block of `kind` (random_block_config<T>; FFN on unless i % 3 == 1,
/// 0-3 persistent tokens, Lagged retrieval for even i, InChunk for odd), its parameters
/// (random_block_params<T>), B = 1-2 streams of N = 5..max_tokens rows x and dy (rounded
/// through T) and the cuts of a chained training (chunk_cuts).
struct BlockTrainCase {
    BlockConfig cfg;
    BlockParams<double> params;
    int B = 1;
    Eigen::Index N = 0;
    Matrixd x, dy;
    std::vector<Eigen::Index> cuts;
};

template <class T>
BlockTrainCase block_train_case(BlockKind kind, int i, int max_tokens, Rng& rng) {
    BlockTrainCase c;
    BlockOptions o;
    o.kind = kind;
    o.use_ffn = i % 3 != 1;
    o.n_persistent = uniform_int(rng, 0, 3);
    o.retrieval = i % 2 == 0 ? Retrieval::Lagged : Retrieval::InChunk;
    c.cfg = random_block_config<T>(o, rng);
    c.params = random_block_params<T>(c.cfg, rng);
    c.B = uniform_int(rng, 1, 2);
    c.N = uniform_int(rng, 5, max_tokens);
    c.x = round_through<T>(random_matrix(c.B * c.N, c.cfg.d_model, rng, -2.0, 2.0));
    c.dy = round_through<T>(random_matrix(c.B * c.N, c.cfg.d_model, rng));
    c.cuts = chunk_cuts({c.cfg}, c.N, rng);
    return c;
}

inline std::vector<int> random_ids(Rng& rng, int count, int vocab) {
    std::vector<int> ids(static_cast<std::size_t>(count));
    for (int& id : ids) id = uniform_int(rng, 0, vocab - 1);
    return ids;
}

}  // namespace titans_test
