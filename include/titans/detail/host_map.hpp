#pragma once
// titans/detail/host_map.hpp: a view of host memory as an Eigen map (no copy), for the few
// places above the backends that run host code on a host-accessible backend's views (MAC's
// mixer on the CPU). A view in device memory must never reach it.

#include <type_traits>

#include "../types.hpp"
#include "../view.hpp"

namespace titans::detail {

template <class T>
using HostMap = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using ConstHostMap = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// The entries of a view in host memory as an Eigen map.
template <class T>
[[nodiscard]] ConstHostMap<T> host_map(View<const T> v) {
    return ConstHostMap<T>(v.data, v.rows, v.cols, Eigen::OuterStride<>(v.stride));
}
template <class T>
    requires(!std::is_const_v<T>)
[[nodiscard]] HostMap<T> host_map(View<T> v) {
    return HostMap<T>(v.data, v.rows, v.cols, Eigen::OuterStride<>(v.stride));
}

}  // namespace titans::detail
