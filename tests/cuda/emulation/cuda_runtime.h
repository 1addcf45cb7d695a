#pragma once
// tests/cuda/emulation/cuda_runtime.h: a CPU emulation of the CUDA runtime, enough of it for the
// titans CUDA backend (include/titans/backend/cuda/) and its tests to run on a machine without
// a GPU. Compile the CUDA sources as C++ with -DTITANS_CUDA_EMULATION and this folder first on
// the include path; <cuda_runtime.h> and <cublas_v2.h> then resolve here.
//
//   device memory   host memory (posix_memalign, 256-byte aligned like cudaMalloc), filled with
//                   0xCD when allocated so that reads of unwritten memory show; every
//                   allocation is registered, so a copy or memset whose device side is not
//                   inside one allocation fails with cudaErrorInvalidValue; cudaMallocAsync and
//                   cudaFreeAsync (the default pool) allocate and free at the call, counted
//                   apart from cudaMalloc (allocation_calls()), and cudaFreeAsync refuses
//                   memory that cudaMalloc gave
//   copies, memset  at the call (every stream is synchronous; see lazy streams below), with
//                   the argument checks CUDA
//                   makes (pitches, directions) and, where CUDA leaves it undefined (an
//                   overlapping copy), an error and a message on stderr
//   streams         handles checked at every use (a destroyed stream is an invalid handle);
//                   the calls that make the host wait on a GPU (stream, event and device
//                   synchronisations, the blocking cudaMemcpy, cudaMemcpy2D and cudaMemset)
//                   are counted (host_waits())
//   errors          CUDA's codes; every failing call also sets the host thread's last error
//                   (cudaGetLastError / cudaPeekAtLastError), as CUDA does
//   kernels         emulated_launch.h: blocks one after another, a block's threads as fibers
//
//   lazy streams    opt-in (TITANS_EMULATION_LAZY=1, set_lazy_streams): a created stream's work
//                   runs only when something waits for it (emulated_streams.h), so missing
//                   order between streams shows as stale data
//
// One emulated device (cudaGetDeviceCount: 1). Not emulated: events' timing is host time,
// no unified/managed memory, no graphs.

#include <cmath>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#if defined(__CUDACC__)
#error "tests/cuda/emulation/ is for C++ compilers: nvcc has the real CUDA runtime"
#endif

// Function and variable qualifiers: host code here. __shared__ (a block's shared arrays) is
// per host thread, which runs a launch's blocks one after another: emulated_launch.h.
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static thread_local

// Device math: CUDA declares float overloads of the C math functions in the global namespace
// (sqrt(float) is a float square root), so unqualified calls in kernels resolve like this.
using std::ceil;
using std::exp;
using std::fabs;
using std::floor;
using std::fmax;
using std::fmin;
using std::log;
using std::pow;
using std::sqrt;
using std::tanh;

// ---------------------------------------------------------------------------------------------
// Types
// ---------------------------------------------------------------------------------------------
/// The codes CUDA gives (driver_types.h values).
enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidPitchValue = 12,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorLaunchFailure = 719,
};
using cudaError_t = cudaError;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxBlockDimX = 2,
    cudaDevAttrMaxGridDimX = 5,
    cudaDevAttrWarpSize = 10,
    cudaDevAttrMaxPitch = 11,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
    cudaDevAttrMemoryPoolsSupported = 115,
};

/// A stream-ordered memory pool (the device has one, its default pool) and the attribute the
/// backend sets on it.
struct CUmemPoolHandle_st;
using cudaMemPool_t = CUmemPoolHandle_st*;
enum cudaMemPoolAttr {
    cudaMemPoolAttrReleaseThreshold = 4,
};

/// The kernel attribute the backend sets (cudaFuncSetAttribute).
enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

struct uint3 {
    unsigned x, y, z;
};

/// A launch's extent; unspecified components are 1.
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct CUevent_st;
using cudaEvent_t = CUevent_st*;

/// The legacy default stream's special handles (0 is the legacy stream too).
#define cudaStreamLegacy (reinterpret_cast<cudaStream_t>(0x1))
#define cudaStreamPerThread (reinterpret_cast<cudaStream_t>(0x2))

namespace cuda_emulation {

/// The device's limits, as an H100 reports them.
inline constexpr std::size_t max_pitch = 2147483647;  // cudaDevAttrMaxPitch
inline constexpr unsigned max_threads_per_block = 1024;
inline constexpr std::size_t max_allocation = std::size_t(80) << 30;  // 80 GiB of "device" memory
inline constexpr int max_shared_optin = 232448;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
inline constexpr int multiprocessors = 132;

/// The byte fresh device memory is filled with (uninitialised reads show as 0xCDCD...).
inline constexpr int garbage_byte = 0xCD;

/// How many allocations each way the process has made (tests read it: allocation_calls()).
struct AllocationCalls {
    long direct = 0;  // cudaMalloc
    long pooled = 0;  // cudaMallocAsync
};

/// Process-wide bookkeeping: live allocations (base -> size; those from cudaMallocAsync also
/// in `pooled`), live streams and events, the allocation counts, the default pool's release
/// threshold.
struct Registry {
    std::mutex m;
    std::map<std::uintptr_t, std::size_t> allocations;
    std::set<std::uintptr_t> pooled;
    std::set<const void*> handles;
    AllocationCalls calls;
    long waits = 0;  // host waits
    unsigned long long release_threshold = 0;
    unsigned long long device_copy_bytes = 0;  // copied device to device by cudaMemcpy(Async)
};
inline Registry& registry() {
    static Registry r;
    return r;
}

/// The allocation counts so far.
inline AllocationCalls allocation_calls() {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    return r.calls;
}

/// Bytes copied from device memory to device memory by cudaMemcpy and cudaMemcpyAsync so far.
inline unsigned long long device_copy_bytes() {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    return r.device_copy_bytes;
}

/// How many calls so far would make the host wait for the device on a GPU.
inline long host_waits() {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    return r.waits;
}
/// Counts one host wait.
inline void check_tape(const char* what);
inline void count_wait() {
    check_tape("a wait");
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    ++r.waits;
}

/// The one device's default pool: a fixed handle.
inline cudaMemPool_t default_pool() {
    static char pool;
    return reinterpret_cast<cudaMemPool_t>(&pool);
}

/// The host thread's last error (CUDA keeps one per host thread).
inline thread_local cudaError_t last_error = cudaSuccess;

/// e, also recorded as the last error when it is one (what every runtime call does).
inline cudaError_t fail(cudaError_t e) {
    if (e != cudaSuccess) {
        last_error = e;
    }
    return e;
}

/// An emulator-detected misuse that CUDA leaves undefined: a message on stderr, then `e`.
inline cudaError_t misuse(const char* call, const char* what, cudaError_t e = cudaErrorInvalidValue) {
    std::fprintf(stderr, "CUDA emulation: %s: %s\n", call, what);
    return fail(e);
}

/// Whether [p, p + n) lies inside one live device allocation (n = 0: p inside or at its end).
inline bool is_device_range(const void* p, std::size_t n) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    auto it = r.allocations.upper_bound(a);
    if (it == r.allocations.begin()) {
        return false;
    }
    --it;
    return a - it->first <= it->second && n <= it->second - (a - it->first);
}

/// Whether p lies inside any live device allocation.
inline bool is_device_pointer(const void* p) { return is_device_range(p, 0); }

inline bool is_handle(const void* h) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    return r.handles.count(h) != 0;
}

/// The legacy stream (0, cudaStreamLegacy, cudaStreamPerThread) or a live created stream.
inline bool valid_stream(cudaStream_t s) {
    return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread || is_handle(s);
}

}  // namespace cuda_emulation

#include "emulated_streams.h"

namespace cuda_emulation {

/// Checks a copy's operands against its direction: a device side must be device memory of
/// `span` bytes, a host side must not be device memory. cudaSuccess or the error.
inline cudaError_t check_sides(const char* call, void* dst, std::size_t dst_span, const void* src,
                               std::size_t src_span, cudaMemcpyKind kind) {
    if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) {
        return fail(cudaErrorInvalidMemcpyDirection);
    }
    if (dst == nullptr || src == nullptr) {
        return fail(cudaErrorInvalidValue);
    }
    if (kind == cudaMemcpyDefault) {
        return cudaSuccess;
    }
    const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (dst_dev ? !is_device_range(dst, dst_span) : is_device_pointer(dst)) {
        return misuse(call, dst_dev ? "the destination is not (all) device memory"
                                    : "the destination is device memory, the direction says host");
    }
    if (src_dev ? !is_device_range(src, src_span) : is_device_pointer(src)) {
        return misuse(call, src_dev ? "the source is not (all) device memory"
                                    : "the source is device memory, the direction says host");
    }
    return cudaSuccess;
}

/// Whether the rows [d + j dp, + w) and [s + r sp, + w) (j, r < h) intersect anywhere.
inline bool rows_overlap(const char* d, std::size_t dp, const char* s, std::size_t sp,
                         std::size_t w, std::size_t h) {
    for (std::size_t r = 0; r < h; ++r) {
        const char* lo = s + r * sp;
        const char* hi = lo + w;
        for (std::size_t j = 0; j < h; ++j) {  // dst rows are ordered: stop past hi
            const char* dl = d + j * dp;
            if (dl >= hi) {
                break;
            }
            if (dl + w > lo) {
                return true;
            }
        }
    }
    return false;
}

/// The 2-D copy with cudaMemcpy2D's checks: width at most either pitch, pitches at most
/// cudaDevAttrMaxPitch, no overlap.
inline cudaError_t copy_2d(const char* call, void* dst, std::size_t dpitch, const void* src,
                           std::size_t spitch, std::size_t width, std::size_t height,
                           cudaMemcpyKind kind, cudaStream_t stream) {
    if (!valid_stream(stream)) {
        return fail(cudaErrorInvalidResourceHandle);
    }
    if (width > dpitch || width > spitch || dpitch > max_pitch || spitch > max_pitch) {
        return fail(cudaErrorInvalidPitchValue);
    }
    if (width == 0 || height == 0) {
        return cudaSuccess;
    }
    const std::size_t dspan = (height - 1) * dpitch + width, sspan = (height - 1) * spitch + width;
    if (cudaError_t e = check_sides(call, dst, dspan, src, sspan, kind); e != cudaSuccess) {
        return e;
    }
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    if (d < s + sspan && s < d + dspan && rows_overlap(d, dpitch, s, spitch, width, height)) {
        return misuse(call, "source and destination overlap (undefined in CUDA)");
    }
    submit_copy(stream, d, !is_device_range(d, dspan), s, !is_device_range(s, sspan), sspan,
                [=](char* to, const char* from) {
                    for (std::size_t r = 0; r < height; ++r) {
                        std::memcpy(to + r * dpitch, from + r * spitch, width);
                    }
                });
    return cudaSuccess;
}

inline cudaError_t copy_1d(const char* call, void* dst, const void* src, std::size_t n,
                           cudaMemcpyKind kind, cudaStream_t stream) {
    if (!valid_stream(stream)) {
        return fail(cudaErrorInvalidResourceHandle);
    }
    if (n == 0) {
        return cudaSuccess;
    }
    if (cudaError_t e = check_sides(call, dst, n, src, n, kind); e != cudaSuccess) {
        return e;
    }
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    if (d < s + n && s < d + n) {
        return misuse(call, "source and destination overlap (undefined in CUDA)");
    }
    const bool d_dev = is_device_range(d, n), s_dev = is_device_range(s, n);
    if (d_dev && s_dev) {
        Registry& r = registry();
        std::lock_guard<std::mutex> lock(r.m);
        r.device_copy_bytes += n;
    }
    submit_copy(stream, d, !d_dev, s, !s_dev, n,
                [n](char* to, const char* from) { std::memcpy(to, from, n); });
    return cudaSuccess;
}

inline cudaError_t set_bytes(const char* call, void* dst, int value, std::size_t n,
                             cudaStream_t stream) {
    if (!valid_stream(stream)) {
        return fail(cudaErrorInvalidResourceHandle);
    }
    if (n == 0) {
        return cudaSuccess;
    }
    if (!is_device_range(dst, n)) {
        return misuse(call, "the destination is not (all) device memory");
    }
    submit(stream, [=] { std::memset(dst, value, n); });
    return cudaSuccess;
}

/// A registered handle (stream or event) of type H.
template <class H>
cudaError_t create_handle(H** out) {
    if (out == nullptr) {
        return fail(cudaErrorInvalidValue);
    }
    H* h = new H{};
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    r.handles.insert(h);
    *out = h;
    return cudaSuccess;
}

template <class H>
cudaError_t destroy_handle(H* h) {
    Registry& r = registry();
    {
        std::lock_guard<std::mutex> lock(r.m);
        if (h == nullptr || r.handles.erase(h) == 0) {
            return fail(cudaErrorInvalidResourceHandle);
        }
    }
    delete h;
    return cudaSuccess;
}

}  // namespace cuda_emulation

struct CUstream_st {
    int unused = 0;
};
struct CUevent_st {
    std::chrono::steady_clock::time_point at{};
    cudaStream_t stream = nullptr;  // where it was last recorded (the lazy mode's waits)
};

// ---------------------------------------------------------------------------------------------
// Errors and the device
// ---------------------------------------------------------------------------------------------
inline cudaError_t cudaGetLastError() {
    const cudaError_t e = cuda_emulation::last_error;
    cuda_emulation::last_error = cudaSuccess;
    return e;
}
inline cudaError_t cudaPeekAtLastError() { return cuda_emulation::last_error; }

inline const char* cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidPitchValue: return "cudaErrorInvalidPitchValue";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    }
    return "cudaErrorUnknown";
}

inline const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidPitchValue: return "invalid pitch argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    }
    return "unknown error";
}

inline cudaError_t cudaGetDeviceCount(int* n) {
    if (n == nullptr) {
        return cuda_emulation::fail(cudaErrorInvalidValue);
    }
    *n = 1;
    return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
    if (d == nullptr) {
        return cuda_emulation::fail(cudaErrorInvalidValue);
    }
    *d = 0;
    return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) {
    return d == 0 ? cudaSuccess : cuda_emulation::fail(cudaErrorInvalidDevice);
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int device) {
    if (v == nullptr || device != 0) {
        return cuda_emulation::fail(device != 0 ? cudaErrorInvalidDevice : cudaErrorInvalidValue);
    }
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock:
    case cudaDevAttrMaxBlockDimX: *v = 1024; return cudaSuccess;
    case cudaDevAttrMaxGridDimX: *v = 2147483647; return cudaSuccess;
    case cudaDevAttrWarpSize: *v = 32; return cudaSuccess;
    case cudaDevAttrMaxPitch: *v = static_cast<int>(cuda_emulation::max_pitch); return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *v = cuda_emulation::multiprocessors; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *v = 9; return cudaSuccess;  // (sm_90, as the device)
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = cuda_emulation::max_shared_optin; return cudaSuccess;
    case cudaDevAttrMemoryPoolsSupported: *v = 1; return cudaSuccess;
    }
    return cuda_emulation::fail(cudaErrorInvalidValue);
}
/// Every operation has completed when its call returns.
inline cudaError_t cudaDeviceSynchronize() {
    cuda_emulation::count_wait();
    cuda_emulation::flush_all_streams();
    return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------
namespace cuda_emulation {
/// cudaMalloc, and cudaMallocAsync (pooled) once its stream is checked.
inline cudaError_t allocate(void** p, std::size_t n, bool pooled) {
    if (p == nullptr) {
        return fail(cudaErrorInvalidValue);
    }
    *p = nullptr;
    if (n == 0) {
        return cudaSuccess;
    }
    void* mem = nullptr;
    if (n > max_allocation || posix_memalign(&mem, 256, n) != 0) {
        return fail(cudaErrorMemoryAllocation);
    }
    std::memset(mem, garbage_byte, n);
    {
        Registry& r = registry();
        std::lock_guard<std::mutex> lock(r.m);
        const auto base = reinterpret_cast<std::uintptr_t>(mem);
        r.allocations.emplace(base, n);
        if (pooled) {
            r.pooled.insert(base);
        }
        ++(pooled ? r.calls.pooled : r.calls.direct);
    }
    *p = mem;
    return cudaSuccess;
}

/// Whether p (not null) may be freed: the base of a live allocation, from cudaMallocAsync when
/// pooled_only. Called with the registry locked.
inline cudaError_t releasable(Registry& r, void* p, bool pooled_only, const char* call) {
    const auto base = reinterpret_cast<std::uintptr_t>(p);
    if (r.allocations.count(base) == 0) {
        return fail(cudaErrorInvalidValue);  // not the base of a live allocation
    }
    if (pooled_only && r.pooled.count(base) == 0) {
        return misuse(call, "the memory was not allocated by cudaMallocAsync");
    }
    return cudaSuccess;
}

/// cudaFree (any live allocation), and cudaFreeAsync (only one from cudaMallocAsync).
inline cudaError_t release(void* p, bool pooled_only, const char* call) {
    if (p == nullptr) {
        return cudaSuccess;
    }
    check_tape(call);
    {
        Registry& r = registry();
        std::lock_guard<std::mutex> lock(r.m);
        if (cudaError_t e = releasable(r, p, pooled_only, call); e != cudaSuccess) {
            return e;
        }
        const auto base = reinterpret_cast<std::uintptr_t>(p);
        r.allocations.erase(base);
        r.pooled.erase(base);
    }
    std::free(p);
    return cudaSuccess;
}
}  // namespace cuda_emulation

inline cudaError_t cudaMalloc(void** p, std::size_t n) {
    return cuda_emulation::allocate(p, n, false);
}

/// Stream-ordered allocation from the device's default pool (the work is done at the call).
inline cudaError_t cudaMallocAsync(void** p, std::size_t n, cudaStream_t stream) {
    if (!cuda_emulation::valid_stream(stream)) {
        return cuda_emulation::fail(cudaErrorInvalidResourceHandle);
    }
    return cuda_emulation::allocate(p, n, true);
}

inline cudaError_t cudaFree(void* p) {
    cuda_emulation::flush_all_streams();  // (cudaFree waits for the device)
    return cuda_emulation::release(p, false, "cudaFree");
}

inline cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
    using namespace cuda_emulation;
    if (!valid_stream(stream)) {
        return fail(cudaErrorInvalidResourceHandle);
    }
    if (p == nullptr || !lazy_streams()) {
        return release(p, true, "cudaFreeAsync");
    }
    {  // lazy: checked now, freed in stream order
        Registry& r = registry();
        std::lock_guard<std::mutex> lock(r.m);
        if (cudaError_t e = releasable(r, p, true, "cudaFreeAsync"); e != cudaSuccess) {
            return e;
        }
    }
    submit(stream, [p] { (void)release(p, true, "cudaFreeAsync"); });
    return cudaSuccess;
}

inline cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
    if (pool == nullptr || device != 0) {
        return cuda_emulation::fail(device != 0 ? cudaErrorInvalidDevice : cudaErrorInvalidValue);
    }
    *pool = cuda_emulation::default_pool();
    return cudaSuccess;
}

inline cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
    if (pool != cuda_emulation::default_pool() || value == nullptr ||
        attr != cudaMemPoolAttrReleaseThreshold) {
        return cuda_emulation::fail(cudaErrorInvalidValue);
    }
    cuda_emulation::Registry& r = cuda_emulation::registry();
    std::lock_guard<std::mutex> lock(r.m);
    std::memcpy(&r.release_threshold, value, sizeof(r.release_threshold));
    return cudaSuccess;
}

/// Freed memory goes straight back to the host here: nothing is kept to trim.
inline cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, std::size_t) {
    return pool == cuda_emulation::default_pool() ? cudaSuccess
                                                  : cuda_emulation::fail(cudaErrorInvalidValue);
}

inline cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
    cuda_emulation::count_wait();
    return cuda_emulation::copy_1d("cudaMemcpy", dst, src, n, kind, nullptr);
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
    return cuda_emulation::copy_1d("cudaMemcpyAsync", dst, src, n, kind, stream);
}
inline cudaError_t cudaMemcpy2D(void* dst, std::size_t dpitch, const void* src, std::size_t spitch,
                                std::size_t width, std::size_t height, cudaMemcpyKind kind) {
    cuda_emulation::count_wait();
    return cuda_emulation::copy_2d("cudaMemcpy2D", dst, dpitch, src, spitch, width, height, kind,
                                   nullptr);
}
inline cudaError_t cudaMemcpy2DAsync(void* dst, std::size_t dpitch, const void* src,
                                     std::size_t spitch, std::size_t width, std::size_t height,
                                     cudaMemcpyKind kind, cudaStream_t stream = nullptr) {
    return cuda_emulation::copy_2d("cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height,
                                   kind, stream);
}
inline cudaError_t cudaMemset(void* dst, int value, std::size_t n) {
    cuda_emulation::count_wait();
    return cuda_emulation::set_bytes("cudaMemset", dst, value, n, nullptr);
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t n,
                                   cudaStream_t stream = nullptr) {
    return cuda_emulation::set_bytes("cudaMemsetAsync", dst, value, n, stream);
}

// ---------------------------------------------------------------------------------------------
// Streams and events (work is done when its call returns: synchronising only checks handles)
// ---------------------------------------------------------------------------------------------
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { return cuda_emulation::create_handle(s); }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (cuda_emulation::is_handle(s)) {
        cuda_emulation::flush_stream(s);  // (its work completes; nothing waits for it in CUDA)
    }
    return cuda_emulation::destroy_handle(s);
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    cuda_emulation::count_wait();
    if (!cuda_emulation::valid_stream(s)) {
        return cuda_emulation::fail(cudaErrorInvalidResourceHandle);
    }
    cuda_emulation::flush_stream(s);
    return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cuda_emulation::create_handle(e); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
    if (cuda_emulation::is_handle(e)) {
        cuda_emulation::flush_stream(e->stream);  // (a queued record writes into it)
    }
    return cuda_emulation::destroy_handle(e);
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr) {
    if (!cuda_emulation::is_handle(e) || !cuda_emulation::valid_stream(s)) {
        return cuda_emulation::fail(cudaErrorInvalidResourceHandle);
    }
    e->stream = s;
    cuda_emulation::submit(s, [e] { e->at = std::chrono::steady_clock::now(); });
    return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    cuda_emulation::count_wait();
    if (!cuda_emulation::is_handle(e)) {
        return cuda_emulation::fail(cudaErrorInvalidResourceHandle);
    }
    cuda_emulation::flush_stream(e->stream);
    return cudaSuccess;
}
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    if (ms == nullptr || !cuda_emulation::is_handle(start) || !cuda_emulation::is_handle(end)) {
        return cuda_emulation::fail(ms == nullptr ? cudaErrorInvalidValue
                                                  : cudaErrorInvalidResourceHandle);
    }
    *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
    return cudaSuccess;
}

#include "emulated_launch.h"

/// Raises a kernel's dynamic shared memory limit (the one attribute the backend sets): up to
/// the opt-in maximum, else cudaErrorInvalidValue.
template <class... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
    using namespace cuda_emulation;
    if (kernel == nullptr || attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
        value > max_shared_optin) {
        return fail(cudaErrorInvalidValue);
    }
    std::lock_guard<std::mutex> lock(shared_limits_mutex);
    shared_limits[reinterpret_cast<const void*>(kernel)] = static_cast<std::size_t>(value);
    return cudaSuccess;
}
