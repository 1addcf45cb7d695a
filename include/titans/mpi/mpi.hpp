#pragma once
// titans/mpi/mpi.hpp: MPI as the engine of a data-parallel run (component titans::mpi, CMake
// target titans::mpi; needs an MPI implementation, e.g. Debian's OpenMPI: openmpi-bin
// libopenmpi-dev). A Trainer joins a run with a titans::mpi::Communicator
// (Trainer::set_communicator); every rank then steps on its shard of each batch and takes the
// step of the whole batch (train/trainer.hpp). Run with mpirun -np N.

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "../error.hpp"
#include "../train/communicator.hpp"

namespace titans::mpi {

/// The lifetime of MPI in a program: MPI_Init_thread (MPI_THREAD_FUNNELED: the library's
/// OpenMP threads make no MPI calls) if MPI is not initialised yet, MPI_Finalize on
/// destruction if this session initialised it. Not copyable.
///
///     int main(int argc, char** argv) {
///         titans::mpi::Session mpi(argc, argv);
///         ...
///     }
class Session {
public:
    Session(int& argc, char**& argv) {
        int ready = 0;
        MPI_Initialized(&ready);
        if (ready == 0) {
            int provided = 0;
            MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
            owner_ = true;
        }
    }
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
    ~Session() {
        int done = 0;
        MPI_Finalized(&done);
        if (owner_ && done == 0) MPI_Finalize();
    }

private:
    bool owner_ = false;
};

/// titans::Communicator over MPI: the ranks of `comm` (MPI_COMM_WORLD by default), through a
/// duplicate of it, so the trainer's collectives never mix with the program's own messages.
/// A sum is MPI_Reduce to rank 0 followed by MPI_Bcast, so every rank holds the same bits (in
/// pieces of at most 2^30 entries: MPI counts are int); gather is MPI_Allgather. Failures end
/// the run: the duplicate's error handler is MPI_ERRORS_ARE_FATAL, and a rank that dies makes
/// mpirun stop every rank with a message naming it. Throws ConfigError if MPI is not
/// initialised (titans::mpi::Session first). Not copyable; destroy it before MPI_Finalize.
class Communicator final : public titans::Communicator {
public:
    explicit Communicator(MPI_Comm comm = MPI_COMM_WORLD) {
        int ready = 0;
        MPI_Initialized(&ready);
        if (ready == 0) {
            throw ConfigError("titans::mpi::Communicator: MPI is not initialised, expected "
                              "MPI_Init (titans::mpi::Session) first");
        }
        MPI_Comm_dup(comm, &comm_);
        MPI_Comm_set_errhandler(comm_, MPI_ERRORS_ARE_FATAL);
        MPI_Comm_rank(comm_, &rank_);
        MPI_Comm_size(comm_, &size_);
    }
    Communicator(const Communicator&) = delete;
    Communicator& operator=(const Communicator&) = delete;
    ~Communicator() override {
        int done = 0;
        MPI_Finalized(&done);
        if (done == 0) MPI_Comm_free(&comm_);
    }

    [[nodiscard]] int rank() const override { return rank_; }
    [[nodiscard]] int size() const override { return size_; }
    void sum(std::span<double> x) override { reduce(x.data(), x.size(), MPI_DOUBLE); }
    void sum(std::span<float> x) override { reduce(x.data(), x.size(), MPI_FLOAT); }
    [[nodiscard]] std::vector<std::uint64_t> gather(std::uint64_t value) override {
        std::vector<std::uint64_t> all(static_cast<std::size_t>(size_));
        MPI_Allgather(&value, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm_);
        return all;
    }
    /// The duplicate the collectives run on.
    [[nodiscard]] MPI_Comm comm() const { return comm_; }

private:
    template <class X>
    void reduce(X* data, std::size_t n, MPI_Datatype type) {
        constexpr std::size_t piece = std::size_t{1} << 30;
        for (std::size_t at = 0; at < n; at += piece) {
            const int count = static_cast<int>(std::min(piece, n - at));
            if (rank_ == 0) {
                MPI_Reduce(MPI_IN_PLACE, data + at, count, type, MPI_SUM, 0, comm_);
            } else {
                MPI_Reduce(data + at, nullptr, count, type, MPI_SUM, 0, comm_);
            }
            MPI_Bcast(data + at, count, type, 0, comm_);
        }
    }

    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0, size_ = 1;
};

}  // namespace titans::mpi
