#pragma once
// titans/models/model_parameters.hpp: Model::set_parameters(flat) where the parameters live
// (every layer's prepare_flat, then all adopted) and the host tensors brought back lazily
// (params(), blocks()): detail::ModelParameters, a friend of Model (docs/design.md,
// "Parameters held once").

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "../backend/edge.hpp"
#include "../detail/flat_tensors.hpp"
#include "../detail/tensor_slots.hpp"
#include "../error.hpp"
#include "../layers/glue.hpp"
#include "model.hpp"

namespace titans::detail {

/// The values a set_parameters(flat) took on the backend, which the host tensors take again
/// when next read; shared by the copies of the model.
template <class T, class Backend>
struct ParameterMirror {
    typename backend::Transfer<Backend, T>::Buffer flat;
    std::mutex mutex;
    bool stale = true;
};

/// Model::set_parameters(flat) and the lazy host tensors (a friend of Model).
template <class T, class Backend>
struct ModelParameters {
    using Mdl = Model<T, Backend>;
    using Transfer = backend::Transfer<Backend, T>;
    using Buffer = typename Transfer::Buffer;
    using Glue = backend::GlueKernels<Backend, T>;

    /// Whether every layer family's kernels on this backend take parameters from a flat view
    /// (prepare_flat), on a backend the host cannot read.
    static constexpr bool on_backend =
        !backend::BackendTraits<Backend>::host_accessible &&
        requires(const NeuralMemory<T, Backend>& mem, const Attention<T, Backend>& a,
                 const FeedForward<T, Backend>& ff, const RMSNorm<T, Backend>& n,
                 View<const T> f) {
            mem.prepare_flat(f);
            a.prepare_flat(f);
            ff.prepare_flat(f);
            n.prepare_flat(f);
        };

    /// set_parameters(flat) on the backend, where this model alone holds its parameters:
    /// everything new is made first (a throw changes nothing), then taken; nothing crosses to
    /// the host (the host tensors are brought back by sync_host() when read).
    static void take(Mdl& m, View<const T> flat) {
        const ModelConfig& cfg = m.cfg_;
        const Eigen::Index d = cfg.d_model, vocab = cfg.vocab_size, out = cfg.output_dim();
        // A copy of the values the model keeps (the caller's buffer may change).
        auto mirror = std::make_shared<ParameterMirror<T, Backend>>();
        mirror->flat = copy_on_backend(flat);
        const View<const T> v = Transfer::view(std::as_const(mirror->flat));
        Eigen::Index at = vocab * d;
        std::vector<typename Block<T, Backend>::Staged> staged;
        staged.reserve(m.blocks_.size());
        for (std::size_t i = 0; i < m.blocks_.size(); ++i) {
            const auto& b = m.blocks_[i];
            staged.push_back(b.stage(detail::flat_range(v, at, b.parameter_count())));
            at += b.parameter_count();
        }
        auto norm = m.norm_final_.prepare_flat(detail::flat_range(v, at, d));
        auto edge = std::make_shared<const typename Mdl::Edge>(
            typename Mdl::Edge{copy_on_backend(View<const T>{v.data, vocab, d, d}),
                               copy_on_backend(View<const T>{v.data + at + d, d, out, out})});
        for (std::size_t i = 0; i < m.blocks_.size(); ++i) {
            m.blocks_[i].adopt(std::move(staged[i]));
        }
        m.norm_final_.adopt(std::move(norm));
        m.edge_ = std::move(edge);
        m.mirror_ = std::move(mirror);
    }

    /// A copy of `from` in a buffer of its own, on the backend.
    static Buffer copy_on_backend(View<const T> from) {
        Buffer b = Transfer::allocate(from.rows, from.cols);
        if (from.rows * from.cols > 0) Glue::copy(from, Transfer::view(b));
        return b;
    }

    /// NonFiniteError naming the first tensor of flat (the parameters' layout) with a NaN or
    /// an infinity: one scalar back, one more per tensor only if there is one.
    static void require_finite(const Mdl& m, View<const T> flat, const char* where) {
        if (flat.cols == 0 || Glue::nonfinite_row(flat) < 0) return;
        Eigen::Index at = 0;
        for (const auto& s : detail::tensor_slots(*m.params_, m.cfg_)) {
            if (Glue::nonfinite_row(detail::flat_range(flat, at, s.size())) >= 0) {
                throw NonFiniteError(detail::concat(where, ": flat's '", s.name,
                                                    "' has a NaN or infinite entry, expected "
                                                    "finite values; nothing changed"));
            }
            at += s.size();
        }
    }

    /// Brings the host tensors up to date after set_parameters(flat) took values on the
    /// backend (one download, once, whichever copy of the model asks first).
    static void sync_host([[maybe_unused]] const Mdl& m) {
        if constexpr (!backend::BackendTraits<Backend>::host_accessible) {
            if (!m.mirror_) return;
            const std::lock_guard<std::mutex> lock(m.mirror_->mutex);
            if (!m.mirror_->stale) return;
            backend::copy_to_host<Backend>(Transfer::view(std::as_const(m.mirror_->flat)),
                                           const_cast<ModelParams<T>&>(*m.params_), m.cfg_);
            m.mirror_->stale = false;
        }
    }
};

}  // namespace titans::detail
