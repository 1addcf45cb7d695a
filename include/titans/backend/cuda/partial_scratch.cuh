#pragma once
// titans/backend/cuda/partial_scratch.cuh: the partial sums and "done" counters of kernels
// whose blocks each sum a part and whose last block adds the parts in order (the few-row
// feed-forward, the few-row product).

#include "call_graph.cuh"
#include "launch.cuh"
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

#if TITANS_CUDA_DEVICE_CODE
/// The sum of `count` partials at[0], at[stride], at[2 stride], ..., added in that order (the
/// same bits every launch), four loads in flight a thread. `at` is volatile: other blocks
/// wrote the partials, so they are not read through this SM's L1.
template <class T>
__device__ T sum_parts_in_order(const volatile T* at, long long stride, unsigned count) {
    T s = T(0);
    unsigned b = 0;
    for (; b + 4 <= count; b += 4) {  // four loads first, then the sums in order
        const T v0 = at[b * stride], v1 = at[(b + 1) * stride], v2 = at[(b + 2) * stride],
                v3 = at[(b + 3) * stride];
        s += v0;
        s += v1;
        s += v2;
        s += v3;
    }
    for (; b < count; ++b) {
        s += at[b * stride];
    }
    return s;
}
#endif

}  // namespace titans::backend::cuda
