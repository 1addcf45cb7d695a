#pragma once
// titans/attention/prefix.hpp: a prefix the attention reads before its window (persistent
// tokens P, MAC's P ‖ h_t): PrefixSharing, PrefixView, AttentionPrefix, and the check of a
// trace's prefix.

#include <cstddef>

#include "../detail/check.hpp"
#include "../types.hpp"
#include "../view.hpp"

namespace titans {

/// How Attention::forward reads its prefix argument.
enum class PrefixSharing {
    Shared,       ///< prefix is p x d, the same rows for every sequence (persistent tokens P)
    PerSequence,  ///< prefix is (B*p) x d stacked sequence-major, rows [b*p, (b+1)*p) for
                  ///< sequence b (e.g. MAC's P ‖ h_t, where h_t differs per sequence)
};

namespace detail {
/// A training trace's prefix (rows x cols, read with `sharing`) as the attention's training
/// forward keeps it for B sequences: d_model wide, a valid sharing and, PerSequence, a
/// multiple of B rows. ShapeError naming the part of the trace otherwise.
inline void check_trace_prefix(int d_model, Eigen::Index rows, Eigen::Index cols,
                               PrefixSharing sharing, int B, const char* where) {
    check_trace_part(cols == d_model, where, "prefix.cols()", cols, concat("d_model = ", d_model));
    const bool shared = sharing == PrefixSharing::Shared;
    check_trace_part(shared || sharing == PrefixSharing::PerSequence, where, "sharing",
                     static_cast<int>(sharing), "Shared (0) or PerSequence (1)");
    check_trace_part(shared || rows % B == 0, where, "prefix.rows()", rows,
                     concat("a multiple of trace.batch = ", B, " (PrefixSharing::PerSequence)"));
}
}  // namespace detail

/// Projected prefix keys and values as the attention kernels read them: k = P W_K and
/// v = P W_V, rows x D views in the backend's memory (rows = p, or B*p with
/// PrefixSharing::PerSequence), visible to every query.
template <class T>
struct PrefixView {
    View<const T> k, v;
    PrefixSharing sharing = PrefixSharing::Shared;
    [[nodiscard]] std::ptrdiff_t rows() const { return k.rows; }
};

/// A prefix projected once on the CPU (Attention::project_prefix): k = P W_K and v = P W_V,
/// rows x D (rows = p, or B*p with PrefixSharing::PerSequence), visible to every query.
template <class T>
struct AttentionPrefix {
    Matrix<T> k, v;
    PrefixSharing sharing = PrefixSharing::Shared;
    [[nodiscard]] Eigen::Index rows() const { return k.rows(); }
    [[nodiscard]] PrefixView<T> view() const { return {view_of(k), view_of(v), sharing}; }
};

}  // namespace titans
