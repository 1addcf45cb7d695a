// tests/cuda/emulation/test_emulation.cpp: the CPU emulation of CUDA itself (only in
// titans_cuda_emulated_tests): launch checks, barriers, shuffles, atomics, the copies' and
// cuBLAS's argument checks.

#include "catch.hpp"

#include <titans/backend/cuda/cuda.cuh>

#include <vector>

namespace {

namespace tc = titans::backend::cuda;

__global__ void block_sum_kernel(const int* in, int* out) {
    __shared__ int part[256];
    part[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    for (unsigned o = blockDim.x / 2; o > 0; o /= 2) {
        if (threadIdx.x < o) {
            part[threadIdx.x] += part[threadIdx.x + o];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = part[0];
    }
}

__global__ void shuffle_kernel(int* out) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    int x = lane;
    for (int o = 16; o > 0; o >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, o);
    }
    out[threadIdx.x] = x + 1000 * __shfl_down_sync(0xffffffffu, lane, 1);
}

__global__ void min_kernel(int* flag) { atomicMin(flag, 100 - static_cast<int>(threadIdx.x)); }

/// Counts the dynamic shared floats that hold the poison (NaN) before the block writes them,
/// then the entries that do not read back what the block wrote (block 0's thread 0).
__global__ void dynamic_kernel(int n, int* fresh, int* wrong) {
    float* sh = tc::dynamic_shared<float>();
    int nans = 0;
    for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
        nans += sh[i] != sh[i] ? 1 : 0;
    }
    atomicAdd(fresh, nans);
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
        sh[i] = static_cast<float>(i);
    }
    __syncthreads();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        int bad = 0;
        for (int i = 0; i < n; ++i) {
            bad += sh[i] != static_cast<float>(i) ? 1 : 0;
        }
        *wrong = bad;
    }
}

template <class T>
T* device_alloc(std::size_t n) {
    void* p = nullptr;
    REQUIRE(cudaMalloc(&p, n * sizeof(T)) == cudaSuccess);
    return static_cast<T*>(p);
}

}  // namespace

TEST_CASE("emulation: barriers and shuffles", "[cuda]") {
    const int blocks = 3, threads = 256;
    std::vector<int> host(blocks * threads);
    for (std::size_t i = 0; i < host.size(); ++i) {
        host[i] = static_cast<int>(i);
    }
    int* in = device_alloc<int>(host.size());
    int* out = device_alloc<int>(threads);
    REQUIRE(cudaMemcpy(in, host.data(), host.size() * sizeof(int), cudaMemcpyHostToDevice) ==
            cudaSuccess);
    tc::launch(block_sum_kernel, blocks, threads, nullptr, in, out);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    std::vector<int> sums(blocks);
    REQUIRE(cudaMemcpy(sums.data(), out, blocks * sizeof(int), cudaMemcpyDeviceToHost) ==
            cudaSuccess);
    for (int b = 0; b < blocks; ++b) {
        CHECK(sums[static_cast<std::size_t>(b)] == 256 * 256 * b + 255 * 128);
    }
    tc::launch(shuffle_kernel, 1, 64, nullptr, out);
    std::vector<int> sh(64);
    REQUIRE(cudaMemcpy(sh.data(), out, 64 * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(sh[0] == 496 + 1000);      // lane sum 0..31; lane 1's value
    CHECK(sh[31] == 496 + 31000);    // lane 31 reads its own
    tc::launch(min_kernel, 1, 64, nullptr, out);
    int m = 0;
    REQUIRE(cudaMemcpy(&m, out, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(m == 100 - 63);
    CHECK(cudaFree(in) == cudaSuccess);
    CHECK(cudaFree(out) == cudaSuccess);
}

TEST_CASE("emulation: launch errors", "[cuda]") {
    int* out = device_alloc<int>(1);
    const long launched = cuda_emulation::total_launches();  // a refused launch is not counted
    tc::launch(min_kernel, 0, 32, nullptr, out);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    CHECK(cudaGetLastError() == cudaSuccess);  // read and cleared
    tc::launch(min_kernel, 1, 1025, nullptr, out);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    CHECK_NOTHROW(tc::check_launch("after the errors were read"));
    CHECK(cuda_emulation::total_launches() == launched);
    tc::launch(min_kernel, 1, 32, nullptr, out);
    tc::launch(min_kernel, 2, 32, nullptr, out);
    CHECK(cuda_emulation::total_launches() - launched == 2);
    CHECK(cuda_emulation::launches(reinterpret_cast<const void*>(&min_kernel)) >= 2);
    CHECK(cudaFree(out) == cudaSuccess);
    CHECK(cudaFree(out) == cudaErrorInvalidValue);
    (void)cudaGetLastError();
}

TEST_CASE("emulation: copy checks", "[cuda]") {
    float* d = device_alloc<float>(16);
    std::vector<float> h(17, 1.0f);
    CHECK(cudaMemcpy2D(d, 4 * sizeof(float), h.data(), 8 * sizeof(float), 5 * sizeof(float), 2,
                       cudaMemcpyHostToDevice) == cudaErrorInvalidPitchValue);
    CHECK(cudaMemcpy2D(d, std::size_t(1) << 31, h.data(), 8, 4, 1, cudaMemcpyHostToDevice) ==
          cudaErrorInvalidPitchValue);
    CHECK(cudaMemcpy(d, h.data(), 17 * sizeof(float), cudaMemcpyHostToDevice) ==
          cudaErrorInvalidValue);  // past the allocation
    CHECK(cudaMemcpy(h.data(), d, 4, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
    CHECK(cudaMemcpy2D(d + 1, 8, d, 8, 8, 2, cudaMemcpyDeviceToDevice) == cudaErrorInvalidValue);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
    cublasHandle_t h0 = nullptr;
    REQUIRE(cublasCreate(&h0) == CUBLAS_STATUS_SUCCESS);
    const float one = 1, zero = 0;
    CHECK(cublasSgemm(h0, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, 3, d, 4, &zero, d, 4) ==
          CUBLAS_STATUS_INVALID_VALUE);  // lda < m
    float* c = device_alloc<float>(4);
    REQUIRE(cudaMemcpy(d, h.data(), 16 * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
    const long gemms = cuda_emulation::gemm_calls();  // a refused call is not counted
    CHECK(cublasSgemm(h0, CUBLAS_OP_T, CUBLAS_OP_N, 2, 2, 4, &one, d, 4, d, 4, &zero, c, 2) ==
          CUBLAS_STATUS_SUCCESS);
    CHECK(cuda_emulation::gemm_calls() - gemms == 1);
    float r[4] = {};
    REQUIRE(cudaMemcpy(r, c, sizeof r, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(r[3] == 4.0f);
    CHECK(cublasDestroy(h0) == CUBLAS_STATUS_SUCCESS);
    CHECK(cudaFree(c) == cudaSuccess);
    CHECK(cudaFree(d) == cudaSuccess);
}

// Dynamic shared memory: above 48 KB only after the kernel's limit is raised (as on a GPU),
// poisoned before every block (each block sees none of the previous block's values).
TEST_CASE("emulation: dynamic shared memory", "[cuda]") {
    const int n = 20000;  // 80,000 bytes
    const std::size_t bytes = n * sizeof(float);
    int* fresh = device_alloc<int>(1);
    int* wrong = device_alloc<int>(1);
    REQUIRE(cudaMemset(fresh, 0, sizeof(int)) == cudaSuccess);
    (void)cudaGetLastError();
    tc::launch_shared(dynamic_kernel, 2, 128, bytes, nullptr, n, fresh, wrong);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    tc::raise_shared_limit(dynamic_kernel, bytes);
    CHECK(tc::shared_memory_limit() >= bytes);
    tc::launch_shared(dynamic_kernel, 2, 128, bytes, nullptr, n, fresh, wrong);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    int nans = 0, bad = -1;
    REQUIRE(cudaMemcpy(&nans, fresh, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    REQUIRE(cudaMemcpy(&bad, wrong, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(nans == 2 * n);
    CHECK(bad == 0);
    CHECK(cudaFuncSetAttribute(dynamic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               1 << 20) == cudaErrorInvalidValue);
    (void)cudaGetLastError();
    cudaFree(fresh);
    cudaFree(wrong);
}

// Stream-ordered allocation: cudaMallocAsync / cudaFreeAsync check their stream, are counted
// apart from cudaMalloc, and cudaFreeAsync refuses memory cudaMalloc gave. DeviceBuffer takes
// the pool by default and cudaMalloc under DeviceMemory::Direct, and frees each buffer the way
// it was allocated even after the setting changed.
TEST_CASE("emulation: stream-ordered memory", "[cuda]") {
    namespace emu = cuda_emulation;
    void* p = nullptr;
    CHECK(cudaMallocAsync(&p, 64, reinterpret_cast<cudaStream_t>(0x5)) ==
          cudaErrorInvalidResourceHandle);
    (void)cudaGetLastError();
    const emu::AllocationCalls c0 = emu::allocation_calls();
    REQUIRE(cudaMallocAsync(&p, 64, cudaStreamLegacy) == cudaSuccess);
    void* q = nullptr;
    REQUIRE(cudaMalloc(&q, 64) == cudaSuccess);
    CHECK(emu::allocation_calls().pooled == c0.pooled + 1);
    CHECK(emu::allocation_calls().direct == c0.direct + 1);
    CHECK(cudaFreeAsync(q, cudaStreamLegacy) == cudaErrorInvalidValue);  // cudaMalloc's
    (void)cudaGetLastError();
    CHECK(cudaFreeAsync(p, cudaStreamLegacy) == cudaSuccess);
    CHECK(cudaFreeAsync(p, cudaStreamLegacy) == cudaErrorInvalidValue);  // freed already
    (void)cudaGetLastError();
    CHECK(cudaFree(q) == cudaSuccess);

    const emu::AllocationCalls c1 = emu::allocation_calls();
    {
        tc::DeviceBuffer<float> pooled(100);
        tc::set_device_memory(tc::DeviceMemory::Direct);
        tc::DeviceBuffer<float> direct(100);
        tc::DeviceBuffer<float> copy(pooled);  // allocated now: directly
        tc::set_device_memory(tc::DeviceMemory::Pooled);
        CHECK(emu::allocation_calls().pooled == c1.pooled + 1);
        CHECK(emu::allocation_calls().direct == c1.direct + 2);
        pooled.swap(direct);  // each still freed its own way below
    }
    CHECK(cudaGetLastError() == cudaSuccess);  // no free refused
    tc::release_cached_device_memory();
    CHECK(tc::device_memory() == tc::DeviceMemory::Pooled);
}

namespace {

__global__ void fill_kernel(float* out, int n, float v) {
    const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) {
        out[i] = v;
    }
}

/// Sets the lazy mode for a scope (emulated_streams.h), then puts it back.
struct LazyScope {
    bool old = cuda_emulation::lazy_streams();
    LazyScope() { cuda_emulation::set_lazy_streams(true); }
    LazyScope(const LazyScope&) = delete;
    LazyScope& operator=(const LazyScope&) = delete;
    ~LazyScope() { cuda_emulation::set_lazy_streams(old); }
};

}  // namespace

// The lazy mode: a kernel on stream a, read back on stream b with nothing ordering the two,
// shows the memory as it was (the race the eager mode hides); a wait for a, the legacy stream,
// or a device synchronisation runs a's work first. Stream-ordered frees wait for their stream.
TEST_CASE("emulation: lazy streams", "[cuda]") {
    const LazyScope lazy;
    const int n = 64;
    cudaStream_t a = nullptr, b = nullptr;
    REQUIRE(cudaStreamCreate(&a) == cudaSuccess);
    REQUIRE(cudaStreamCreate(&b) == cudaSuccess);
    float* d = device_alloc<float>(n);
    std::vector<float> h(n, 0.0f);
    REQUIRE(cudaMemcpy(d, h.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
    tc::launch(fill_kernel, 1, 64, a, d, n, 3.0f);
    REQUIRE(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, b) ==
            cudaSuccess);
    CHECK(h[5] == 0.0f);  // b's copy ran; a's kernel still waits
    REQUIRE(cudaStreamSynchronize(a) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, b) ==
            cudaSuccess);
    CHECK(h[5] == 3.0f);
    tc::launch(fill_kernel, 1, 64, a, d, n, 4.0f);
    REQUIRE(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(h[63] == 4.0f);  // the legacy stream waits for every stream
    // A host-to-device copy takes its bytes at the call.
    std::vector<float> src(n, 7.0f);
    REQUIRE(cudaMemcpyAsync(d, src.data(), n * sizeof(float), cudaMemcpyHostToDevice, a) ==
            cudaSuccess);
    src.assign(n, 8.0f);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(h[0] == 7.0f);
    // A stream-ordered free waits for its stream: still allocated until then.
    void* p = nullptr;
    REQUIRE(cudaMallocAsync(&p, 256, a) == cudaSuccess);
    REQUIRE(cudaFreeAsync(p, a) == cudaSuccess);
    CHECK(cuda_emulation::is_device_pointer(p));
    REQUIRE(cudaStreamSynchronize(a) == cudaSuccess);
    CHECK_FALSE(cuda_emulation::is_device_pointer(p));
    CHECK(cudaFree(d) == cudaSuccess);
    CHECK(cudaStreamDestroy(a) == cudaSuccess);
    CHECK(cudaStreamDestroy(b) == cudaSuccess);
}
