#pragma once
// titans/backend/cuda/attention_rope.cuh: RoPE fused into the launch that moves a piece's keys
// and values (math §6: the rotation of q and k at each row's absolute position).

#include <cstdint>
#include <limits>

#include "../../attention/attention_row.hpp"
#include "../../attention/config.hpp"
#include "launch.cuh"

namespace titans::backend::cuda {

#if TITANS_CUDA_DEVICE_CODE

/// `then` (AppendWindow, SegmentAppend: rows x D elements r D + c) over a piece's keys and
/// values, in one launch with RoPE when cfg.rope: the q and k parts of qkv (rows x 3D, row r
/// at position pos + r mod N) rotated in place, each thread its pair of q and k before `then`
/// moves that pair (detail::RopeThen). The same values as a RoPE pass, then `then`'s. Past
/// 2^32 - 1 entries each() throws before anything runs.
template <class T, class A>
void rope_then(const AttentionConfig& cfg, cudaStream_t sm, T* qkv, long long rows, long long N,
               std::int64_t pos, const A& then) {
    const long long D = cfg.inner_dim();
    if (!cfg.rope || rows * D > static_cast<long long>(std::numeric_limits<unsigned>::max())) {
        each(sm, rows * D, then);
        return;
    }
    const int H = cfg.n_heads, dh = cfg.head_dim();
    each(sm, rows * H * (dh / 2),
         detail::RopeThen<T, A>{detail::RopeQK<T>{qkv, N, D, H, dh, pos, cfg.rope_base}, then});
}

#endif

}  // namespace titans::backend::cuda
