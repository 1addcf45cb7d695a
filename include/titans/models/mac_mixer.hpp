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

#include "../attention/segment.hpp"
#include "../backend/backend.hpp"
#include "../error.hpp"
#include "../layers/glue.hpp"
#include "../types.hpp"
#include "block.hpp"

namespace titans::detail {

/// MAC's mixer on a block's state (a friend of Block and BlockState), on views in the backend's
/// memory: the segment buffers and the snapshot live there, the snapshot is read through
/// NeuralMemory::read_snapshot and the segment attended by Attention::segment; nothing crosses
/// to the host.
template <class T, class Backend>
struct MacMixer {
    using Blk = Block<T, Backend>;
    using State = BlockState<T, Backend>;
    using Transfer = backend::Transfer<Backend, T>;
    using Buffer = typename Transfer::Buffer;
    using Glue = backend::GlueKernels<Backend, T>;

    /// o = MAC's mixer of u ((B*N) x d views in the backend's memory), segment part by segment
    /// part [t, t + m) of every stream; advances the segment state and the memory (the block
    /// advances its position).
    static void mix(const Blk& blk, State& st, View<const T> u, View<T> o) {
        const int B = st.batch_, C = blk.cfg_.segment;
        const std::ptrdiff_t N = u.rows / B, d = u.cols;
        std::ptrdiff_t t = 0;
        while (t < N) {
            const std::int64_t pos = st.position_ + t;
            const int off = static_cast<int>(pos % C);
            const int m = static_cast<int>(std::min<std::ptrdiff_t>(C - off, N - t));
            if (off == 0) {  // segment start: remember M_{t-1} (every pair at once)
                save_segment_start(st, pos);
                blk.memory_->snapshot(st.memory_, st.snapshot_);
            }
            save_segment_rows(st, C, 2 * off, 2 * m);
            const std::ptrdiff_t rows = static_cast<std::ptrdiff_t>(B) * m;
            auto part = [&] { return backend::call_scratch<Backend, T>(rows, d); };
            Buffer U = part(), h = part(), y = part(), r = part();
            Glue::copy_rows(u, Transfer::view(U), backend::RowBlocks{B, m, N, t, m, 0});
            // h = M*_{t-1}(S): the memory's query path read through each stream's snapshot.
            blk.memory_->read_snapshot(st.snapshot_, Transfer::view(std::as_const(U)), B,
                                       Transfer::view(h));
            attend(blk, st, std::as_const(U), std::as_const(h), Transfer::view(y), off, m, pos);
            require_finite(blk, Transfer::view(std::as_const(y)), m, pos);
            // Write the memory with y, read the updated memory: o = y ⊙ σ(M*_t(y)).
            blk.memory_->forward(st.memory_, Transfer::view(std::as_const(y)), Transfer::view(r));
            Glue::gate(Transfer::view(std::as_const(y)), Transfer::view(std::as_const(r)),
                       Transfer::view(y));
            Glue::copy_rows(Transfer::view(std::as_const(y)), o, backend::RowBlocks{B, m, m, 0, N, t});
            t += m;
        }
    }

    /// y = MAC's attention for the part's rows U ((B*m) x d, stream-major) at segment offset
    /// off (absolute position pos) with h, the snapshot's read of U (attention/segment.hpp):
    /// keys and values written into the state's segment buffers.
    static void attend(const Blk& blk, State& st, const Buffer& U, const Buffer& h, View<T> y,
                       int off, int m, std::int64_t pos) {
        SegmentCall<T> c;
        c.u = Transfer::view(U);
        c.h = Transfer::view(h);
        c.seg_k = Transfer::view(st.seg_k_);
        c.seg_v = Transfer::view(st.seg_v_);
        c.prefix = PrefixView<T>{Transfer::view(blk.mac_prefix_->k),
                                 Transfer::view(blk.mac_prefix_->v)};
        c.y = y;
        c.batch = st.batch_;
        c.segment = blk.cfg_.segment;
        c.offset = off;
        c.rows = m;
        c.position = pos;
        blk.attention_->segment(c);
    }

    /// NonFiniteError naming the stream and position of the first non-finite row of y (the
    /// segment attention's output, (B*m) x d at position pos); the block rolls back.
    static void require_finite(const Blk& blk, View<const T> y, int m, std::int64_t pos) {
        const std::ptrdiff_t r = Glue::nonfinite_row(y);
        if (r >= 0) {
            throw NonFiniteError(concat(
                "Block (", to_string(blk.cfg_.kind), "): the segment attention's output is not "
                "finite at sequence ", r / m, ", position ", pos + r % m,
                " (a sub-layer overflows), expected finite values; the state is unchanged"));
        }
    }

    /// MAC: before segment rows [lo, lo + n) of every sequence are overwritten.
    static void save_segment_rows(State& st, int C, int lo, int n) {
        auto& u = st.undo_;
        if (!u.open || u.wrapped || lo + n <= u.hi) {
            return;
        }
        const View<const T> k = Transfer::view(std::as_const(st.seg_k_));
        if (!u.sized) {
            u.seg_k = Transfer::allocate(k.rows, k.cols);
            u.seg_v = Transfer::allocate(k.rows, k.cols);
            u.sized = true;
        }
        const backend::RowBlocks rows{k.rows / (2 * C), lo + n - u.hi, 2 * C, u.hi, 2 * C, u.hi};
        Glue::copy_rows(k, Transfer::view(u.seg_k), rows);
        Glue::copy_rows(Transfer::view(std::as_const(st.seg_v_)), Transfer::view(u.seg_v), rows);
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
            using std::swap;
            swap(u.snapshot, st.snapshot_);  // refreshed next, into the undo's old storage
            u.snap_saved = true;
        }
        if (!u.wrapped && pos > u.position) {
            const int hi = u.hi;
            u.hi = 0;
            save_segment_rows(st, st.cfg_.segment, 0, u.row0);
            u.hi = hi;
            u.wrapped = true;
        }
    }

    static void restore_segment(State& st) {
        auto& u = st.undo_;
        if (u.snap_saved) {
            using std::swap;
            swap(st.snapshot_, u.snapshot);
        }
        const int lo = u.wrapped ? 0 : u.row0, C2 = 2 * st.cfg_.segment;
        if (u.sized && u.hi > lo) {
            const View<T> k = Transfer::view(st.seg_k_);
            const backend::RowBlocks rows{k.rows / C2, u.hi - lo, C2, lo, C2, lo};
            Glue::copy_rows(Transfer::view(std::as_const(u.seg_k)), k, rows);
            Glue::copy_rows(Transfer::view(std::as_const(u.seg_v)), Transfer::view(st.seg_v_),
                            rows);
        }
    }
};

}  // namespace titans::detail
