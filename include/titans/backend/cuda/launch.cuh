#pragma once
// titans/backend/cuda/launch.cuh: the kernel launches of the CUDA backend.
//
// launch(kernel, grid, block, stream, args...) is the one place a kernel is launched:
// kernel<<<grid, block, 0, stream>>>(args...) under nvcc, the CPU emulator's launch under
// TITANS_CUDA_EMULATION (tests/cuda/emulation/emulated_launch.h), or a record on this
// thread's call tape (call_graph.cuh) while it records the stream.
// each(stream, n, f) runs f(i) for i in [0, n) on the device, f a __device__ lambda
// (nvcc --extended-lambda, which the titans::cuda target adds) or functor.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>

#include "../../config.hpp"
#include "../../view.hpp"
#include "call_graph.cuh"
#include "runtime.cuh"

#if defined(__CUDACC__)
#include <cooperative_groups.h>
#endif

// A kernel's registers a thread at most (__maxnreg__, where a launch bound would also cap its
// threads); nothing under the CPU emulation.
#if defined(__CUDACC__)
#define TITANS_MAX_REGISTERS(n) __maxnreg__(n)
#else
#define TITANS_MAX_REGISTERS(n)
#endif

// Full unrolling of loops whose bounds are constants (a tile's pieces, a fixed row count), so
// that their accumulators stay in registers; nothing under the CPU emulation.
#if defined(__CUDACC__)
#define TITANS_UNROLL _Pragma("unroll")
#define TITANS_NO_UNROLL _Pragma("unroll 1")
#define TITANS_PRAGMA_TEXT(x) _Pragma(#x)
#define TITANS_PRAGMA(x) TITANS_PRAGMA_TEXT(x)
#else
#define TITANS_NO_UNROLL
#define TITANS_PRAGMA(x)
#define TITANS_UNROLL
#endif

// A kernel parameter read in place from the launch's parameter space (`__grid_constant__`,
// sm_70 and later), so that indexing an array in it at run time does not copy the whole
// parameter to each thread's stack first; nothing under the CPU emulation.
#if defined(__CUDACC__)
#define TITANS_GRID_CONSTANT __grid_constant__
#else
#define TITANS_GRID_CONSTANT
#endif

namespace titans::backend::cuda {

#if TITANS_CUDA_DEVICE_CODE
/// kernel<<<grid, block, shmem, stream>>>(args...) now (no tape).
template <class... P, class... A>
void launch_now(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shmem,
                cudaStream_t stream, A&&... args) {
#if defined(__CUDACC__)
    kernel<<<grid, block, shmem, stream>>>(std::forward<A>(args)...);
#else
    ::cuda_emulation::launch(kernel, grid, block, shmem, stream, std::forward<A>(args)...);
#endif
}

namespace tape_detail {
/// Where a kernel's arguments lie in its record's bytes: each at its alignment, in order.
template <class... P>
struct KernelArgs {
    static constexpr std::array<std::size_t, sizeof...(P) + 1> at = [] {
        std::array<std::size_t, sizeof...(P) + 1> o{};
        std::size_t end = 0, i = 0;
        ((end = (end + alignof(P) - 1) / alignof(P) * alignof(P), o[i++] = end, end += sizeof(P)),
         ...);
        o[i] = end;
        return o;
    }();
    static constexpr std::size_t size = at[sizeof...(P)];
    static constexpr bool fits = ((std::is_trivially_copyable_v<P> && alignof(P) <= 16) && ...) &&
                                 sizeof...(P) <= 64;
};

template <class... P, std::size_t... I>
void run_kernel(const unsigned char* bytes, const Record& r, cudaStream_t stream,
                std::index_sequence<I...>) {
    auto* kernel = reinterpret_cast<void (*)(P...)>(const_cast<void*>(r.key));
    launch_now(kernel, r.grid, r.block, r.shmem, stream,
               *reinterpret_cast<const P*>(bytes + r.at + KernelArgs<P...>::at[I])...);
}
template <class... P>
void run_kernel(const unsigned char* bytes, const Record& r, cudaStream_t stream) {
    run_kernel<P...>(bytes, r, stream, std::index_sequence_for<P...>{});
}

template <class... P>
void kernel_params(unsigned char* bytes, void** out) {
    for (std::size_t i = 0; i < sizeof...(P); ++i) {
        out[i] = bytes + KernelArgs<P...>::at[i];
    }
}

/// p's padding bytes zeroed where the compiler can (GCC, and nvcc's host pass): a record's
/// arguments are compared as bytes, and padding copied from a stack temporary would make a
/// kernel look changed (a needless node update) where it is not.
template <class P>
void clear_padding(P* p) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_clear_padding)
    __builtin_clear_padding(p);
#else
    (void)p;
#endif
#else
    (void)p;
#endif
}

/// The arguments placed in a record's bytes (converted to the parameters' types).
template <class... P, class... A, std::size_t... I>
void place_args(unsigned char* bytes, std::index_sequence<I...>, A&&... args) {
    (clear_padding(new (bytes + KernelArgs<P...>::at[I]) P(std::forward<A>(args))), ...);
}
}  // namespace tape_detail

/// kernel<<<grid, block, shmem, stream>>>(args...), or recorded on this thread's call tape
/// where it records the stream (call_graph.cuh); launching on another stream first runs what
/// the tape holds. A launch error (a bad configuration, say) is left for check_launch, as with
/// <<<>>> (a recorded launch's for the replay).
template <class... P, class... A>
void launch_shared(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shmem,
                   cudaStream_t stream, A&&... args) {
    using Args = tape_detail::KernelArgs<P...>;
    static_assert(Args::fits, "kernel arguments are kept as bytes");
    CallTape& tape = call_tape();
    if (tape.records(stream)) {
        unsigned char* at = tape.add({reinterpret_cast<const void*>(kernel),
                                      &tape_detail::run_kernel<P...>,
                                      &tape_detail::kernel_params<P...>, grid, block, shmem, 0,
                                      Args::size});
        tape_detail::place_args<P...>(at, std::index_sequence_for<P...>{},
                                      std::forward<A>(args)...);
        return;
    }
    settle_recorded();
    launch_now(kernel, grid, block, shmem, stream, std::forward<A>(args)...);
}

/// launch_shared without dynamic shared memory.
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t stream, A&&... args) {
    launch_shared(kernel, grid, block, 0, stream, std::forward<A>(args)...);
}

/// kernel<<<grid, block, shmem, stream>>>(args...) in thread-block clusters of `cluster` blocks
/// (sm_90 and later: cudaLaunchKernelEx with cudaLaunchAttributeClusterDimension; the grid a
/// multiple of the cluster in each dimension, at most 8 blocks a cluster), now: not recorded
/// on a call tape (what the tape holds runs first). The blocks of a cluster run at once and
/// reach each other's dynamic shared memory (cluster_shared, cluster_sync). Throws CudaError
/// for a configuration the device refuses.
template <class... P, class... A>
void launch_cluster(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shmem, dim3 cluster,
                    cudaStream_t stream, A&&... args) {
    settle_recorded();
#if defined(__CUDACC__)
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = shmem;
    config.stream = stream;
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = cluster.x;
    attribute.val.clusterDim.y = cluster.y;
    attribute.val.clusterDim.z = cluster.z;
    config.attrs = &attribute;
    config.numAttrs = 1;
    const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<A>(args)...);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();  // the error is thrown here, not left for a later check
        check(e, "cudaLaunchKernelEx (a cluster launch)");
    }
#else
    ::cuda_emulation::launch_cluster(kernel, grid, block, shmem, cluster, stream,
                                     std::forward<A>(args)...);
#endif
    check_launch("a cluster launch");
}

/// The running block's rank in its cluster (launch_cluster: x fastest, then y, z; 0 in a
/// launch without clusters).
__device__ inline unsigned cluster_rank() {
#if defined(__CUDACC__)
    return cooperative_groups::this_cluster().block_rank();
#else
    return ::cuda_emulation::cluster_rank();
#endif
}

/// Waits until every thread of the running block's cluster has arrived (the block's threads
/// in a launch without clusters); the shared memory each wrote before is then visible to all.
__device__ inline void cluster_sync() {
#if defined(__CUDACC__)
    cooperative_groups::this_cluster().sync();
#else
    ::cuda_emulation::cluster_sync();
#endif
}

/// The address in block `rank`'s dynamic shared memory of the cluster that `local` has in the
/// running block's (distributed shared memory; rank < the cluster's blocks).
template <class T>
__device__ T* cluster_shared(T* local, unsigned rank) {
#if defined(__CUDACC__)
    return cooperative_groups::this_cluster().map_shared_rank(local, rank);
#else
    return static_cast<T*>(::cuda_emulation::cluster_shared(local, rank));
#endif
}

/// The block's dynamic shared memory (16-byte aligned) as an array of T.
template <class T>
__device__ T* dynamic_shared() {
#if defined(__CUDACC__)
    extern __shared__ __align__(16) unsigned char titans_dynamic_shared[];
    return reinterpret_cast<T*>(titans_dynamic_shared);
#else
    return static_cast<T*>(::cuda_emulation::dynamic_shared());
#endif
}

/// Lets `kernel` take `bytes` of dynamic shared memory (cudaFuncSetAttribute).
template <class... P>
void raise_shared_limit(void (*kernel)(P...), std::size_t bytes) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "cudaFuncSetAttribute (dynamic shared memory)");
}

/// The most dynamic shared memory a block of the current device may take (the opt-in limit).
inline std::size_t shared_memory_limit() {
    int device = 0, bytes = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cudaDeviceGetAttribute (shared memory per block)");
    return static_cast<std::size_t>(bytes);
}

template <class F>
__global__ void each_kernel(unsigned n, F f) {
    const unsigned step = gridDim.x * blockDim.x;
    // i + step may pass 2^32 (n up to 2^32 - 1, step up to 2^24): stop before it would wrap.
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        f(i);
        if (n - i <= step) {
            break;
        }
    }
}

/// f(i) for every i < n, on `stream` (grid-stride loop, 256 threads a block). Indices are
/// 32-bit: a kernel's index arithmetic then divides in 32 bits (64-bit division costs several
/// times more on the GPU); n beyond 2^32 - 1 throws CudaError (split the call).
template <class F>
void each(cudaStream_t stream, long long n, F f) {
    if (n <= 0) {
        return;
    }
    if (n > static_cast<long long>(std::numeric_limits<unsigned>::max())) {
        throw CudaError(detail::concat("titans (CUDA backend): an element-wise kernel over ", n,
                                       " entries, expected at most 2^32 - 1 (split the call into "
                                       "smaller pieces or batches)"));
    }
    constexpr int threads = 256;
    const long long blocks = std::min<long long>((n + threads - 1) / threads, 1LL << 16);
    launch(each_kernel<F>, static_cast<unsigned>(blocks), threads, stream,
           static_cast<unsigned>(n), f);
    check_launch("a titans CUDA kernel launch");
}

/// The first row of y holding a NaN or an infinity, or -1 (synchronises the stream): each
/// non-finite entry lowers *flag (device memory) by atomicMin over row indices as unsigned keys,
/// none = 0xFFFFFFFF (each() bounds rows x cols below 2^32, so a row is at most 2^32 - 2); the
/// one scalar is read back.
template <class T>
long long first_nonfinite_row(cudaStream_t stream, View<const T> y, unsigned* flag) {
    memset_async(flag, 0xff, sizeof(unsigned), stream, "cudaMemsetAsync");
    const T* yp = y.data;
    const long long cols = y.cols, ys = y.stride;
    each(stream, y.rows * cols, [=] __device__(unsigned i) {
        const unsigned r = i / static_cast<unsigned>(cols), c = i % static_cast<unsigned>(cols);
        if (!(yp[r * ys + c] - yp[r * ys + c] == T(0))) {  // not finite (fast math too)
            atomicMin(flag, r);
        }
    });
    unsigned host = 0;
    settle_recorded();
    check(cudaMemcpyAsync(&host, flag, sizeof(host), cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync (non-finite row)");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return host == 0xFFFFFFFFu ? -1 : static_cast<long long>(host);
}

/// The sum (Max false) or the maximum (Max true) of v over the block's threads (blockDim.x a
/// power of two, <= 256), returned to every thread; part: 256 shared entries, free again on
/// return.
template <bool Max, class T>
__device__ T block_reduce(T* part, T v) {
    part[threadIdx.x] = v;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o /= 2) {
        const int t = static_cast<int>(threadIdx.x);
        if (t < o) {
            const T a = part[t], b = part[t + o];
            part[t] = Max ? (a < b ? b : a) : a + b;
        }
        __syncthreads();
    }
    const T r = part[0];
    __syncthreads();
    return r;
}
#endif

/// x as an unsigned 32-bit divisor (each() bounds every index, so the operands fit).
TITANS_HOST_DEVICE unsigned u32(long long x) { return static_cast<unsigned>(x); }

/// A device-side non-finite test that works under --use_fast_math too.
template <class T>
TITANS_HOST_DEVICE bool not_finite(T v) {
    return !(v - v == T(0));
}

#if TITANS_CUDA_DEVICE_CODE
/// The column blocks of src (rows x blocks * width, row-major) from block `first` on added to
/// consecutive row-major tensors of rows x width at `to` (block j's at to + j * rows * width),
/// a thread per entry: how a product computed as [A | B | C] joins a flat gradient buffer.
template <class T>
void add_column_blocks(cudaStream_t stream, const T* src, long long rows, long long blocks,
                       long long width, long long first, T* to) {
    const long long cols = blocks * width, skip = first * width, w = cols - skip;
    each(stream, rows * w, [=] __device__(unsigned i) {
        const long long r = i / u32(w), c = skip + i % u32(w), j = c / width;
        to[(j * rows + r) * width + c - j * width] += src[r * cols + c];
    });
}

/// to[i] += from[i] for i < n, a thread per entry.
template <class T>
void add_entries(cudaStream_t stream, const T* from, long long n, T* to) {
    each(stream, n, [=] __device__(unsigned i) { to[i] += from[i]; });
}

template <class T, class F, bool every>
__global__ void pair_local_kernel(T* vec, long long stride, int head, F f) {
    T* v = vec + static_cast<long long>(blockIdx.x) * stride;
    T* local = head > 0 ? dynamic_shared<T>() : v;
    for (int i = threadIdx.x; i < head; i += blockDim.x) {
        local[i] = v[i];
    }
    __syncthreads();
    if constexpr (every) {
        f(blockIdx.x, local, v, threadIdx.x, blockDim.x);
    } else if (threadIdx.x == 0) {
        f(blockIdx.x, local, v);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < head; i += blockDim.x) {
        v[i] = local[i];
    }
}

/// f(p, local, v) for every pair p < pairs, on one thread of a block per pair: v = vec + p *
/// stride is the pair's row in device memory, `local` a copy of its first `head` entries in
/// shared memory, written back after f. A serial recurrence over a chunk's coefficients (a
/// thread per pair: math §4-5's running products) then waits for shared memory, not for
/// device memory, at each step: the same arithmetic in the same order, so the same bits.
/// Where head entries pass 48 KB, local = v (device memory, as a plain thread per pair).
/// every: f(p, local, v, thread, threads) on each of the block's threads instead (work
/// independent across them, such as the columns of a chunk's G).
template <bool every = false, class T, class F>
void pair_local(cudaStream_t stream, T* vec, long long pairs, long long stride, long long head,
                F f) {
    if (pairs <= 0) {
        return;
    }
    if (pairs > static_cast<long long>(std::numeric_limits<int>::max())) {
        throw CudaError(detail::concat("titans (CUDA backend): a kernel over ", pairs,
                                       " (sequence, head) pairs, expected at most 2^31 - 1"));
    }
    const bool fits = head * static_cast<long long>(sizeof(T)) <= 48 * 1024;
    const int h = fits ? static_cast<int>(head) : 0;
    launch_shared(pair_local_kernel<T, F, every>, static_cast<unsigned>(pairs), 64,
                  static_cast<std::size_t>(h) * sizeof(T), stream, vec, stride, h, f);
    check_launch("a titans CUDA kernel launch (per pair)");
}

/// out[c] = Σ_{r < rows} f(r, c) for every c < cols (f a __device__ functor of two unsigned
/// indices; rows below 2^32), in two launches: about sqrt(rows) partial sums over
/// consecutive row ranges, a thread per (range, column), then each column's partials summed
/// in range order. A thread per column walking every row (a bias's gradient over B * N rows:
/// 24 threads on the whole GPU) waits for one load after another; this takes
/// O(sqrt(rows)) steps a thread. The partials live in a buffer of the pool, per call.
template <class T, class F>
void sum_rows(cudaStream_t stream, long long rows, long long cols, F f, T* out) {
    if (cols <= 0) {
        return;
    }
    long long slices = static_cast<long long>(std::ceil(std::sqrt(static_cast<double>(rows))));
    slices = slices < 1 ? 1 : slices;
    const long long span = rows > 0 ? (rows + slices - 1) / slices : 0;
    DeviceBuffer<T> partial(static_cast<std::size_t>(slices * cols));
    T* pp = partial.data();
    each(stream, slices * cols, [=] __device__(unsigned i) {
        const long long s = i / u32(cols), c = i % u32(cols);
        const long long r1 = (s + 1) * span < rows ? (s + 1) * span : rows;
        T acc = T(0);
        for (long long r = s * span; r < r1; ++r) {
            acc += f(static_cast<unsigned>(r), static_cast<unsigned>(c));
        }
        pp[i] = acc;
    });
    each(stream, cols, [=] __device__(unsigned c) {
        T acc = T(0);
        for (long long s = 0; s < slices; ++s) {
            acc += pp[s * cols + c];
        }
        out[c] = acc;
    });
}
#endif

}  // namespace titans::backend::cuda
