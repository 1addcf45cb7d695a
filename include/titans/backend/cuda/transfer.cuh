#pragma once
// titans/backend/cuda/transfer.cuh: Transfer<Cuda, T>, dense row-major matrices in device
// memory and the copies between them and host views (backend/backend.hpp, TransferBackend).

#include <cstddef>
#include <initializer_list>

#include "../../view.hpp"
#include "../backend.hpp"
#include "call_scope.cuh"
#include "runtime.cuh"

namespace titans::backend {

struct Cuda;

/// Device matrices: a Buffer is a dense rows x cols row-major DeviceBuffer; upload and download
/// are cudaMemcpy2D calls (synchronous with the host), so a host view is free to reuse on
/// return.
template <class T>
struct Transfer<Cuda, T> {
    struct Buffer {
        cuda::DeviceBuffer<T> mem;
        std::ptrdiff_t rows = 0, cols = 0;
    };
    static Buffer allocate(std::ptrdiff_t rows, std::ptrdiff_t cols) {
        return Buffer{cuda::DeviceBuffer<T>(static_cast<std::size_t>(rows * cols)), rows, cols};
    }
    /// A buffer for the call in progress only (cuda::call_buffer: lent by the thread's
    /// CallArena inside a deferring CallScope): what backend::call_scratch gives on CUDA.
    static Buffer scratch(std::ptrdiff_t rows, std::ptrdiff_t cols) {
        return Buffer{cuda::call_buffer<T>(static_cast<std::size_t>(rows * cols)), rows, cols};
    }
    /// upload into a scratch buffer (what backend::call_upload gives on CUDA).
    static Buffer upload_scratch(View<const T> host) {
        Buffer b = scratch(host.rows, host.cols);
        copy(view(b), host, cudaMemcpyHostToDevice, "upload (cudaMemcpy2D host to device)");
        return b;
    }
    static Buffer upload(View<const T> host) {
        Buffer b = allocate(host.rows, host.cols);
        copy(view(b), host, cudaMemcpyHostToDevice, "upload (cudaMemcpy2D host to device)");
        return b;
    }
    static View<T> view(Buffer& b) { return View<T>{b.mem.data(), b.rows, b.cols, b.cols}; }
    static View<const T> view(const Buffer& b) {
        return View<const T>{b.mem.data(), b.rows, b.cols, b.cols};
    }
    static void download(View<const T> from, View<T> host) {
        copy(host, from, cudaMemcpyDeviceToHost, "download (cudaMemcpy2D device to host)");
    }
    /// to += host: an upload, then GlueKernels<Cuda, T>::add (defined in glue_kernels.cuh).
    static void accumulate(View<const T> host, View<T> to);
    /// to <- from, same shape, either side strided.
    static void copy(View<T> to, View<const T> from, cudaMemcpyKind kind, const char* what) {
        if (to.rows == 0 || to.cols == 0) {
            return;
        }
        cuda::settle_recorded();
        cuda::check(cudaMemcpy2D(to.data, static_cast<std::size_t>(to.stride) * sizeof(T),
                                 from.data, static_cast<std::size_t>(from.stride) * sizeof(T),
                                 static_cast<std::size_t>(to.cols) * sizeof(T),
                                 static_cast<std::size_t>(to.rows), kind),
                    what);
    }
};

namespace cuda {

/// [parts[0] | parts[1] | ...] (rows x the sum of their columns, row-major) in a new device
/// buffer, from device views of the same rows (empty parts skipped): how a layer's prepared
/// parameters are laid out from a parameter buffer without leaving the device.
template <class T>
DeviceBuffer<T> concat_columns(std::initializer_list<View<const T>> parts) {
    std::ptrdiff_t rows = 0, cols = 0;
    for (const View<const T>& v : parts) {
        if (v.rows * v.cols == 0) continue;
        rows = v.rows;
        cols += v.cols;
    }
    DeviceBuffer<T> out(static_cast<std::size_t>(rows * cols));
    std::ptrdiff_t at = 0;
    for (const View<const T>& v : parts) {
        if (v.rows * v.cols == 0) continue;
        Transfer<Cuda, T>::copy(View<T>{out.data() + at, v.rows, v.cols, cols}, v,
                                cudaMemcpyDeviceToDevice, "cudaMemcpy2D (parameters on device)");
        at += v.cols;
    }
    return out;
}

/// A dense row-major rows x cols matrix in device memory, read as the CPU traces' matrices
/// are (rows(), cols()): what the training passes keep of their inputs.
template <class T>
struct DeviceMatrix {
    DeviceBuffer<T> mem;
    Eigen::Index r = 0, c = 0;
    [[nodiscard]] Eigen::Index rows() const { return r; }
    [[nodiscard]] Eigen::Index cols() const { return c; }
    [[nodiscard]] View<const T> view() const { return View<const T>{mem.data(), r, c, c}; }
    /// A dense copy of a device view (`what` names the copy in an error).
    static DeviceMatrix copy_of(View<const T> x, const char* what) {
        DeviceMatrix m;
        m.r = x.rows;
        m.c = x.cols;
        m.mem = DeviceBuffer<T>(static_cast<std::size_t>(x.rows * x.cols));
        Transfer<Cuda, T>::copy(View<T>{m.mem.data(), m.r, m.c, m.c}, x,
                                cudaMemcpyDeviceToDevice, what);
        return m;
    }
};

}  // namespace cuda
}  // namespace titans::backend
