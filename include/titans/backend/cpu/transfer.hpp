#pragma once
// titans/backend/cpu/transfer.hpp: views as Eigen maps, and the CPU's (trivial) Transfer.

#include <type_traits>

#include "../../detail/host_map.hpp"
#include "../../types.hpp"
#include "../../view.hpp"
#include "../backend.hpp"

namespace titans::backend {

struct Cpu;

namespace cpu {

/// A view as an Eigen map of the same entries (no copy): detail::host_map.
template <class T>
using ConstMap = detail::ConstHostMap<T>;
template <class T>
using MutableMap = detail::HostMap<T>;

template <class T>
[[nodiscard]] ConstMap<T> as_eigen(View<const T> v) {
    return detail::host_map(v);
}
template <class T>
    requires(!std::is_const_v<T>)
[[nodiscard]] MutableMap<T> as_eigen(View<T> v) {
    return detail::host_map(v);
}

}  // namespace cpu

/// Host memory is the CPU's memory: a buffer is a Matrix, upload and download are copies.
/// (The layers skip it on the CPU and pass the caller's matrices; it exists so that code
/// written for any backend runs on this one too.)
template <class T>
struct Transfer<Cpu, T> {
    using Buffer = Matrix<T>;
    static Buffer allocate(std::ptrdiff_t rows, std::ptrdiff_t cols) { return Buffer(rows, cols); }
    static Buffer upload(View<const T> host) { return Buffer(cpu::as_eigen(host)); }
    static View<T> view(Buffer& b) { return view_of(b); }
    static View<const T> view(const Buffer& b) { return view_of(b); }
    static void download(View<const T> from, View<T> host) {
        cpu::as_eigen(host) = cpu::as_eigen(from);
    }
    static void accumulate(View<const T> host, View<T> to) {
        cpu::as_eigen(to) += cpu::as_eigen(host);
    }
};

}  // namespace titans::backend
