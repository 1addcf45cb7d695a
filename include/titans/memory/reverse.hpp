#pragma once
// titans/memory/reverse.hpp: NeuralMemory<T, Backend>::Reverse, the memory's backward in stages
// (math §9, "staged reverse"), the public face of the backend's reverse sweep. Included at the
// end of neural_memory.hpp.

#include <optional>
#include <utility>
#include <vector>

#include "neural_memory.hpp"

namespace titans {

/// The backward of a training trace in stages (math §9), for callers whose later inputs depend
/// on the memory mid-stream: rows are reversed from the last down, and between stages the
/// caller adds, with tap, the adjoint of the weights after position() tokens (a read of the
/// memory there: current_weights' values, e.g. read through read_weights, whose backward gives
/// the adjoint). down_to(0) then finish equals NeuralMemory::backward (bit for bit) when
/// nothing is tapped. Backends with the staged API (NeuralMemory::staged: the CPU, CUDA).
///
/// The memory and the trace must outlive the Reverse; dy is copied. A call that throws a
/// ShapeError or ConfigError changes nothing; one that throws NonFiniteError (the gradients
/// overflow) leaves the Reverse spent (later calls throw ConfigError).
///
///     NeuralMemory<double>::Reverse rev(mem, trace, dy);  // dy: dL/dy of the trace's rows
///     Matrixd dx_hi, dx_lo;
///     rev.down_to(p, dx_hi);  // rows [p, N) of every stream: (B*(N-p)) x d_model, final
///     rev.tap(dW);            // dL/d(weights after p tokens), (b, h) at b * H + h
///     rev.down_to(0, dx_lo);
///     rev.finish(grads);      // grads += every parameter's gradient
template <class T, class Backend>
class NeuralMemory<T, Backend>::Reverse {
    using Pass = backend::MemoryTraining<Backend, T>;
    using Layers = std::vector<Matrix<T>>;

public:
    /// trace: filled by the training forward or by begin_trace and forward_part (checked as
    /// validate_trace); dy = dL/dy of its rows (rows x d_model, finite); d_state_out, if given
    /// and not empty, the adjoint of the state the trace's call left (validate_state_gradient).
    Reverse(const NeuralMemory& mem, const Trace& trace, const MatrixRef<T>& dy,
            const MemoryStateGradient<T>* d_state_out = nullptr)
        requires(NeuralMemory::staged)
        : mem_(mem), batch_(trace.batch), rows_(trace.rows()) {
        constexpr const char* where = "NeuralMemory::Reverse";
        mem.validate_trace(trace, where);
        detail::check_gradient_rows(dy, trace.rows(), mem.cfg_.d_model, where, "dy");
        const bool chained = d_state_out != nullptr && !d_state_out->empty();
        if (chained) {
            mem.check_state_gradient(*d_state_out, trace);
        }
        const ThreadScope team(mem.threads_, mem.work_estimate(rows_));
        const detail::DenormalFlushScope flush(mem.cfg_.flush_denormals);
        const backend::Upload<Backend, T> in(dy);
        rev_.emplace(mem.cfg_, mem.prepared_, trace, in.view(), chained ? d_state_out : nullptr);
    }

    /// Rows >= position() of every stream are reversed (the trace's rows per stream at first).
    [[nodiscard]] Eigen::Index position() const { return rev_->position(); }

    /// Reverses rows [p, position()) of every stream: dx (resized) gets dL/dx of those rows,
    /// (B * (position() - p)) x d_model, sequence-major, final. ShapeError unless
    /// 0 <= p <= position().
    void down_to(Eigen::Index p, Matrix<T>& dx) {
        constexpr const char* where = "NeuralMemory::Reverse::down_to";
        require_live(where);
        detail::require<ShapeError>(p >= 0 && p <= position(), where, "p", p,
                                    detail::concat("in [0, position() = ", position(), "]"));
        const ThreadScope team(mem_.threads_, 3.0 * mem_.work_estimate(batch_ * (position() - p)));
        const detail::DenormalFlushScope flush(mem_.cfg_.flush_denormals);
        Matrix<T> dx_new;
        spent_ = true;  // until the sweep is through and its rows finite
        rev_->down_to(p, dx_new);
        if (!detail::all_finite(dx_new)) {
            throw NonFiniteError(detail::concat(where, ": dx overflows, expected finite values "
                                                       "(the Reverse is spent)"));
        }
        spent_ = false;
        dx = std::move(dx_new);
    }

    /// Adds dW (per stream b and head h at b * H + h, the L layer matrices of
    /// current_weights' shapes, finite) to the adjoint of the weights after position() tokens.
    /// ShapeError, NonFiniteError naming dW otherwise.
    void tap(const std::vector<Layers>& dW) {
        constexpr const char* where = "NeuralMemory::Reverse::tap";
        require_live(where);
        mem_.check_weights(dW, batch_, where);
        if (!detail::all_finite_each(dW)) {
            throw NonFiniteError(detail::concat(where, ": dW has a NaN or infinite entry"));
        }
        rev_->tap(dW);
    }

    /// After down_to(0) (ConfigError otherwise, or when called twice): every parameter's
    /// gradient added to grads (shaped as params()), and d_state_in, if given, gets the
    /// adjoint of the state the trace started from, as NeuralMemory::backward gives them.
    /// NonFiniteError if they overflow; grads and d_state_in are unchanged then.
    void finish(MemoryParams<T>& grads, MemoryStateGradient<T>* d_state_in = nullptr) {
        constexpr const char* where = "NeuralMemory::Reverse::finish";
        require_live(where);
        if (position() != 0) {
            throw ConfigError(detail::concat(where, ": position() = ", position(),
                                             ", expected 0 (down_to(0) first)"));
        }
        detail::check_same_tensors(*mem_.params_, grads, mem_.cfg_, where, "grads");
        const detail::DenormalFlushScope flush(mem_.cfg_.flush_denormals);
        MemoryParams<T> local = MemoryParams<T>::zeros(mem_.cfg_);
        MemoryStateGradient<T> d_in;
        spent_ = true;
        rev_->finish(local, d_state_in != nullptr ? &d_in : nullptr);
        if (!detail::tensors_finite(local, mem_.cfg_) || !d_in.finite()) {
            throw NonFiniteError(detail::concat(where, ": the gradients overflow, expected "
                                                       "finite values; grads are unchanged"));
        }
        detail::add_tensors(local, grads, mem_.cfg_);
        if (d_state_in != nullptr) {
            *d_state_in = std::move(d_in);
        }
    }

    // --- The same on views in the backend's memory (how MAC's training pass drives it on a
    // device): dy, dx and the gradients stay there. Finiteness of dy and dx is the caller's.

    /// As the host constructor, dy a view ((trace rows) x d_model, allocated, row-major:
    /// ShapeError naming dy otherwise).
    Reverse(const NeuralMemory& mem, const Trace& trace, View<const T> dy,
            const MemoryStateGradient<T>* d_state_out = nullptr)
        requires(NeuralMemory::staged)
        : mem_(mem), batch_(trace.batch), rows_(trace.rows()) {
        constexpr const char* where = "NeuralMemory::Reverse";
        mem.validate_trace(trace, where);
        detail::check_view_shape(where, "dy", dy, trace.rows(), mem.cfg_.d_model);
        if (d_state_out != nullptr && !d_state_out->empty()) {
            mem.check_state_gradient(*d_state_out, trace);
        }
        const ThreadScope team(mem.threads_, mem.work_estimate(rows_));
        const detail::DenormalFlushScope flush(mem.cfg_.flush_denormals);
        rev_.emplace(mem.cfg_, mem.prepared_, trace, dy,
                     d_state_out != nullptr && !d_state_out->empty() ? d_state_out : nullptr);
    }

    /// down_to with dx a view ((B * (position() - p)) x d_model, written; allocated and
    /// row-major: ShapeError naming dx otherwise, the Reverse unchanged).
    void down_to(Eigen::Index p, View<T> dx) {
        constexpr const char* where = "NeuralMemory::Reverse::down_to";
        require_live(where);
        detail::require<ShapeError>(p >= 0 && p <= position(), where, "p", p,
                                    detail::concat("in [0, position() = ", position(), "]"));
        const Eigen::Index rows = batch_ * (position() - p);
        detail::check_view_shape(where, "dx", dx, rows, mem_.cfg_.d_model);
        const ThreadScope team(mem_.threads_, 3.0 * mem_.work_estimate(rows));
        const detail::DenormalFlushScope flush(mem_.cfg_.flush_denormals);
        rev_->down_to(p, dx);
    }

    /// tap with a snapshot in the backend's memory (batch * n_heads pairs, e.g. from
    /// read_snapshot_backward).
    void tap(const Snapshot& dW) {
        constexpr const char* where = "NeuralMemory::Reverse::tap";
        require_live(where);
        const std::size_t pairs = static_cast<std::size_t>(batch_) *
                                  static_cast<std::size_t>(mem_.cfg_.n_heads);
        detail::require<ShapeError>(dW.pairs() == pairs, where, "dW.pairs()", dW.pairs(),
                                    detail::concat("batch * n_heads = ", pairs));
        rev_->tap(dW);
    }

    /// finish into the memory's flat gradient in the backend's memory (1 x its parameter
    /// count, MemoryParams::tensors order, added to). ConfigError as finish; NonFiniteError if
    /// the gradients overflow (grads and d_state_in unchanged).
    void finish(View<T> grads, MemoryStateGradient<T>* d_state_in = nullptr) {
        constexpr const char* where = "NeuralMemory::Reverse::finish";
        require_live(where);
        if (position() != 0) {
            throw ConfigError(detail::concat(where, ": position() = ", position(),
                                             ", expected 0 (down_to(0) first)"));
        }
        detail::check_flat_gradient(where, grads, mem_.parameter_count(), "the memory's tensors");
        const detail::DenormalFlushScope flush(mem_.cfg_.flush_denormals);
        MemoryStateGradient<T> d_in;
        spent_ = true;
        if (!rev_->finish_flat(grads, d_state_in != nullptr ? &d_in : nullptr)) {
            throw NonFiniteError(detail::concat(where, ": the gradients overflow, expected "
                                                       "finite values; grads are unchanged"));
        }
        if (d_state_in != nullptr) {
            *d_state_in = std::move(d_in);
        }
    }

private:
    void require_live(const char* where) const {
        if (spent_) {
            throw ConfigError(detail::concat(where, ": this Reverse is spent (finished, or a "
                                                    "call overflowed), expected a live one"));
        }
    }

    const NeuralMemory& mem_;
    int batch_;
    Eigen::Index rows_;
    std::optional<typename Pass::Reverse> rev_;
    bool spent_ = false;
};

}  // namespace titans
