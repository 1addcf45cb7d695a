#pragma once
// titans/train/model_adamw.hpp: ModelAdamW, AdamW over a model's parameters held in one buffer
// of its backend's memory, stepped there in place (math §9, "One parameter buffer").

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../backend/edge.hpp"
#include "../detail/check.hpp"
#include "../detail/flat_tensors.hpp"
#include "../detail/tensor_slots.hpp"
#include "../error.hpp"
#include "../layers/glue.hpp"
#include "../models/backend_scalars.hpp"
#include "../models/model.hpp"
#include "../view.hpp"
#include "adamw.hpp"

namespace titans {

/// AdamW (the host AdamW<T>'s step, bit for bit on the CPU) over a model's parameters, with
/// the parameters and both moments in one buffer each of the backend's memory, laid out as
/// ModelGradients lays out the gradients (ModelParams::tensors order, each tensor row-major),
/// so that a step reads the gradient buffer where the backward left it and nothing crosses to
/// the host. What Trainer steps with; a hand-written loop may too:
///
///     titans::ModelAdamW<float, titans::backend::Cuda> opt(cfg, params, titans::AdamW<float>{});
///     opt.propose(grads.view(), lr);   // step t = steps() + 1 into scratch, checked finite
///     model.set_parameters(opt.proposed(),            // the new values, taken on the device
///                          titans::Model<float, titans::backend::Cuda>::ValueCheck::known_finite);
///     opt.commit();                    // the step taken: O(1), cannot fail
///
/// A step is proposed, then committed: propose computes the new parameters and moments into
/// scratch buffers (three more buffers of the same size) in one pass of the glue kernel adamw,
/// which also says whether every new entry is finite (one scalar back; the tensors' sizes and
/// decay flags went to the backend once, at construction),
/// so that a refused step changes nothing and the caller can act on the new values (give them
/// to the model, compare them across ranks) before taking it. Movable; copyable where the
/// backend's buffers are (the CPU's).
template <class T, class Backend>
class ModelAdamW {
public:
    using Scalar = T;

    /// The optimiser `host` (its settings, steps and moments: none, or one pair for each tensor
    /// of `params`, shaped as it) over `params` (parameters of configuration cfg), both brought
    /// to the backend once. ShapeError unless params fit cfg and the moments are those of its
    /// tensors.
    ModelAdamW(const ModelConfig& cfg, const ModelParams<T>& params, const AdamW<T>& host)
        : adamw_(host.config()), steps_(host.steps()) {
        constexpr const char* where = "ModelAdamW";
        detail::check_fits(params, cfg, where, "params");
        const auto slots = detail::tensor_slots(params, cfg);
        std::vector<detail::AdamWPart> parts;
        Eigen::Index n = 0;
        for (const auto& s : slots) {
            slots_.push_back({s.name, n, s.rows, s.cols});
            parts.push_back({s.size(), adamw_.decays(s.rows, s.cols)});
            n += s.size();
        }
        parts_ = Glue::upload_parts(parts);
        Matrix<T> flat(1, n), m(1, n), v(1, n);
        has_moments_ = !host.moments().empty();
        for (std::size_t i = 0; i < slots.size(); ++i) {
            const Slot& s = slots_[i];
            flat.row(0).segment(s.at, slots[i].size()) = slots[i].array().matrix().transpose();
            if (!has_moments_) continue;
            const auto it = host.moments().find(s.name);
            if (it == host.moments().end() || it->second.m.rows() != s.rows ||
                it->second.m.cols() != s.cols) {
                throw ShapeError(detail::concat(where, ": the optimizer has no moments of '",
                                                s.name, "' shaped ", s.rows, " x ", s.cols,
                                                ", expected the moments of these parameters"));
            }
            m.row(0).segment(s.at, slots[i].size()) = row_of(it->second.m);
            v.row(0).segment(s.at, slots[i].size()) = row_of(it->second.v);
        }
        detail::require<ShapeError>(!has_moments_ || host.moments().size() == slots.size(),
                                    where, "optimizer.moments().size()", host.moments().size(),
                                    detail::concat(slots.size(), " (one per parameter tensor)"));
        if (!has_moments_) {
            m.setZero();
            v.setZero();
        }
        p_ = Transfer::upload(view_of(std::as_const(flat)));
        m_ = Transfer::upload(view_of(std::as_const(m)));
        v_ = Transfer::upload(view_of(std::as_const(v)));
        p1_ = Transfer::allocate(1, n);
        m1_ = Transfer::allocate(1, n);
        v1_ = Transfer::allocate(1, n);
    }

    [[nodiscard]] const AdamWConfig& config() const { return adamw_.config(); }
    /// Steps taken (committed).
    [[nodiscard]] std::int64_t steps() const { return steps_; }
    /// Entries: every parameter's.
    [[nodiscard]] Eigen::Index size() const { return Transfer::view(p_).cols; }
    /// The parameters, 1 x size() in the backend's memory.
    [[nodiscard]] View<const T> params() const { return Transfer::view(p_); }
    /// The new parameters of the step proposed last (unspecified before any).
    [[nodiscard]] View<const T> proposed() const { return Transfer::view(p1_); }

    /// Computes step steps() + 1 at rate lr (AdamW<T>::step's update, tensor by tensor) from
    /// `grads` (1 x size() in the backend's memory: ModelGradients::view()) into scratch;
    /// nothing this object reports changes until commit(). Throws: ConfigError (lr, as
    /// AdamW<T>::next_step), ShapeError (grads not 1 x size()), NonFiniteError (a new moment or
    /// parameter NaN or infinite in T, naming the first tensor and which; a NaN or infinite
    /// gradient shows there).
    void propose(View<const T> grads, double lr) {
        BackendScalars<T, Backend> s;
        propose(grads, lr, s, 0);
        settle(s.read()[0]);
    }

    /// As propose(grads, lr), with nothing back now: AdamW's verdict (1: every new entry
    /// finite, 0: not) is left in slot `slot` of `into`; the step counts as proposed once the
    /// host, having read that slot with the step's other scalars, hands it to settle(). Throws
    /// as propose (ConfigError also for a slot out of range) but NonFiniteError, which settle
    /// throws; nothing changes then.
    void propose(View<const T> grads, double lr, BackendScalars<T, Backend>& into,
                 std::size_t slot) {
        constexpr const char* where = "ModelAdamW::propose";
        proposed_ = false;
        unsettled_.reset();
        const detail::AdamWStep<T> f = AdamW<T>(adamw_.config(), steps_, {}).next_step(lr);
        detail::check_flat_gradient(where, grads, size(), "the gradient buffer");
        Glue::adamw(f, parts_, params(), grads, view(m_), view(v_), Transfer::view(p1_),
                    Transfer::view(m1_), Transfer::view(v1_), into.at(slot, where), slot);
        unsettled_ = f.t;
    }

    /// Takes AdamW's verdict on the step proposed last (the value propose left in its slot):
    /// 1 makes it the proposed step (commit() may take it); anything else throws
    /// NonFiniteError naming the first tensor whose new moment or parameter is not finite, and
    /// the step cannot be taken. ConfigError if no step awaits a verdict.
    void settle(double verdict) {
        constexpr const char* where = "ModelAdamW::propose";
        detail::require<ConfigError>(unsettled_.has_value(), "ModelAdamW::settle",
                                     "a step awaiting its verdict", "none", "propose() first");
        const std::int64_t t = *unsettled_;
        unsettled_.reset();
        if (verdict != 1.0) throw_nonfinite(where);
        proposed_ = true;
        next_steps_ = t;
    }

    /// Takes the step proposed last (the parameters and moments become the proposed ones,
    /// steps() advances): no entry is copied. ConfigError if no step was proposed since the
    /// last commit (or the last proposal was refused).
    void commit() {
        detail::require<ConfigError>(proposed_, "ModelAdamW::commit", "a proposed step", "none",
                                     "propose() first (a refused proposal cannot be taken)");
        std::swap(p_, p1_);
        std::swap(m_, m1_);
        std::swap(v_, v1_);
        steps_ = next_steps_;
        has_moments_ = true;
        proposed_ = false;
    }

    /// The parameters of configuration cfg as host tensors (one download off the host).
    [[nodiscard]] ModelParams<T> params_to_host(const ModelConfig& cfg) const {
        return host_params(params(), cfg);
    }
    /// The proposed parameters as host tensors (one download off the host).
    [[nodiscard]] ModelParams<T> proposed_params(const ModelConfig& cfg) const {
        return host_params(proposed(), cfg);
    }

    /// The optimiser as a host AdamW<T> (settings, steps, the moments by tensor name; none
    /// before a first step): what io::save_optimizer writes. Two downloads off the host.
    [[nodiscard]] AdamW<T> to_host() const {
        std::map<std::string, typename AdamW<T>::Moments> moments;
        if (has_moments_) {
            const Matrix<T> m = download(view(m_)), v = download(view(v_));
            for (const Slot& s : slots_) {
                moments[s.name] = {tensor(m, s), tensor(v, s)};
            }
        }
        return AdamW<T>(adamw_.config(), steps_, std::move(moments));
    }

private:
    using Transfer = backend::Transfer<Backend, T>;
    using Glue = backend::GlueKernels<Backend, T>;
    struct Slot {
        std::string name;
        Eigen::Index at, rows, cols;
    };

    static View<const T> view(const typename Transfer::Buffer& b) { return Transfer::view(b); }
    template <class X>
    static View<X> range(View<X> flat, const Slot& s) {
        return detail::flat_range(flat, s.at, s.rows * s.cols);
    }
    static auto row_of(const Matrix<T>& m) {
        return Eigen::Map<const RowVector<T>>(m.data(), m.size());
    }
    static Matrix<T> download(View<const T> from) {
        Matrix<T> out(1, from.cols);
        Transfer::download(from, view_of(out));
        return out;
    }
    static Matrix<T> tensor(const Matrix<T>& flat, const Slot& s) {
        return Eigen::Map<const Matrix<T>>(flat.data() + s.at, s.rows, s.cols);
    }
    static ModelParams<T> host_params(View<const T> flat, const ModelConfig& cfg) {
        ModelParams<T> p = ModelParams<T>::zeros(cfg);
        backend::copy_to_host<Backend>(flat, p, cfg);
        return p;
    }

    /// NonFiniteError naming the first tensor whose new moment or parameter is not finite.
    [[noreturn]] void throw_nonfinite(const char* where) const {
        for (const Slot& s : slots_) {
            const char* which =
                Glue::nonfinite_row(range(view(m1_), s)) >= 0   ? "the first moment m"
                : Glue::nonfinite_row(range(view(v1_), s)) >= 0 ? "the second moment v (g²)"
                : Glue::nonfinite_row(range(proposed(), s)) >= 0 ? "the parameter"
                                                                 : nullptr;
            if (which != nullptr) {
                throw NonFiniteError(detail::concat(
                    where, ": the step would make ", which, " of '", s.name,
                    "' NaN or infinite in ", detail::scalar_name<T>(), ", expected finite values "
                    "(finite gradients, a smaller lr or weight_decay); nothing changed"));
            }
        }
        throw NonFiniteError(detail::concat(where, ": the step would make an entry NaN or "
                                                   "infinite; nothing changed"));
    }

    AdamW<T> adamw_;  // the settings (its next_step gives the scalars of a step)
    std::int64_t steps_ = 0, next_steps_ = 0;
    bool has_moments_ = false, proposed_ = false;
    std::optional<std::int64_t> unsettled_;  // a proposed step's number, awaiting settle()
    std::vector<Slot> slots_;
    typename Glue::Parts parts_;  // the tensors' sizes and decay (on the backend): adamw's
    typename Transfer::Buffer p_, m_, v_;     // parameters and moments
    typename Transfer::Buffer p1_, m1_, v1_;  // the proposed step's
};

}  // namespace titans
