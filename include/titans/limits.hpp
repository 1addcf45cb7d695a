#pragma once
// titans/limits.hpp: the documented upper limit of every configuration field, the allocation
// budget, the position limit, and the checked 64-bit size arithmetic behind them
// (docs/errors.md, "Limits").
//
// Every config's validate() checks each field against its limit here (ConfigError naming the
// field, its value and the range), then computes every derived size (widths, parameter and
// state element counts, workspaces) in 64 bits and refuses a configuration whose parameters or
// batch-1 state would need more than max_allocation_bytes. make_state(batch) refuses a batch
// whose state would. All of this happens before anything is allocated, so a bad configuration
// is a ConfigError, never std::bad_alloc, std::length_error or a silent integer wrap.
//
// With the field limits every derived int width stays far below INT_MAX (d_h * e <= 2^22,
// H * d_h <= 2^28, 3 * H * d_h < 2^30, 2 * C <= 2^21), so the configs' int accessors
// (head_dim(), hidden_dim(), inner_dim(), ...) cannot overflow on a validated configuration.

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "error.hpp"

namespace titans::limits {

// --- Field limits (inclusive upper bounds; lower bounds are in each validate()). ------------
inline constexpr int max_d_model = 1 << 16;         ///< d_model of every config (65536)
inline constexpr int max_heads = 1 << 12;           ///< n_heads (memory, attention): 4096
inline constexpr int max_head_dim = 1 << 16;        ///< d_head, explicit or d_model / n_heads
inline constexpr int max_depth = 64;                ///< memory depth L
inline constexpr int max_expansion = 64;            ///< memory expansion e
inline constexpr int max_conv_kernel = 1 << 12;     ///< memory conv_kernel K: 4096
inline constexpr int max_chunk = 1 << 14;           ///< memory chunk b: 16384 (b x b workspaces)
inline constexpr int max_window = 1 << 24;          ///< attention window w
inline constexpr int max_segment = 1 << 20;         ///< MAC segment C
inline constexpr int max_persistent = 1 << 20;      ///< n_persistent N_p (and PersistentMemory)
inline constexpr int max_ffn_hidden = 1 << 22;      ///< FeedForwardConfig::hidden
inline constexpr int max_vocab = 1 << 26;           ///< ModelConfig::vocab_size
inline constexpr int max_d_out = 1 << 26;           ///< ModelConfig::d_out
inline constexpr int max_blocks = 1 << 12;          ///< ModelConfig::blocks.size(): 4096
inline constexpr int max_batch = 1 << 20;           ///< make_state(batch)

/// The largest position (tokens seen per sequence) any state may reach: a forward call that
/// would take a position past it throws ConfigError; titans::io rejects a checkpoint holding
/// one. 2^62 leaves every position sum in the library (position + tokens of a piece) in range.
inline constexpr std::int64_t max_position = std::int64_t{1} << 62;

/// The allocation budget, 16 GiB: the parameters of one object (a NeuralMemory, Attention,
/// FeedForward, Block or Model, counted with their scalar size), and the state of one
/// make_state(batch) call, may need at most this many bytes. validate() (no scalar type)
/// counts 4 bytes per element (float); the typed checks (constructors, Params<T>::random /
/// zeros, make_state) count sizeof(T).
inline constexpr std::int64_t max_allocation_bytes = std::int64_t{16} << 30;

/// Bookkeeping counted per matrix of a state (Eigen object, vector slot, allocator header), so
/// that a state of many tiny matrices is budgeted too.
inline constexpr std::int64_t matrix_overhead_bytes = 64;

// A memory state holds at least 12 matrices per (sequence, head), so a state within the budget
// has fewer than INT_MAX (sequence, head) pairs: the int loops over B * H cannot overflow.
static_assert(max_allocation_bytes / (12 * matrix_overhead_bytes) <=
              std::numeric_limits<int>::max());

}  // namespace titans::limits

namespace titans::detail {

// --- Checked 64-bit size arithmetic. --------------------------------------------------------

/// a * b for sizes (negative operands count as 0), saturating at INT64_MAX: a saturated size is
/// always over the budget, so a size computed this way can be compared, never wraps.
[[nodiscard]] constexpr std::int64_t sat_mul(std::int64_t a, std::int64_t b) noexcept {
    constexpr std::int64_t top = std::numeric_limits<std::int64_t>::max();
    if (a <= 0 || b <= 0) return 0;
    return a > top / b ? top : a * b;
}
/// a + b for sizes (negative operands count as 0), saturating at INT64_MAX.
[[nodiscard]] constexpr std::int64_t sat_add(std::int64_t a, std::int64_t b) noexcept {
    constexpr std::int64_t top = std::numeric_limits<std::int64_t>::max();
    if (a < 0) a = 0;
    if (b < 0) b = 0;
    return a > top - b ? top : a + b;
}
template <class... R>
[[nodiscard]] constexpr std::int64_t sat_mul(std::int64_t a, std::int64_t b, std::int64_t c,
                                             R... rest) noexcept {
    return sat_mul(sat_mul(a, b), c, rest...);
}
template <class... R>
[[nodiscard]] constexpr std::int64_t sat_add(std::int64_t a, std::int64_t b, std::int64_t c,
                                             R... rest) noexcept {
    return sat_add(sat_add(a, b), c, rest...);
}

/// a * b, or ConfigError "<where>: <what> = a * b overflows 64 bits".
[[nodiscard]] inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* where,
                                              const char* what) {
    constexpr std::int64_t hi = std::numeric_limits<std::int64_t>::max();
    constexpr std::int64_t lo = std::numeric_limits<std::int64_t>::min();
    const bool overflow = a != 0 && b != 0 &&
                          ((a > 0) == (b > 0) ? (a > 0 ? a > hi / b : a < hi / b)
                                              : (a > 0 ? b < lo / a : a < lo / b));
    if (overflow) {
        throw ConfigError(concat(where, ": ", what, " = ", a, " * ", b,
                                 " overflows 64 bits, expected a representable size"));
    }
    return a * b;
}
/// a + b, or ConfigError "<where>: <what> = a + b overflows 64 bits".
[[nodiscard]] inline std::int64_t checked_add(std::int64_t a, std::int64_t b, const char* where,
                                              const char* what) {
    constexpr std::int64_t hi = std::numeric_limits<std::int64_t>::max();
    constexpr std::int64_t lo = std::numeric_limits<std::int64_t>::min();
    if ((b > 0 && a > hi - b) || (b < 0 && a < lo - b)) {
        throw ConfigError(concat(where, ": ", what, " = ", a, " + ", b,
                                 " overflows 64 bits, expected a representable size"));
    }
    return a + b;
}
/// v as an int, or ConfigError "<where>: <what> = v, expected <= INT_MAX".
[[nodiscard]] inline int checked_int(std::int64_t v, const char* where, const char* what) {
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
        throw ConfigError(
            concat(where, ": ", what, " = ", v, ", expected a value that fits an int"));
    }
    return static_cast<int>(v);
}

// --- Field checks. ---------------------------------------------------------------------------

/// ConfigError "<where>: <field> = v, expected an integer in [lo, hi]<note>" unless lo <= v <= hi.
inline void require_in_range(std::int64_t v, std::int64_t lo, std::int64_t hi, const char* where,
                             const char* field, const char* note = "") {
    if (v < lo || v > hi) {
        throw ConfigError(concat(where, ": ", field, " = ", v, ", expected an integer in [", lo,
                                 ", ", hi, "]", note));
    }
}

/// The head shape shared by every layer with heads: d_model, n_heads and d_head in range, and
/// d_model a multiple of n_heads when d_head is 0 (the head width is then d_model / n_heads).
inline void require_head_shape(std::int64_t d_model, std::int64_t n_heads, std::int64_t d_head,
                               const char* where) {
    require_in_range(d_model, 1, limits::max_d_model, where, "d_model");
    require_in_range(n_heads, 1, limits::max_heads, where, "n_heads");
    require_in_range(d_head, 0, limits::max_head_dim, where, "d_head",
                     " (0 means d_model / n_heads)");
    if (d_head == 0 && d_model % n_heads != 0) {
        require<ConfigError>(false, where, "d_model", d_model,
                             concat("a multiple of n_heads = ", n_heads, " when d_head = 0"));
    }
}

/// "float" or "double".
template <class T>
[[nodiscard]] constexpr const char* scalar_name() noexcept {
    return std::is_same_v<T, float> ? "float" : std::is_same_v<T, double> ? "double" : "T";
}

/// True if the double v survives conversion to T: finite, |v| <= the largest T, and either 0 or
/// at least the smallest normal T (so it neither overflows to infinity nor flushes to zero).
template <class T>
[[nodiscard]] inline bool representable(double v) noexcept {
    const double a = std::abs(v);
    return std::isfinite(v) && a <= static_cast<double>(std::numeric_limits<T>::max()) &&
           (v == 0 || a >= static_cast<double>(std::numeric_limits<T>::min()));
}

/// ConfigError "<where>: <field> = v, expected a value representable in T (...)" unless
/// representable<T>(v).
template <class T>
void require_representable(double v, const char* where, const char* field) {
    if (!representable<T>(v)) {
        throw ConfigError(concat(where, ": ", field, " = ", v,
                                 ", expected a finite value representable in ", scalar_name<T>(),
                                 " (0 or ", static_cast<double>(std::numeric_limits<T>::min()),
                                 " <= |value| <= ",
                                 static_cast<double>(std::numeric_limits<T>::max()), ")"));
    }
}

// --- The allocation budget. ------------------------------------------------------------------

/// ConfigError "<where>: <what> = <bytes> bytes (<scalar>), expected at most
/// max_allocation_bytes = ... (16 GiB)<hint>" unless bytes <= limits::max_allocation_bytes.
inline void require_budget(std::int64_t bytes, const char* where, const char* what,
                           const char* scalar, const std::string& hint = "") {
    if (bytes > limits::max_allocation_bytes) {
        throw ConfigError(concat(where, ": ", what, " = ", bytes, " bytes (", scalar,
                                 "), expected at most max_allocation_bytes = ",
                                 limits::max_allocation_bytes, " (16 GiB, titans/limits.hpp)",
                                 hint.empty() ? "" : "; ", hint));
    }
}

/// The entry check of make_state(batch): batch in [1, max_batch] and the state's bytes
/// (computed by `bytes(batch)`, in 64 bits) within the budget; ConfigError naming `batch`.
template <class Bytes>
void require_state_batch(const char* where, int batch, const char* scalar, Bytes&& bytes) {
    require_in_range(batch, 1, limits::max_batch, where, "batch");
    const std::int64_t need = bytes(static_cast<std::int64_t>(batch));
    if (need > limits::max_allocation_bytes) {
        throw ConfigError(concat(where, ": batch = ", batch, ", expected a batch whose state fits ",
                                 "max_allocation_bytes = ", limits::max_allocation_bytes,
                                 " (16 GiB, titans/limits.hpp); this one needs ", need,
                                 " bytes (", scalar, ")"));
    }
}

// --- Positions. ------------------------------------------------------------------------------

/// The entry check of a forward call that advances a stream at `position` by rows / batch
/// tokens: ConfigError "<where>: position = p + n tokens, expected at most max_position = 2^62"
/// if the position after the call (plus `reserve`, tokens the call may add on top, such as
/// persistent tokens counted by inner states) would pass limits::max_position. A batch < 1 or
/// negative rows is left to the caller's state and shape checks.
inline void check_position_advance(const char* where, std::int64_t position, std::int64_t rows,
                                   std::int64_t batch, std::int64_t reserve = 0) {
    if (batch < 1 || rows < 0) return;
    const std::int64_t n = rows / batch;
    constexpr std::int64_t top = limits::max_position;
    if (position < 0 || reserve < 0 || position > top || reserve > top - position ||
        n > top - position - reserve) {
        throw ConfigError(concat(where, ": position = ", position, " + ", n,
                                 " tokens, expected a position that stays at most max_position = "
                                 "2^62 (titans/limits.hpp)"));
    }
}

}  // namespace titans::detail
