#pragma once
// titans/train/data_parallel.hpp: the data-parallel part of a Trainer's step (math §9, "One
// gradient buffer"): each rank's shard of the batch, the fingerprints the ranks compare, and
// the combination of the ranks' gradients and losses (one sum of the gradient buffer).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../backend/backend.hpp"
#include "../detail/check.hpp"
#include "../detail/fnv1a.hpp"
#include "../detail/tensor_slots.hpp"
#include "../error.hpp"
#include "../view.hpp"
#include "../models/model.hpp"
#include "../models/model_gradients.hpp"
#include "adamw.hpp"
#include "communicator.hpp"

namespace titans::detail {

/// A rank's sequences of a batch: [first, first + count).
struct Shard {
    int first = 0, count = 0;
};

/// Rank r of n takes sequences [r * batch / n, (r + 1) * batch / n): every rank at least one
/// when batch >= n, the counts differing by at most one.
[[nodiscard]] inline Shard shard_of(int batch, int rank, int ranks) {
    const auto at = [&](int r) {
        return static_cast<int>(static_cast<std::int64_t>(batch) * r / ranks);
    };
    return {at(rank), at(rank + 1) - at(rank)};
}

/// Adds a value of a settings visitor (arithmetic, bool or enum) to a fingerprint.
class SettingsPrint {
public:
    template <class V>
    void operator()(const std::string& name, const V& v) {
        add_setting(h_, name, v);
    }
    Fnv1a& hash() { return h_; }

private:
    Fnv1a h_;
};

/// The fingerprint of every tensor of p (names, shapes and bytes).
template <class Params, class Config>
void print_tensors(Fnv1a& h, const Params& p, const Config& cfg) {
    for (const auto& s : tensor_slots(p, cfg)) {
        const std::int64_t shape[2] = {s.rows, s.cols};
        h.update(s.name);
        h.update(shape, sizeof shape);
        h.update(s.data, static_cast<std::size_t>(s.size()) * sizeof(*s.data));
    }
}

/// The fingerprint of an optimiser's steps and moments and of a data position.
template <class T>
[[nodiscard]] std::uint64_t optimizer_print(const AdamW<T>& opt, std::int64_t position) {
    Fnv1a h;
    const std::int64_t counts[2] = {opt.steps(), position};
    h.update(counts, sizeof counts);
    for (const auto& [name, mo] : opt.moments()) {
        h.update(name);
        h.update(mo.m.data(), static_cast<std::size_t>(mo.m.size()) * sizeof(T));
        h.update(mo.v.data(), static_cast<std::size_t>(mo.v.size()) * sizeof(T));
    }
    return h.value();
}

/// The fingerprint of a step's arguments: the batch, the ids and the labels.
[[nodiscard]] inline std::uint64_t batch_print(std::span<const int> ids,
                                               std::span<const int> labels, int batch) {
    Fnv1a h;
    h.update(&batch, sizeof batch);
    h.update(ids.data(), ids.size_bytes());
    h.update(labels.data(), labels.size_bytes());
    return h.value();
}

/// The whole batch's gradients and loss from each rank's: a rank's are those of the mean over
/// its own scored labels (mine of them, of all in the batch), so each is weighted by
/// mine / all before one sum of the gradient buffer over the ranks (the same bits on every
/// rank); the loss likewise. The buffer is summed where it lives: in host memory on a backend
/// the host reads, in the device's with a device communicator (NCCL's, device_memory()); a
/// backend and communicator that cannot meet run one rank only (Trainer::set_communicator
/// refuses more).
template <class T, class Backend>
[[nodiscard]] double combine(Communicator& comm, ModelGradients<T, Backend>& grads,
                             double loss, std::int64_t mine, std::int64_t all) {
    constexpr bool host = backend::BackendTraits<Backend>::host_accessible;
    const double share = all > 0 ? static_cast<double>(mine) / static_cast<double>(all) : 0.0;
    if (comm.size() > 1) {  // (checked before the gradients are touched)
        require<ConfigError>(host != comm.device_memory(), "Trainer::step", "communicator",
                             comm.device_memory() ? "a device communicator" : "a host communicator",
                             host ? "a host communicator (MPI's) for a backend the host reads"
                                  : "a device communicator (NCCL's) for a device backend");
    }
    if (mine != all) grads.scale(share);
    if (comm.size() == 1) return loss * share;
    comm.sum(std::span<T>(grads.view().data, static_cast<std::size_t>(grads.size())));
    double total = loss * share;
    if constexpr (host) {  // (a host communicator: checked above)
        comm.sum(std::span<double>(&total, 1));
    } else {
        using Transfer = backend::Transfer<Backend, double>;
        auto on_device = Transfer::upload(View<const double>{&total, 1, 1, 1});
        comm.sum(std::span<double>(Transfer::view(on_device).data, 1));
        Transfer::download(Transfer::view(std::as_const(on_device)),
                           View<double>{&total, 1, 1, 1});
    }
    return total;
}

/// Whether a communicator can sum a Backend's gradient buffer: one rank always, else host
/// memory for a backend the host reads, device memory for the others.
template <class Backend>
[[nodiscard]] bool can_sum(const Communicator& comm) {
    return comm.size() == 1 ||
           backend::BackendTraits<Backend>::host_accessible != comm.device_memory();
}

}  // namespace titans::detail
