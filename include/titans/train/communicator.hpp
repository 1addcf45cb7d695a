#pragma once
// titans/train/communicator.hpp: how a Trainer joins the other processes of a data-parallel
// run. The interface an engine implements (titans::mpi::Communicator over MPI,
// <titans/mpi/mpi.hpp>), and how the ranks end a collective call together (agree).

#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "../detail/check.hpp"
#include "../error.hpp"

namespace titans {

/// The collectives a data-parallel Trainer needs (Trainer::set_communicator): `size()`
/// processes, this one `rank()`. Every call is collective: every rank makes the same calls in
/// the same order, with spans of the same length. A reduction's result must be the same bits
/// on every rank (a fixed order of the additions, e.g. a reduction to one rank and a
/// broadcast), so that every rank takes the same optimiser step. Implementations report their
/// engine's failures as they see fit (MPI's: the run ends, naming the rank).
class Communicator {
public:
    virtual ~Communicator() = default;
    [[nodiscard]] virtual int rank() const = 0;
    [[nodiscard]] virtual int size() const = 0;
    /// x[i] = the sum over the ranks of their x[i], the same bits on every rank; x in host
    /// memory, or in the device's where device_memory() (NCCL's).
    virtual void sum(std::span<double> x) = 0;
    virtual void sum(std::span<float> x) = 0;
    /// Whether sum() takes device memory (a CUDA backend's gradient buffer summed where it
    /// lives) rather than host memory.
    [[nodiscard]] virtual bool device_memory() const { return false; }
    /// Every rank's `value`, in rank order, on every rank.
    [[nodiscard]] virtual std::vector<std::uint64_t> gather(std::uint64_t value) = 0;
};

namespace detail {

/// Ends a collective call on every rank together: `failed` (this rank's error, or null) and
/// this rank's `value` (a fingerprint of `what`) are gathered; a rank that failed rethrows its
/// own error, the others throw CommunicationError naming it ("<where>: rank r refused (its
/// own error names why); nothing changed"); a rank whose value differs from rank 0's is named
/// ("<where>: rank r has other <what> than rank 0"). So no rank waits in a later collective
/// for one that has stopped.
inline void agree(Communicator& comm, const std::exception_ptr& failed, std::uint64_t value,
                  const char* where, const char* what) {
    const std::vector<std::uint64_t> all = comm.gather(failed ? 0 : (value | 1));
    for (std::size_t r = 0; r < all.size(); ++r) {
        if (all[r] != 0) continue;
        if (failed) std::rethrow_exception(failed);
        throw CommunicationError(concat(where, ": rank ", r, " refused (its own error names "
                                        "why); nothing changed"));
    }
    for (std::size_t r = 1; r < all.size(); ++r) {
        if (all[r] != all[0]) {
            throw CommunicationError(concat(where, ": rank ", r, " has other ", what,
                                            " than rank 0, expected the same on every rank; "
                                            "nothing changed"));
        }
    }
}

/// agree() for a call that has not failed on this rank: throws CommunicationError on every
/// rank, naming the first rank whose `value` (a fingerprint of `what`) differs from rank 0's.
inline void require_same_on_ranks(Communicator& comm, std::uint64_t value, const char* where,
                                  const char* what) {
    agree(comm, nullptr, value, where, what);
}

}  // namespace detail

}  // namespace titans
