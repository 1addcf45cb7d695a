#pragma once
// titans/nccl/nccl.cuh: NCCL as the engine of a data-parallel run on GPUs (component
// titans::nccl, beside titans::cuda; needs NCCL, which the CUDA toolkit's images ship). A
// Trainer<T, backend::Cuda> joins a run with a titans::nccl::Communicator
// (Trainer::set_communicator): its gradient buffer is summed in device memory, one rank per
// GPU. Only CUDA translation units include it.

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "../backend/cuda/cuda.cuh"
#include "../error.hpp"
#include "../train/communicator.hpp"

namespace titans::nccl {

/// CudaError naming the call and NCCL's reason unless r is ncclSuccess.
inline void check(ncclResult_t r, const char* what) {
    if (r != ncclSuccess) {
        throw CudaError(detail::concat("titans::nccl: ", what, " failed: ", ncclGetErrorString(r)));
    }
}

/// A fresh NCCL unique id: rank 0 makes it and hands its bytes to every rank out of band (an
/// MPI_Bcast, a file) before they construct their Communicator.
[[nodiscard]] inline ncclUniqueId unique_id() {
    ncclUniqueId id;
    check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    return id;
}

/// titans::Communicator over NCCL on the current CUDA device: sums of device memory
/// (device_memory()), ncclReduce to rank 0 then ncclBroadcast on the calling thread's stream
/// of the CUDA backend, so every rank holds the same bits; gather is ncclAllGather. Every call
/// returns with the stream idle. Throws CudaError when NCCL fails (a rank that dies makes the
/// others' calls fail or wait: NCCL has no timeout of its own, so run under a launcher that
/// ends the job, as mpirun does). Not copyable.
///
///     auto comm = titans::nccl::Communicator::alone();          // one rank, one GPU
///     trainer.set_communicator(comm);                            // Trainer<float, Cuda>
class Communicator final : public titans::Communicator {
public:
    /// Rank `rank` of `size` of the run named by `id` (collective: every rank constructs its
    /// own with the same id).
    Communicator(const ncclUniqueId& id, int rank, int size) : rank_(rank), size_(size) {
        detail::require<ConfigError>(size >= 1 && rank >= 0 && rank < size,
                                     "titans::nccl::Communicator", "rank", rank,
                                     detail::concat("in [0, size = ", size, ")"));
        check(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
    }
    /// A run of one rank on the current device.
    [[nodiscard]] static std::shared_ptr<Communicator> alone() {
        return std::make_shared<Communicator>(unique_id(), 0, 1);
    }
    Communicator(const Communicator&) = delete;
    Communicator& operator=(const Communicator&) = delete;
    ~Communicator() override { (void)ncclCommDestroy(comm_); }

    [[nodiscard]] int rank() const override { return rank_; }
    [[nodiscard]] int size() const override { return size_; }
    [[nodiscard]] bool device_memory() const override { return true; }
    void sum(std::span<double> x) override { reduce(x.data(), x.size(), ncclDouble); }
    void sum(std::span<float> x) override { reduce(x.data(), x.size(), ncclFloat); }
    [[nodiscard]] std::vector<std::uint64_t> gather(std::uint64_t value) override {
        const auto n = static_cast<std::size_t>(size_);
        backend::cuda::DeviceBuffer<std::uint64_t> all(n + 1);
        std::uint64_t* d = all.data();
        backend::cuda::copy_now(d + n, &value, sizeof value, cudaMemcpyHostToDevice,
                                "cudaMemcpy (nccl gather)");
        const cudaStream_t sm = stream();
        check(ncclAllGather(d + n, d, 1, ncclUint64, comm_, sm), "ncclAllGather");
        backend::cuda::wait_now(sm, "cudaStreamSynchronize (nccl)");
        std::vector<std::uint64_t> out(n);
        backend::cuda::copy_now(out.data(), d, n * sizeof value, cudaMemcpyDeviceToHost,
                                "cudaMemcpy (nccl gather)");
        return out;
    }

private:
    static cudaStream_t stream() { return backend::cuda::thread_context().stream(); }

    template <class X>
    void reduce(X* data, std::size_t n, ncclDataType_t type) {
        const cudaStream_t sm = stream();
        backend::cuda::settle_recorded();  // work a call graph's tape holds runs first
        check(ncclReduce(data, data, n, type, ncclSum, 0, comm_, sm), "ncclReduce");
        check(ncclBroadcast(data, data, n, type, 0, comm_, sm), "ncclBroadcast");
        backend::cuda::wait_now(sm, "cudaStreamSynchronize (nccl)");
    }

    ncclComm_t comm_ = nullptr;
    int rank_ = 0, size_ = 1;
};

}  // namespace titans::nccl
