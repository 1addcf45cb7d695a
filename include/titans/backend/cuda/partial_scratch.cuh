#pragma once
// titans/backend/cuda/partial_scratch.cuh: the partial sums and "done" counters of kernels
// whose blocks each sum a part and whose last block adds the parts in order (the few-row
// feed-forward, the few-row product).

#include "call_graph.cuh"
#include "runtime.cuh"

namespace titans::backend::cuda {

/// This host thread's partial sums and counters (its launches all run on the thread's stream,
/// one after another, so one kernel at a time uses them): grown, never shrunk. The counters
/// are zero before and after every launch (a kernel's last block puts its counter back).
template <class T>
struct PartialScratch {
    DeviceBuffer<T> part;
    DeviceBuffer<unsigned> done;

    static PartialScratch& mine() {
        thread_local PartialScratch s;
        return s;
    }
    /// Room for n partial entries and `counters` counters, all zero (what the recorded work
    /// holds runs first if a buffer grows: it may read the old one).
    void reserve(std::size_t n, std::size_t counters) {
        if (done.size() < counters) {
            settle_recorded();
            done = DeviceBuffer<unsigned>(counters);
            set_now(done.data(), 0, counters * sizeof(unsigned), "cudaMemset (block counters)");
        }
        if (part.size() < n) {
            settle_recorded();
            part.reserve(n);
        }
    }
};

}  // namespace titans::backend::cuda
