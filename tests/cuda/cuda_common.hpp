#pragma once
// tests/cuda/cuda_common.hpp: what the CUDA tests share beyond test_common.hpp.
//
//   nonfinite_message(f)   the what() of the NonFiniteError f() throws ("" if none)
//   parity_cases(n)        n, capped by TITANS_CUDA_PARITY_CASES (short compute-sanitizer runs)
//   bound<T>()             the parity bound against CPU double: 1e-12 (double), 1e-5 (float)
//   state_tensors(st)      every tensor State::tensors visits, as (name, host copy in double);
//                          the position as a 1 x 1 entry: what a checkpoint would write
//   same_tensors(a, b)     two of those equal: the same names, shapes and bits
//   TiledModeScope         sets the attention's TiledAttentionMode for a scope
//   fused_fits<T>(b, dh, h, ranks), fused_config<T>(modes, rng, ranks)
//                          the shapes the fused chunk kernel takes, and a configuration of them

#include <titans/backend/cuda/attention_tiled.cuh>
#include <titans/backend/cuda/memory_cluster.cuh>

#include "test_common.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace titans_test {

template <class F>
std::string nonfinite_message(F&& f) {
    try {
        f();
    } catch (const titans::NonFiniteError& e) {
        return e.what();
    }
    return "";
}

inline int parity_cases(int cases) {
    if (const char* cap = std::getenv("TITANS_CUDA_PARITY_CASES"); cap != nullptr) {
        return std::min(cases, std::max(1, std::atoi(cap)));
    }
    return cases;
}

/// A parity sweep: parity_cases(cases_per_mode) cases of every primary mode, each
/// `run(base, k, index, rng)` (rng seeded from name and index) returning its error, checked
/// against bound; prints and returns the worst.
template <class Run>
double mode_sweep(const char* name, int cases_per_mode, double bound, Run&& run) {
    cases_per_mode = parity_cases(cases_per_mode);
    int index = 0;
    double worst = 0;
    for (const Modes& base : all_primary_modes()) {
        for (int k = 0; k < cases_per_mode; ++k, ++index) {
            Rng rng(seed_for(name, static_cast<std::uint64_t>(index)));
            const double e = run(base, k, index, rng);
            CHECK(e <= bound);
            worst = std::max(worst, e);
        }
    }
    std::printf("%s: %d cases, worst relative error %.3g (bound %.0e)\n", name, index, worst, bound);
    return worst;
}

/// The parity bound of T's results against CPU double (relative): 1e-12 for double, 1e-5 for
/// float (the same problem rounded to float, run in double).
template <class T>
double bound() {
    return std::is_same_v<T, double> ? 1e-12 : 1e-5;
}

template <class State>
std::vector<std::pair<std::string, Matrixd>> state_tensors(const State& st) {
    std::vector<std::pair<std::string, Matrixd>> out;
    State::tensors(st, [&](const std::string& name, const auto& x) {
        if constexpr (std::is_same_v<std::decay_t<decltype(x)>, std::int64_t>) {
            out.emplace_back(name, Matrixd::Constant(1, 1, static_cast<double>(x)));
        } else {
            out.emplace_back(name, x.template cast<double>());
        }
    });
    return out;
}

inline bool same_tensors(const std::vector<std::pair<std::string, Matrixd>>& a,
                         const std::vector<std::pair<std::string, Matrixd>>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const auto& x, const auto& y) {
        return x.first == y.first && identical(x.second, y.second);
    });
}

/// Sets the process's TiledAttentionMode for a scope, then puts the previous one back.
class TiledModeScope {
public:
    explicit TiledModeScope(titans::backend::cuda::TiledAttentionMode m)
        : old_(titans::backend::cuda::tiled_attention()) {
        titans::backend::cuda::set_tiled_attention(m);
    }
    TiledModeScope(const TiledModeScope&) = delete;
    TiledModeScope& operator=(const TiledModeScope&) = delete;
    ~TiledModeScope() { titans::backend::cuda::set_tiled_attention(old_); }

private:
    titans::backend::cuda::TiledAttentionMode old_;
};

/// Whether the fused kernel takes (b, d_h, h) in T within an H100's 227 KB of shared memory:
/// as one block a pair (ranks 0), or as clusters of `ranks` blocks (memory_cluster.cuh).
template <class T>
bool fused_fits(int b, int dh, int h, int ranks) {
    using titans::backend::cuda::ClusterLayout;
    const long long entries =
        ranks == 0 ? titans::backend::cuda::FusedLayout{b, dh, h}.entries()
        : ClusterLayout::covers(b, dh, h, ranks) ? ClusterLayout::of(b, dh, h, ranks).entries()
                                                 : 1LL << 40;
    return static_cast<std::size_t>(entries) * sizeof(T) <= 232448;
}

/// A configuration the fused chunk kernel takes in T (depth 2, lagged, chunk 32 or 64, d_h 32
/// or 64, expansion 1, 2 or 4, fused_fits, as clusters of `ranks` blocks where that is not 0),
/// the other options from m and drawn as in the parity sweep (conv kernels up to 11).
template <class T>
MemoryConfig fused_config(Modes m, Rng& rng, int ranks = 0) {
    m.retrieval = Retrieval::Lagged;
    m.update = titans::UpdateMode::Chunked;
    Limits lim;
    lim.min_head_dim = 3;
    MemoryConfig c = random_config(m, rng, lim);
    c.depth = 2;
    c.n_heads = uniform_int(rng, 1, 2);
    c.d_model = uniform_int(rng, 8, 48);
    c.conv_kernel = pick(rng, std::vector<int>{1, 2, 4, 4, 11});  // 11: the conv's long path
    do {
        c.d_head = pick(rng, std::vector<int>{32, 32, 64});
        c.expansion = pick(rng, std::vector<int>{1, 2, 4});
        c.chunk = pick(rng, std::vector<int>{32, 32, 64});
    } while (!fused_fits<T>(c.chunk, c.d_head, c.expansion * c.d_head, ranks));
    c.validate();
    return c;
}

}  // namespace titans_test
