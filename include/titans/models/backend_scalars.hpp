#pragma once
// titans/models/backend_scalars.hpp: scalars a training step leaves in its backend's memory
// (the loss, the gradient norm, AdamW's verdict), brought to the host together.

#include <cstddef>

#include "../backend/backend.hpp"
#include "../detail/check.hpp"
#include "../error.hpp"
#include "../fwd.hpp"
#include "../layers/glue.hpp"

namespace titans {

/// A few scalars in the backend's memory (backend::scalar_slots of them, all 0 at first), where
/// Model::forward_loss, ModelGradients::clip and ModelAdamW::propose can leave their results
/// (their overloads taking one and a slot) for the host to read together: read() is one
/// download. On the CPU they are plain doubles. This is how a Trainer step on a device brings
/// back its loss, its gradient norm and AdamW's verdict at once.
///
///     titans::BackendScalars<float, titans::backend::Cuda> s;
///     model.forward_loss(state, ids, labels, trace, s, 0);   // the loss stays on the GPU
///     model.backward_loss(trace, grads);
///     grads.clip(1.0, s, 1);                                // the norm too
///     const titans::backend::ScalarValues r = s.read();     // both come back: r[0], r[1]
///
/// Movable, not copyable.
template <class T, class Backend = backend::Cpu>
class BackendScalars {
    using Glue = backend::GlueKernels<Backend, T>;

public:
    using Slots = typename Glue::Scalars;

    BackendScalars() : slots_(Glue::make_scalars()) {}
    BackendScalars(const BackendScalars&) = delete;
    BackendScalars& operator=(const BackendScalars&) = delete;
    BackendScalars(BackendScalars&&) noexcept = default;
    BackendScalars& operator=(BackendScalars&&) noexcept = default;

    /// Every slot, as the kernels left them (one download).
    [[nodiscard]] backend::ScalarValues read() const { return Glue::read(slots_); }

    /// The slots for a glue kernel; ConfigError naming `where` unless slot < scalar_slots.
    Slots& at(std::size_t slot, const char* where) {
        detail::require<ConfigError>(slot < backend::scalar_slots, where, "slot", slot,
                                     detail::concat("< ", backend::scalar_slots));
        return slots_;
    }

private:
    Slots slots_;
};

}  // namespace titans
