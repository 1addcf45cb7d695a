#pragma once
// titans/backend/cuda/runtime.cuh: the CUDA runtime as the CUDA backend uses it: the error
// type and checks, an owning device buffer (from the device's stream-ordered pool), a stream
// and a cuBLAS handle (RAII, no managed memory). Only CUDA translation units (nvcc) include
// the backend/cuda/ headers.

#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "../../error.hpp"

// The backend orders its blocking copies (cudaMemcpy, DeviceBuffer::copy_from, Transfer) with
// the work on its own streams through the legacy default stream's implicit synchronisation;
// a per-thread default stream would leave those copies unordered.
#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
#error "titans (CUDA backend): compile without --default-stream per-thread (see runtime.cuh)"
#endif

namespace titans {

/// A CUDA runtime or cuBLAS call failed (no device, out of device memory, a launch error).
/// The message names the call and the CUDA error string.
class CudaError : public Error {
public:
    using Error::Error;
};

namespace backend::cuda {

/// Throws CudaError naming `what` unless `e` is cudaSuccess.
inline void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
        throw CudaError(detail::concat("titans (CUDA backend): ", what, " failed: ",
                                       cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
    }
}

/// Throws CudaError naming `what` unless `s` is CUBLAS_STATUS_SUCCESS.
inline void check(cublasStatus_t s, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS) {
        throw CudaError(detail::concat("titans (CUDA backend): ", what, " failed: cuBLAS status ",
                                       static_cast<int>(s)));
    }
}

/// Checks the last kernel launch (configuration errors surface here, at once).
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

/// Number of CUDA devices (0 when there is no GPU or no driver; never throws).
inline int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();  // clear the sticky "no device" error
        return 0;
    }
    return n;
}

/// Process-wide switch for TF32 tensor-core GEMMs in float (off by default: float results
/// then match the CPU to ~1e-6). Read when a state is made (its cuBLAS handle's math mode).
inline std::atomic<bool>& tf32_flag() {
    static std::atomic<bool> flag{false};
    return flag;
}
inline void set_allow_tf32(bool on) { tf32_flag().store(on); }
[[nodiscard]] inline bool allow_tf32() { return tf32_flag().load(); }

/// Where DeviceBuffer takes its memory from.
///   Pooled  the current device's stream-ordered pool (cudaMallocAsync / cudaFreeAsync on the
///           legacy default stream; the pool keeps what is freed for the next allocation, so a
///           call that needs scratch makes no driver allocation once warm, and a free waits
///           for no one): the default where the device supports pools
///   Direct  cudaMalloc / cudaFree (each cudaFree waits for the device)
/// A buffer is freed the way it was allocated, whatever the setting is by then.
enum class DeviceMemory { Pooled, Direct };

inline std::atomic<DeviceMemory>& device_memory_flag() {
    static std::atomic<DeviceMemory> mode{DeviceMemory::Pooled};
    return mode;
}
/// Process-wide; read at each allocation.
inline void set_device_memory(DeviceMemory m) { device_memory_flag().store(m); }
[[nodiscard]] inline DeviceMemory device_memory() { return device_memory_flag().load(); }

namespace pool_detail {

/// The current device's default pool, ready for DeviceBuffer (its release threshold raised so
/// that memory freed into it stays there across synchronisations), or nullptr where the device
/// has no pools. Set up once per device.
inline cudaMemPool_t current_pool() {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return nullptr;
    }
    static std::mutex m;
    static cudaMemPool_t pools[64] = {};
    static bool probed[64] = {};
    const std::lock_guard<std::mutex> lock(m);
    if (!probed[dev]) {
        int supported = 0;
        cudaMemPool_t pool = nullptr;
        if (cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, dev) ==
                cudaSuccess &&
            supported != 0 && cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) {
            std::uint64_t keep = ~std::uint64_t(0);
            if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) ==
                cudaSuccess) {
                pools[dev] = pool;
            }
        }
        (void)cudaGetLastError();  // a device without pools: Direct, no sticky error
        probed[dev] = true;
    }
    return pools[dev];
}

}  // namespace pool_detail

/// A process-wide switch's default from the environment: `fallback` where `name` is unset,
/// else whether it is "1" (so "0" turns off a switch that is on by default, the split decode
/// attention's; "1" turns on an opt-in one: call graphs, the fused feed-forward).
inline bool env_switch(const char* name, bool fallback = false) {
    const char* v = std::getenv(name);
    return v == nullptr ? fallback : std::strcmp(v, "1") == 0;
}

namespace tape_detail {
/// Set while this thread's call tape (call_graph.cuh) holds recorded work that has not run:
/// runs it.
inline void (*&settle_hook())() {
    thread_local void (*hook)() = nullptr;
    return hook;
}
}  // namespace tape_detail

/// Runs the work this thread's call tape holds (call_graph.cuh), if any: called before an
/// operation that must come after it (a copy to or from the host, a wait, a free, a launch on
/// another stream).
inline void settle_recorded() {
    if (auto* settle = tape_detail::settle_hook()) {
        settle();
    }
}

/// `bytes` from `from` to `to` (host or device, as `kind` says), synchronously and after the
/// work this thread's call tape holds: every copy the backend makes outside a stream goes
/// through here, so none can overtake recorded work. Nothing for 0 bytes; CudaError naming
/// `what` on failure.
inline void copy_now(void* to, const void* from, std::size_t bytes, cudaMemcpyKind kind,
                     const char* what) {
    if (bytes > 0) {
        settle_recorded();
        check(cudaMemcpy(to, from, bytes, kind), what);
    }
}

/// Waits for stream s, after the recorded work (as copy_now).
inline void wait_now(cudaStream_t s, const char* what) {
    settle_recorded();
    check(cudaStreamSynchronize(s), what);
}

/// `bytes` of device memory at p set to the byte `value`, as copy_now: after the recorded work.
inline void set_now(void* p, int value, std::size_t bytes, const char* what) {
    if (bytes > 0) {
        settle_recorded();
        check(cudaMemset(p, value, bytes), what);
    }
}

/// `bytes` of device memory as device_memory() says (pooled reports which); CudaError naming
/// the call when the device has none left.
inline void* device_allocate(std::size_t bytes, bool& pooled) {
    void* p = nullptr;
    pooled = device_memory() == DeviceMemory::Pooled && pool_detail::current_pool() != nullptr;
    if (pooled) {
        check(cudaMallocAsync(&p, bytes, cudaStreamLegacy), "cudaMallocAsync");
    } else {
        check(cudaMalloc(&p, bytes), "cudaMalloc");
    }
    return p;
}

/// Frees what device_allocate gave, the same way: into the pool once the work before it on
/// every blocking stream is done (the legacy stream's ordering), or with cudaFree.
inline void device_free(void* p, bool pooled) noexcept {
    if (p == nullptr) {
        return;
    }
    try {
        settle_recorded();  // the recorded work may read p
    } catch (...) {  // a destructor cannot throw a recorded launch's error (a bug: tested)
    }
    if (pooled) {
        (void)cudaFreeAsync(p, cudaStreamLegacy);
    } else {
        (void)cudaFree(p);
    }
}

/// Hands the memory the current device's pool keeps back to the driver (after waiting for the
/// device): for a program that is done with the GPU for a while. Buffers alive keep theirs.
inline void release_cached_device_memory() {
    if (cudaMemPool_t pool = pool_detail::current_pool(); pool != nullptr) {
        settle_recorded();
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        check(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
    }
}

/// An owning array of n elements of T in device memory (device_allocate: the device's pool by
/// default, see DeviceMemory). Copies are deep (device to device, and owning); a moved-from
/// buffer is empty. A borrowed one (borrowed(p, n): memory a CallScope's arena lends for the
/// call, call_scope.cuh) frees nothing.
template <class T>
class DeviceBuffer {
public:
    DeviceBuffer() = default;
    explicit DeviceBuffer(std::size_t n) : n_(n) {
        if (n_ > 0) {
            p_ = static_cast<T*>(device_allocate(n_ * sizeof(T), pooled_));
        }
    }
    /// n elements at p, owned elsewhere (valid while their owner keeps them).
    static DeviceBuffer borrowed(T* p, std::size_t n) {
        DeviceBuffer b;
        b.p_ = p;
        b.n_ = n;
        b.borrowed_ = true;
        return b;
    }
    DeviceBuffer(const DeviceBuffer& o) : DeviceBuffer(o.n_) { copy_from(o); }
    DeviceBuffer(DeviceBuffer&& o) noexcept
        : p_(std::exchange(o.p_, nullptr)),
          n_(std::exchange(o.n_, 0)),
          pooled_(o.pooled_),
          borrowed_(std::exchange(o.borrowed_, false)) {}
    /// Copies o's elements; reuses this buffer's memory when the sizes agree (no allocation).
    DeviceBuffer& operator=(const DeviceBuffer& o) {
        if (this == &o) {
            return *this;
        }
        if (n_ == o.n_) {
            copy_from(o);
        } else {
            DeviceBuffer tmp(o);
            swap(tmp);
        }
        return *this;
    }
    DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
        DeviceBuffer tmp(std::move(o));
        swap(tmp);
        return *this;
    }
    ~DeviceBuffer() {
        if (!borrowed_) {
            device_free(p_, pooled_);
        }
    }
    void swap(DeviceBuffer& o) noexcept {
        std::swap(p_, o.p_);
        std::swap(n_, o.n_);
        std::swap(pooled_, o.pooled_);
        std::swap(borrowed_, o.borrowed_);
    }
    /// Grows to at least n elements (contents lost when it grows).
    void reserve(std::size_t n) {
        if (n > n_) {
            DeviceBuffer tmp(n);
            swap(tmp);
        }
    }
    /// Copies o's elements (same size) into this buffer, on the legacy stream.
    void copy_from(const DeviceBuffer& o) {
        copy_now(p_, o.p_, n_ * sizeof(T), cudaMemcpyDeviceToDevice,
                 "cudaMemcpy (device to device)");
    }
    [[nodiscard]] T* data() { return p_; }
    [[nodiscard]] const T* data() const { return p_; }
    [[nodiscard]] std::size_t size() const { return n_; }

private:
    T* p_ = nullptr;
    std::size_t n_ = 0;
    bool pooled_ = false;
    bool borrowed_ = false;
};

/// A state's per-call workspaces W, not part of its value: a copy of the state starts with an
/// empty W, and assigning a state keeps the target's own (no device copies of scratch).
template <class W>
class Scratch {
public:
    Scratch() = default;
    Scratch(const Scratch&) {}
    Scratch& operator=(const Scratch&) { return *this; }
    Scratch(Scratch&&) = default;
    Scratch& operator=(Scratch&&) = default;
    ~Scratch() = default;
    [[nodiscard]] W& operator*() { return w_; }
    [[nodiscard]] W* operator->() { return &w_; }

private:
    W w_;
};

/// n host elements copied into a new device buffer (synchronous).
template <class T>
DeviceBuffer<T> upload_array(const T* host, std::size_t n) {
    DeviceBuffer<T> b(n);
    copy_now(b.data(), host, n * sizeof(T), cudaMemcpyHostToDevice, "cudaMemcpy (host to device)");
    return b;
}

/// The cuBLAS workspace a host thread's context owns (StreamContext::OwnWorkspace): 32 MiB
/// on compute capability 9 and above, 4 MiB before (the sizes of cuBLAS's own default pool,
/// so that its choice of algorithm is the same).
inline std::size_t blas_workspace_bytes() {
    int dev = 0, major = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
          "cudaDeviceGetAttribute (compute capability)");
    return std::size_t(major >= 9 ? 32 : 4) << 20;
}

/// A CUDA stream and a cuBLAS handle bound to it: each state owns one, so states on different
/// host threads run concurrently. The stream is a blocking one (ordered with the legacy
/// default stream that Transfer's copies use).
class StreamContext {
public:
    /// Tag: the context owns its handle's workspace (cublasSetWorkspace, blas_workspace_bytes),
    /// as a host thread's does: its products, captured into a call graph's child graphs
    /// (call_graph.cuh), then allocate nothing (a child graph may hold no allocation node).
    struct OwnWorkspace {};

    /// A stream and a handle; TF32 GEMMs in float when `tf32` (default: allow_tf32()).
    explicit StreamContext(bool tf32 = allow_tf32()) : tf32_(tf32) {
        check(cudaStreamCreate(&stream_), "cudaStreamCreate");
        bind();
    }
    /// As above, with a workspace of its own (OwnWorkspace).
    StreamContext(OwnWorkspace, bool tf32)
        : tf32_(tf32), workspace_(blas_workspace_bytes()) {
        check(cudaStreamCreate(&stream_), "cudaStreamCreate");
        bind(workspace_.data(), workspace_.size());
    }
    /// A handle of math mode `tf32` on `base`'s stream, which stays base's (not owned): work
    /// through either is ordered on that one stream, so the handle shares base's workspace
    /// when base has one (base outlives this context).
    StreamContext(const StreamContext& base, bool tf32)
        : tf32_(tf32), owns_stream_(false), stream_(base.stream_) {
        bind(static_cast<unsigned char*>(const_cast<void*>(base.ws_)), base.ws_bytes_);
    }
    /// A copy has its own stream and handle, with the same math mode.
    StreamContext(const StreamContext& o) : StreamContext(o.tf32_) {}
    StreamContext& operator=(const StreamContext& o) {
        if (this != &o && tf32_ != o.tf32_) {
            tf32_ = o.tf32_;
            check(cublasSetMathMode(blas_, tf32_ ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
                  "cublasSetMathMode");
        }
        return *this;
    }
    ~StreamContext() {
        (void)cublasDestroy(blas_);
        if (owns_stream_) (void)cudaStreamDestroy(stream_);
    }
    [[nodiscard]] cudaStream_t stream() const { return stream_; }
    [[nodiscard]] cublasHandle_t blas() const { return blas_; }
    /// Whether float products on this stream may use TF32 tensor cores.
    [[nodiscard]] bool tf32() const { return tf32_; }
    /// The handle's workspace (its own or its base's), or nullptr: cuBLAS's default pool.
    [[nodiscard]] const void* workspace() const { return ws_; }
    [[nodiscard]] std::size_t workspace_bytes() const { return ws_bytes_; }
    void synchronize() const { wait_now(stream_, "cudaStreamSynchronize"); }

private:
    /// The handle, bound to the stream, in the math mode, with `bytes` of workspace at ws when
    /// given (after the stream: cublasSetStream resets it); the stream released if it fails.
    void bind(unsigned char* ws = nullptr, std::size_t bytes = 0) {
        if (cublasCreate(&blas_) != CUBLAS_STATUS_SUCCESS) {
            if (owns_stream_) (void)cudaStreamDestroy(stream_);
            throw CudaError("titans (CUDA backend): cublasCreate failed");
        }
        try {
            check(cublasSetStream(blas_, stream_), "cublasSetStream");
            check(cublasSetMathMode(blas_,
                                    tf32_ ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
                  "cublasSetMathMode");
            if (ws != nullptr) {
                check(cublasSetWorkspace(blas_, ws, bytes), "cublasSetWorkspace");
                ws_ = ws;
                ws_bytes_ = bytes;
            }
        } catch (...) {  // no destructor runs for an object whose constructor threw
            (void)cublasDestroy(blas_);
            if (owns_stream_) (void)cudaStreamDestroy(stream_);
            throw;
        }
    }

    bool tf32_ = false;
    bool owns_stream_ = true;
    cudaStream_t stream_{};
    cublasHandle_t blas_{};
    DeviceBuffer<unsigned char> workspace_;  // OwnWorkspace's (freed after the handle)
    const void* ws_ = nullptr;
    std::size_t ws_bytes_ = 0;
};

}  // namespace backend::cuda
}  // namespace titans
