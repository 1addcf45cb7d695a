#pragma once
// titans/attention/segment_check.hpp: the checks of Attention::segment and
// Attention::segment_backward at the API boundary (ShapeError or ConfigError naming the field
// and the expected value, before any kernel runs): the counts of a SegmentCall or a
// SegmentBackwardCall, and every view's shape, layout and distinctness.

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <utility>

#include "../detail/check.hpp"
#include "../detail/flat_tensors.hpp"
#include "../error.hpp"
#include "../view.hpp"
#include "config.hpp"
#include "prefix.hpp"
#include "segment.hpp"
#include "segment_backward.hpp"

namespace titans::detail {

/// The counts of a segment call: batch >= 1, segment >= 1, rows >= 1, offset >= 0,
/// offset + rows <= segment, position >= 0 with room for the part's rows (ConfigError).
inline void check_segment_counts(const char* where, int batch, int segment, int offset, int rows,
                                 std::int64_t position) {
    require<ConfigError>(batch >= 1, where, "batch", batch, "at least 1");
    require<ConfigError>(segment >= 1, where, "segment", segment, "at least 1");
    require<ConfigError>(rows >= 1, where, "rows", rows, "at least 1");
    require<ConfigError>(offset >= 0 && offset <= segment - rows, where, "offset", offset,
                         concat("in [0, segment - rows] = [0, ", segment - rows, "]"));
    require<ConfigError>(position >= 0 &&
                             position <= std::numeric_limits<std::int64_t>::max() - rows,
                         where, "position", position, "a position >= 0 with room for the rows");
}

/// The projected prefix of a segment call: P W_K and P W_V, the same rows, D wide, shared by
/// the streams (ShapeError, ConfigError).
template <class T>
void check_segment_prefix(const char* where, const PrefixView<T>& p, std::ptrdiff_t D) {
    check_view_shape(where, "prefix.k", p.k, p.k.rows, D, p.k.rows == 0);
    check_view_shape(where, "prefix.v", p.v, p.k.rows, D, p.k.rows == 0);
    require<ConfigError>(p.sharing == PrefixSharing::Shared, where, "prefix.sharing",
                         "PerSequence", "Shared (one prefix for every stream)");
}

/// An output view `out` shares no entry with the input `in` (ShapeError).
template <class T>
void check_segment_distinct(const char* where, const char* out_name, View<const T> out,
                            const char* in_name, View<const T> in) {
    if (views_overlap(out, in)) {
        throw ShapeError(concat(where, ": ", out_name, " shares storage with ", in_name,
                                ", expected a distinct matrix"));
    }
}

/// Attention::segment's call: u, h, y (B*m) x d_model, y distinct from u and h; seg_k, seg_v
/// (B*2C) x D, distinct from each other and from u, h, y; the prefix N_p x D, shared.
template <class T>
void check_segment_call(const AttentionConfig& cfg, const SegmentCall<T>& c, const char* where) {
    check_segment_counts(where, c.batch, c.segment, c.offset, c.rows, c.position);
    const std::ptrdiff_t d = cfg.d_model, D = cfg.inner_dim();
    const std::ptrdiff_t rows = std::ptrdiff_t{c.batch} * c.rows;
    const std::ptrdiff_t buffer = std::ptrdiff_t{c.batch} * 2 * c.segment;
    check_view_shape(where, "u", c.u, rows, d);
    check_view_shape(where, "h", c.h, rows, d);
    check_view_shape(where, "y", c.y, rows, d);
    check_view_shape(where, "seg_k", c.seg_k, buffer, D);
    check_view_shape(where, "seg_v", c.seg_v, buffer, D);
    check_segment_prefix(where, c.prefix, D);
    const View<const T> y = c.y, k = c.seg_k, v = c.seg_v;
    check_segment_distinct(where, "y", y, "u", c.u);
    check_segment_distinct(where, "y", y, "h", c.h);
    check_segment_distinct(where, "seg_k", k, "seg_v", v);
    for (const auto& [name, out] : {std::pair{"seg_k", k}, std::pair{"seg_v", v}}) {
        check_segment_distinct(where, name, out, "u", c.u);
        check_segment_distinct(where, name, out, "h", c.h);
        check_segment_distinct(where, name, out, "y", y);
    }
}

/// Every output of a SegmentBackwardCall distinct from every input and from the others.
template <class T>
void check_segment_backward_distinct(const SegmentBackwardCall<T>& c, const char* where) {
    const std::pair<const char*, View<const T>> ins[] = {
        {"u", c.u},           {"h", c.h},           {"dy", c.dy},
        {"kept_k", c.kept_k}, {"kept_v", c.kept_v}, {"after_k", c.after_k},
        {"after_v", c.after_v}, {"prefix.k", c.prefix.k}, {"prefix.v", c.prefix.v},
        {"persistent", c.persistent}};
    const std::pair<const char*, View<const T>> outs[] = {
        {"du", c.du},           {"dh", c.dh},         {"dkept_k", c.dkept_k},
        {"dkept_v", c.dkept_v}, {"grads", c.grads}, {"dpersistent", c.dpersistent}};
    for (std::size_t i = 0; i < std::size(outs); ++i) {
        for (const auto& [name, in] : ins) {
            check_segment_distinct(where, outs[i].first, outs[i].second, name, in);
        }
        for (std::size_t j = i + 1; j < std::size(outs); ++j) {
            check_segment_distinct(where, outs[i].first, outs[i].second, outs[j].first,
                                   outs[j].second);
        }
    }
}

/// Attention::segment_backward's call (SegmentBackwardCall's shapes): the inputs as written
/// there, kept_k, kept_v (B*2o) x D (empty when o = 0), after_k, after_v (B*2(o+m)) x D or
/// both empty, persistent N_p x d (the prefix's rows); the outputs du, dh (B*m) x d,
/// dkept_k, dkept_v (B*2o) x D or both empty, grads 1 x the attention's parameter count,
/// dpersistent N_p x d or empty; every output distinct from every input and from the others.
template <class T>
void check_segment_backward_call(const AttentionConfig& cfg, const SegmentBackwardCall<T>& c,
                                 std::ptrdiff_t parameter_count, const char* where) {
    check_segment_counts(where, c.batch, c.segment, c.offset, c.rows, c.position);
    const std::ptrdiff_t d = cfg.d_model, D = cfg.inner_dim(), np = c.prefix.k.rows;
    const std::ptrdiff_t rows = std::ptrdiff_t{c.batch} * c.rows;
    const std::ptrdiff_t kept = std::ptrdiff_t{c.batch} * 2 * c.offset;
    const std::ptrdiff_t after = std::ptrdiff_t{c.batch} * 2 * (c.offset + c.rows);
    check_view_shape(where, "u", c.u, rows, d);
    check_view_shape(where, "h", c.h, rows, d);
    check_view_shape(where, "dy", c.dy, rows, d);
    check_view_shape(where, "kept_k", c.kept_k, kept, D, kept == 0);
    check_view_shape(where, "kept_v", c.kept_v, kept, D, kept == 0);
    const bool has_after = c.after_k.rows * c.after_k.cols > 0;
    check_view_shape(where, "after_k", c.after_k, after, D, true);
    check_view_shape(where, "after_v", c.after_v, after, D, !has_after);
    check_segment_prefix(where, c.prefix, D);
    check_view_shape(where, "persistent", c.persistent, np, d, np == 0);
    check_view_shape(where, "du", c.du, rows, d);
    check_view_shape(where, "dh", c.dh, rows, d);
    const bool has_dkept = c.dkept_k.rows * c.dkept_k.cols > 0;
    check_view_shape(where, "dkept_k", c.dkept_k, kept, D, true);
    check_view_shape(where, "dkept_v", c.dkept_v, kept, D, !has_dkept);
    check_flat_gradient(where, c.grads, parameter_count, "W_Q, W_K, W_V, W_O");
    check_view_shape(where, "dpersistent", c.dpersistent, np, d, np == 0);
    check_segment_backward_distinct(c, where);
}

}  // namespace titans::detail
