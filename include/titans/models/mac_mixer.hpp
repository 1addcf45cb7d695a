#pragma once
// titans/models/mac_mixer.hpp: MAC's mixer (math §7, "MAC"), the forward: per segment S of C
// tokens, h = M*_{t-1}(S) (the memory's query path read through each stream's snapshot of the
// memory at the segment start), y = Attn(P ‖ h ‖ S) W_O over the segment's interleaved keys
// and values, the memory written with y, o = y ⊙ σ(M*_t(y)); and the undo of the segment
// state (keys, values, snapshot) inside a block's transaction. Its training pass is
// mac_training.hpp.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "../attention/kernel.hpp"
#include "../attention/rope.hpp"
#include "../backend/backend.hpp"
#include "../detail/activation.hpp"
#include "../detail/host_map.hpp"
#include "../detail/product.hpp"
#include "../detail/rows.hpp"
#include "../layers/glue.hpp"
#include "../types.hpp"
#include "block.hpp"

namespace titans::detail {

/// MAC's mixer on a block's state (a friend of Block and BlockState). Its segment attention
/// and snapshot reads run on the host: on a host-accessible backend on the views in place,
/// elsewhere u is downloaded and o uploaded (one round trip per call).
template <class T, class Backend>
struct MacMixer {
    using Blk = Block<T, Backend>;
    using State = BlockState<T, Backend>;

    /// o = MAC's mixer of u ((B*N) x d views in the backend's memory); advances the segment
    /// state and the memory (the block advances its position).
    static void mix(const Blk& blk, State& st, View<const T> u, View<T> o) {
        if constexpr (backend::BackendTraits<Backend>::host_accessible) {
            mix_host(blk, st, host_map(u), host_map(o));
        } else {
            Matrix<T> oh(u.rows, u.cols);
            mix_host(blk, st, to_host(u), oh);
            to_backend(oh, o);
        }
    }

    /// The rows of a view on the host (MAC's mixer runs there, forward and training).
    static Matrix<T> to_host(View<const T> v) {
        Matrix<T> h(v.rows, v.cols);
        backend::Transfer<Backend, T>::download(v, view_of(h));
        return h;
    }
    /// Host rows into a view of the backend's memory.
    static void to_backend(const Matrix<T>& h, View<T> to) {
        using Transfer = backend::Transfer<Backend, T>;
        const typename Transfer::Buffer b = Transfer::upload(view_of(h));
        backend::GlueKernels<Backend, T>::copy(Transfer::view(b), to);
    }

    /// MAC over a piece, segment part by segment part [t, t + m) of every stream, into out
    /// ((B*N) x d, host).
    template <class Out>
    static void mix_host(const Blk& blk, State& st, const MatrixRef<T>& u, Out&& out) {
        const int B = st.batch_, C = blk.cfg_.segment;
        const Eigen::Index N = u.rows() / B;
        Eigen::Index t = 0;
        while (t < N) {
            const std::int64_t pos = st.position_ + t;
            const int o = static_cast<int>(pos % C);
            const int m = static_cast<int>(std::min<Eigen::Index>(C - o, N - t));
            if (o == 0) {  // segment start: remember M_{t-1} (every pair at once)
                save_segment_start(st, pos);
                st.snapshot_ = blk.memory_->current_weights(st.memory_);
            }
            save_segment_rows(st, 2 * o, 2 * m);
            const Matrix<T> U = segment_rows(u, B, t, m);  // stream-major rows
            // h = M*_{t-1}(S): the memory's query path read through each stream's snapshot.
            const Matrix<T> y =
                attend(blk, st, U, blk.memory_->read_weights(st.snapshot_, U, B), o, m, pos);
            // Write the memory with y, read the updated memory: o = y ⊙ σ(M*_t(y)).
            const Matrix<T> r = blk.memory_->forward(st.memory_, y);
            for (int b = 0; b < B; ++b) {
                out.middleRows(b * N + t, m) =
                    (y.middleRows(static_cast<Eigen::Index>(b) * m, m).array() *
                     r.middleRows(static_cast<Eigen::Index>(b) * m, m)
                         .unaryExpr([](T v) { return detail::sigmoid(v); })
                         .array())
                        .matrix();
            }
            t += m;
        }
    }

    /// MAC's attention for rows U ((B*m) x d, stream-major) at segment offset o (absolute
    /// position pos) with hrows = h, the snapshot's read of U: q/k/v of U and k/v of h
    /// projected once over all streams, keys and values interleaved into each stream's segment
    /// buffers (h_i, s_i), then y = Attn(q; P ‖ h ‖ s) W_O. Returns y, (B*m) x d.
    static Matrix<T> attend(const Blk& blk, State& st, const Matrix<T>& U, const Matrix<T>& hrows,
                            int o, int m, std::int64_t pos) {
        const BlockConfig& cfg = blk.cfg_;
        const int B = st.batch_, C = cfg.segment;
        const int Ha = cfg.attention.n_heads, dha = cfg.attention.head_dim();
        const Eigen::Index D = cfg.attention.inner_dim();
        const AttentionParams<T>& ap = blk.params_->attention;
        Matrix<T> qs(U.rows(), D), ks(U.rows(), D), vs(U.rows(), D), kh(U.rows(), D),
            vh(U.rows(), D);
        multiply(qs, U, ap.w_q);
        multiply(ks, U, ap.w_k);
        multiply(vs, U, ap.w_v);
        multiply(kh, hrows, ap.w_k);
        multiply(vh, hrows, ap.w_v);
        Matrix<T> att(U.rows(), D);
        for (int b = 0; b < B; ++b) {
            const Eigen::Index r0 = static_cast<Eigen::Index>(b) * m;
            if (cfg.attention.rope) {
                apply_rope<T>(qs.middleRows(r0, m), Ha, dha, pos, cfg.attention.rope_base);
                apply_rope<T>(ks.middleRows(r0, m), Ha, dha, pos, cfg.attention.rope_base);
            }
            Matrix<T>& sk = st.seg_k_[static_cast<std::size_t>(b)];
            Matrix<T>& sv = st.seg_v_[static_cast<std::size_t>(b)];
            for (int i = 0; i < m; ++i) {
                sk.row(2 * (o + i)) = kh.row(r0 + i);
                sv.row(2 * (o + i)) = vh.row(r0 + i);
                sk.row(2 * (o + i) + 1) = ks.row(r0 + i);
                sv.row(2 * (o + i) + 1) = vs.row(r0 + i);
            }
            // Query of token o+i sits at interleaved position 2(o+i)+1 (query stride 2) and
            // sees P, then h_0..h_{o+i} and s_0..s_{o+i}: causal over the segment, h included.
            prefix_window_attention<T>(qs.middleRows(r0, m), blk.k_prefix_, blk.v_prefix_,
                                       sk.topRows(2 * (o + m)), sv.topRows(2 * (o + m)), Ha, dha,
                                       2 * C, 2 * o + 1, att.middleRows(r0, m),
                                       /*query_stride=*/2);
        }
        Matrix<T> y(U.rows(), cfg.d_model);
        multiply(y, att, ap.w_o);
        return y;
    }

    /// MAC: before segment rows [lo, lo + n) of every sequence are overwritten.
    static void save_segment_rows(State& st, int lo, int n) {
        auto& u = st.undo_;
        if (!u.open || u.wrapped || lo + n <= u.hi) {
            return;
        }
        u.seg_k.resize(st.seg_k_.size());
        u.seg_v.resize(st.seg_v_.size());
        for (std::size_t b = 0; b < st.seg_k_.size(); ++b) {
            if (u.seg_k[b].rows() != st.seg_k_[b].rows() || u.seg_k[b].cols() != st.seg_k_[b].cols()) {
                u.seg_k[b].resize(st.seg_k_[b].rows(), st.seg_k_[b].cols());
                u.seg_v[b].resize(st.seg_v_[b].rows(), st.seg_v_[b].cols());
            }
            u.seg_k[b].middleRows(u.hi, lo + n - u.hi) = st.seg_k_[b].middleRows(u.hi, lo + n - u.hi);
            u.seg_v[b].middleRows(u.hi, lo + n - u.hi) = st.seg_v_[b].middleRows(u.hi, lo + n - u.hi);
        }
        u.hi = lo + n;
    }

    /// MAC: at a segment start, before the snapshot is refreshed (and, after the first
    /// segment of the transaction, before rows [0, row0) are reused).
    static void save_segment_start(State& st, std::int64_t pos) {
        auto& u = st.undo_;
        if (!u.open) {
            return;
        }
        if (!u.snap_saved) {
            u.snapshot = st.snapshot_;
            u.snap_saved = true;
        }
        if (!u.wrapped && pos > u.position) {
            const int hi = u.hi;
            u.hi = 0;
            save_segment_rows(st, 0, u.row0);
            u.hi = hi;
            u.wrapped = true;
        }
    }

    static void restore_segment(State& st) {
        auto& u = st.undo_;
        if (u.snap_saved) {
            st.snapshot_.swap(u.snapshot);
        }
        const int lo = u.wrapped ? 0 : u.row0;
        for (std::size_t b = 0; b < u.seg_k.size() && u.hi > lo; ++b) {
            st.seg_k_[b].middleRows(lo, u.hi - lo) = u.seg_k[b].middleRows(lo, u.hi - lo);
            st.seg_v_[b].middleRows(lo, u.hi - lo) = u.seg_v[b].middleRows(lo, u.hi - lo);
        }
    }

};

}  // namespace titans::detail
