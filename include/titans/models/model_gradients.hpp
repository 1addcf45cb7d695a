#pragma once
// titans/models/model_gradients.hpp: a model's parameter gradients in one buffer of its
// backend's memory (math §9, "One gradient buffer").

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../backend/edge.hpp"
#include "../detail/check.hpp"
#include "../detail/tensor_slots.hpp"
#include "../error.hpp"
#include "../fwd.hpp"
#include "../layers/glue.hpp"
#include "../view.hpp"
#include "backend_scalars.hpp"
#include "model.hpp"

namespace titans {

/// The gradients of every parameter of a Model in one buffer of its backend's memory: the
/// tensors ModelParams::tensors visits (embedding, blocks.{i}.*, norm_final, head), row-major,
/// one after the other (1 x size()). Model::backward and backward_loss add to it on the
/// backend, with nothing crossing to the host; norm() and clip() run there too (the norm comes
/// back, one scalar, or stays there in a BackendScalars); to_params() / add_to() bring it to
/// the host in one download. What a data-parallel step all-reduces.
///
///     titans::ModelGradients<float, titans::backend::Cuda> grads(model);   // zeros
///     const double loss = model.forward_loss(state, ids, labels, trace);
///     model.backward_loss(trace, grads);
///     const double norm = grads.clip(1.0);          // global-norm clipping, on the GPU
///     titans::ModelParams<float> g = grads.to_params();
///
/// The layout is fixed by the configuration and the model's tensor shapes at construction;
/// a model of another configuration is refused by backward (ShapeError). Movable (copyable
/// where the backend's buffers are: the CPU's).
template <class T, class Backend>
class ModelGradients {
public:
    using Scalar = T;

    /// Zeros for the parameters of `model`.
    explicit ModelGradients(const Model<T, Backend>& model)
        : ModelGradients(model.config(), *model.params_) {}

    /// Zeros for parameters of configuration cfg shaped as `shapes` (ShapeError unless they
    /// fit cfg).
    ModelGradients(const ModelConfig& cfg, const ModelParams<T>& shapes) : cfg_(cfg) {
        detail::check_fits(shapes, cfg, "ModelGradients", "shapes");
        Eigen::Index at = 0;
        for (const auto& s : detail::tensor_slots(shapes, cfg)) {
            slots_.push_back({s.name, at, s.rows, s.cols});
            parts_.push_back(s.size());
            at += s.size();
        }
        buffer_ = Transfer::allocate(1, at);
        zero();
    }

    [[nodiscard]] const ModelConfig& config() const { return cfg_; }
    /// Entries: every parameter's.
    [[nodiscard]] Eigen::Index size() const { return Transfer::view(buffer_).cols; }
    /// The whole buffer, 1 x size(), in the backend's memory.
    [[nodiscard]] View<T> view() { return Transfer::view(buffer_); }
    [[nodiscard]] View<const T> view() const { return Transfer::view(buffer_); }

    /// Every entry 0 (on the backend).
    void zero() { Glue::fill(view(), T(0)); }

    /// Calls v(name, view) for every tensor, in ModelParams::tensors order, view its rows x
    /// cols row-major View in the backend's memory (View<const T> when const).
    template <class V>
    void tensors(V&& v) {
        for (const Slot& s : slots_) v(s.name, View<T>{view().data + s.at, s.rows, s.cols, s.cols});
    }
    template <class V>
    void tensors(V&& v) const {
        for (const Slot& s : slots_) {
            v(s.name, View<const T>{view().data + s.at, s.rows, s.cols, s.cols});
        }
    }

    /// The gradients as host tensors (one download).
    [[nodiscard]] ModelParams<T> to_params() const {
        ModelParams<T> p = ModelParams<T>::zeros(cfg_);
        backend::add_to_host<Backend>(view(), p, cfg_);
        return p;
    }
    /// grads += these gradients, tensor by tensor (one download). ShapeError unless grads has
    /// this layout's tensors; NonFiniteError if grads has a NaN or infinite entry.
    void add_to(ModelParams<T>& grads) const {
        check_host(grads, "ModelGradients::add_to");
        backend::add_to_host<Backend>(view(), grads, cfg_);
    }

    /// The Euclidean norm of every entry (gradient_norm's value, computed on the backend: on
    /// the CPU the same bits as gradient_norm(to_params(), config())); +inf or NaN if an entry
    /// is. One scalar back.
    [[nodiscard]] double norm() const {
        BackendScalars<T, Backend> s;
        // max_norm 0: the kernel only reads the entries
        Glue::clip(const_cast<ModelGradients&>(*this).view(), parts_, 0.0, s.at(0, "norm"), 0);
        return s.read()[0];
    }

    /// Every entry *= factor (on the backend; factor finite, representable in T: ConfigError
    /// otherwise).
    void scale(double factor) {
        detail::require<ConfigError>(std::isfinite(factor), "ModelGradients::scale", "factor",
                                     factor, "a finite value");
        detail::require_representable<T>(factor, "ModelGradients::scale", "factor");
        Glue::scale(view(), static_cast<T>(factor));
    }

    /// Global gradient-norm clipping on the backend, as clip_gradient_norm: if norm() exceeds
    /// max_norm, every entry is scaled by max_norm / norm. Returns the norm before clipping
    /// (one scalar back). Throws, nothing changed: ConfigError (max_norm not finite and > 0,
    /// or not representable in T), NonFiniteError (an entry NaN or infinite, or a norm beyond
    /// the largest double).
    double clip(double max_norm) {
        constexpr const char* where = "ModelGradients::clip";
        detail::require<ConfigError>(std::isfinite(max_norm) && max_norm > 0, where, "max_norm",
                                     max_norm, "a finite value > 0");
        BackendScalars<T, Backend> s;
        clip(max_norm, s, 0);
        const double norm = s.read()[0];
        require_finite_norm(norm, where);
        return norm;
    }

    /// As clip(max_norm), with max_norm 0 for the norm alone, and nothing back now: the norm
    /// before clipping is left in slot `slot` of `into`, for the host to read with the step's
    /// other scalars and hand to require_finite_norm. A NaN or infinite norm scales nothing.
    /// ConfigError (max_norm not finite and >= 0 or not representable in T, slot out of
    /// range), nothing changed.
    void clip(double max_norm, BackendScalars<T, Backend>& into, std::size_t slot) {
        constexpr const char* where = "ModelGradients::clip";
        detail::require<ConfigError>(std::isfinite(max_norm) && max_norm >= 0, where, "max_norm",
                                     max_norm, "a finite value >= 0 (0: the norm alone)");
        detail::require_representable<T>(max_norm, where, "max_norm");
        Glue::clip(view(), parts_, max_norm, into.at(slot, where), slot);
    }

    /// NonFiniteError naming `where` unless `norm` (what clip left) is finite: "a NaN or
    /// infinite entry", or, every entry finite, "a norm beyond the largest double" (then one
    /// more scalar back to tell which).
    void require_finite_norm(double norm, const char* where) const {
        if (std::isfinite(norm)) return;
        if (Glue::nonfinite_row(view()) >= 0) {
            throw NonFiniteError(detail::concat(where, ": the gradients have a NaN or infinite "
                                                       "entry; nothing changed"));
        }
        throw NonFiniteError(detail::concat(where, ": the norm of the gradients exceeds the "
                                                   "largest double (every entry finite); "
                                                   "nothing changed"));
    }

    /// ShapeError unless this buffer has the layout of `model`'s parameters (what backward
    /// checks).
    void check_layout(const Model<T, Backend>& model, const char* where) const {
        const auto slots = detail::tensor_slots(*model.params_, model.config());
        bool same = slots.size() == slots_.size();
        for (std::size_t i = 0; same && i < slots.size(); ++i) {
            same = slots[i].name == slots_[i].name && slots[i].rows == slots_[i].rows &&
                   slots[i].cols == slots_[i].cols;
        }
        if (!same) {
            throw ShapeError(detail::concat(where, ": grads are laid out for other parameters (",
                                            slots_.size(), " tensors, ", size(),
                                            " entries), expected this model's (", slots.size(),
                                            " tensors); make them with ModelGradients(model)"));
        }
    }

private:
    using Transfer = backend::Transfer<Backend, T>;
    using Glue = backend::GlueKernels<Backend, T>;
    struct Slot {
        std::string name;
        Eigen::Index at, rows, cols;
    };

    void check_host(const ModelParams<T>& grads, const char* where) const {
        const ModelParams<T> zeros = ModelParams<T>::zeros(cfg_);
        detail::check_same_tensors(zeros, grads, cfg_, where, "grads");
    }

    ModelConfig cfg_;
    std::vector<Slot> slots_;
    std::vector<std::ptrdiff_t> parts_;  // the tensors' sizes, what clip's norm sums by
    typename Transfer::Buffer buffer_;
};

}  // namespace titans
