#pragma once
// titans/backend/cpu/memory_undo.hpp: transactions over a MemoryState on the CPU (the strong
// exception guarantee of NeuralMemory::forward and of the blocks that call it several times).
//
// A transaction saves what a forward call is about to overwrite, the first time it is about to
// overwrite it: the conv tails and position at the start, per head the pending rows as they
// are reached, and W^s, S^s (with the rows pending at the start) just before the first chunk
// end. Saving is proportional to what the calls touch (a token mid-chunk saves one row per
// pending matrix), and the buffers are allocated once per state. rollback() puts back every
// saved value, so the state is bit-identical to the one at begin(); commit() forgets them.

#include <cstdint>
#include <vector>

#include "memory_state.hpp"

namespace titans::backend {

template <class T>
struct MemoryUndo {
    using State = MemoryState<T>;
    using Head = typename State::Head;
    using HeadUndo = typename State::HeadUndo;
    using Mat = Matrix<T>;

    /// Opens a transaction unless one is open; returns true if this call opened it.
    static bool begin(State& st) {
        auto& u = st.undo_;
        if (u.open) {
            return false;
        }
        u.position = st.position_;
        u.conv_tail.resize(st.conv_tail_.size());
        for (std::size_t i = 0; i < st.conv_tail_.size(); ++i) {
            u.conv_tail[i] = st.conv_tail_[i];
        }
        u.heads.resize(st.heads_.size());
        const int row = st.pending();
        for (HeadUndo& hu : u.heads) {
            hu.all_saved = false;
            hu.saved_hi = row;
        }
        u.open = true;  // only once nothing above can throw (an allocation may)
        return true;
    }

    static void commit(State& st) { st.undo_.open = false; }

    /// Restores everything saved since begin() and closes the transaction (no-op if none).
    static void rollback(State& st) {
        auto& u = st.undo_;
        if (!u.open) {
            return;
        }
        const int row0 = static_cast<int>(u.position % static_cast<std::int64_t>(st.chunk_));
        for (std::size_t i = 0; i < st.heads_.size(); ++i) {
            restore_head(st.heads_[i], u.heads[i], row0);
        }
        for (std::size_t i = 0; i < st.conv_tail_.size(); ++i) {
            st.conv_tail_[i] = u.conv_tail[i];
        }
        st.position_ = u.position;
        u.open = false;
    }

    /// Before pending rows [o, o + m) of head `i` are overwritten.
    static void save_rows(State& st, std::size_t i, int o, int m) {
        HeadUndo& hu = st.undo_.heads[i];
        if (!st.undo_.open || hu.all_saved || o + m <= hu.saved_hi) {
            return;
        }
        copy_rows(hu, st.heads_[i], hu.saved_hi, o + m - hu.saved_hi);
        hu.saved_hi = o + m;
    }

    /// Before W^s, S^s of head `i` change (a chunk end, or any token per token).
    static void save_weights(State& st, std::size_t i) {
        HeadUndo& hu = st.undo_.heads[i];
        if (!st.undo_.open || hu.all_saved) {
            return;
        }
        const Head& hd = st.heads_[i];
        hu.w.resize(hd.w.size());
        hu.s.resize(hd.s.size());
        for (std::size_t l = 0; l < hd.w.size(); ++l) {
            hu.w[l] = hd.w[l];
            hu.s[l] = hd.s[l];
        }
        const int row0 = static_cast<int>(st.undo_.position % static_cast<std::int64_t>(st.chunk_));
        copy_rows(hu, hd, 0, row0);  // rows pending at begin(): the next chunk overwrites them
        hu.all_saved = true;
    }

private:
    static void copy_rows(HeadUndo& hu, const Head& hd, int lo, int n) {
        if (n <= 0) {
            return;
        }
        auto fit = [](Mat& dst, const Mat& src) {
            if (dst.rows() != src.rows() || dst.cols() != src.cols()) {
                dst.resize(src.rows(), src.cols());
            }
        };
        hu.a.resize(hd.a.size());
        hu.delta.resize(hd.delta.size());
        for (std::size_t l = 0; l < hd.a.size(); ++l) {
            fit(hu.a[l], hd.a[l]);
            fit(hu.delta[l], hd.delta[l]);
            hu.a[l].middleRows(lo, n) = hd.a[l].middleRows(lo, n);
            hu.delta[l].middleRows(lo, n) = hd.delta[l].middleRows(lo, n);
        }
        fit(hu.gates, hd.gates);
        hu.gates.middleRows(lo, n) = hd.gates.middleRows(lo, n);
    }

    static void restore_rows(Head& hd, const HeadUndo& hu, int lo, int n) {
        if (n <= 0) {
            return;
        }
        for (std::size_t l = 0; l < hd.a.size(); ++l) {
            hd.a[l].middleRows(lo, n) = hu.a[l].middleRows(lo, n);
            hd.delta[l].middleRows(lo, n) = hu.delta[l].middleRows(lo, n);
        }
        hd.gates.middleRows(lo, n) = hu.gates.middleRows(lo, n);
    }

    static void restore_head(Head& hd, const HeadUndo& hu, int row0) {
        if (hu.all_saved) {
            for (std::size_t l = 0; l < hd.w.size(); ++l) {
                hd.w[l] = hu.w[l];
                hd.s[l] = hu.s[l];
            }
            restore_rows(hd, hu, 0, hu.saved_hi > row0 ? hu.saved_hi : row0);
            return;
        }
        restore_rows(hd, hu, row0, hu.saved_hi - row0);
    }
};

}  // namespace titans::backend
