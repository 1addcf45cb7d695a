#pragma once
// titans/backend/edge.hpp: how a layer's public call hands host matrices to its backend.
//
// The public forward/read calls take Eigen matrices (MatrixRef in, Matrix out); the kernels
// take views in the backend's memory. On a backend that reads host memory
// (BackendTraits<B>::host_accessible, the CPU) the views are the caller's own matrices, no
// copy; on any other the inputs are uploaded and the outputs downloaded through Transfer<B, T>,
// once per call.

#include <optional>
#include <utility>

#include "../detail/tensor_slots.hpp"
#include "../types.hpp"
#include "../view.hpp"
#include "backend.hpp"

namespace titans::backend {

/// Host rows as the kernels of B read them: the host view itself, or an uploaded copy.
template <class B, class T>
class Upload {
public:
    explicit Upload(const MatrixRef<T>& host) {
        if constexpr (BackendTraits<B>::host_accessible) {
            view_ = view_of<T>(host);
        } else {
            buffer_.emplace(call_upload<B, T>(view_of<T>(host)));
            view_ = Transfer<B, T>::view(*buffer_);
        }
    }
    [[nodiscard]] View<const T> view() const { return view_; }

private:
    std::optional<typename Transfer<B, T>::Buffer> buffer_;
    View<const T> view_{};
};

/// A host output y, resized to rows x cols, as the kernels of B write it: y's own storage, or
/// a backend buffer that finish() downloads into y.
template <class B, class T>
class Download {
public:
    Download(Matrix<T>& y, Eigen::Index rows, Eigen::Index cols) : host_(y) {
        y.resize(rows, cols);
        if constexpr (BackendTraits<B>::host_accessible) {
            view_ = view_of(y);
        } else {
            buffer_.emplace(call_scratch<B, T>(rows, cols));
            view_ = Transfer<B, T>::view(*buffer_);
        }
    }
    [[nodiscard]] View<T> view() const { return view_; }
    /// Copies the result to the host (nothing to do on a host-accessible backend).
    void finish() {
        if constexpr (!BackendTraits<B>::host_accessible) {
            Transfer<B, T>::download(view_, view_of(host_));
        }
    }

private:
    Matrix<T>& host_;
    std::optional<typename Transfer<B, T>::Buffer> buffer_;
    View<T> view_{};
};

/// Host entries the kernels of B update in place (gradients they add to): the host view
/// itself, or an uploaded copy that finish() downloads back.
template <class B, class T>
class Update {
public:
    explicit Update(View<T> host) : host_(host) {
        if constexpr (BackendTraits<B>::host_accessible) {
            view_ = host;
        } else {
            buffer_.emplace(Transfer<B, T>::upload(host));
            view_ = Transfer<B, T>::view(*buffer_);
        }
    }
    [[nodiscard]] View<T> view() const { return view_; }
    /// Copies the updated entries to the host (nothing to do on a host-accessible backend).
    void finish() {
        if constexpr (!BackendTraits<B>::host_accessible) {
            Transfer<B, T>::download(view_, host_);
        }
    }

private:
    View<T> host_;
    std::optional<typename Transfer<B, T>::Buffer> buffer_;
    View<T> view_{};
};

/// A copy of host rows in B's memory that outlives the call: what a training forward keeps
/// for the backward pass (on the CPU a Matrix copy, elsewhere an upload).
template <class B, class T>
[[nodiscard]] typename Transfer<B, T>::Buffer keep(const MatrixRef<T>& host) {
    return Transfer<B, T>::upload(view_of<T>(host));
}

/// to += the tensors of `local` (host structs, as Params::tensors(local, cfg, .) visits them)
/// laid out flat in that order (to: 1 x detail::flat_size(local, cfg) in B's memory): on a
/// host-accessible backend each tensor is added in place, elsewhere they are packed and cross
/// in one upload (Transfer::accumulate). How a layer whose kernels hand back host gradients adds
/// them to a gradient buffer.
template <class B, class Params, class Config>
void add_flat(const Params& local, const Config& cfg,
              View<typename detail::ParamsScalar<Params>::type> to) {
    using T = typename detail::ParamsScalar<Params>::type;
    if constexpr (BackendTraits<B>::host_accessible) {
        detail::add_flat_host(local, cfg, to.data);
    } else {
        const auto slots = detail::tensor_slots(local, cfg);
        Matrix<T> packed(1, to.cols);
        Eigen::Index at = 0;
        for (const auto& s : slots) {
            packed.row(0).segment(at, s.size()) = s.array().matrix().transpose();
            at += s.size();
        }
        Transfer<B, T>::accumulate(view_of(std::as_const(packed)), to);
    }
}

namespace edge_detail {
/// op(tensor's entries, flat's) for every tensor of `to` (host structs) in Params::tensors
/// order, `flat` (1 x their flat size in B's memory) read in place on a host-accessible
/// backend, elsewhere after one download.
template <class B, class Params, class Config, class Op>
void to_host(View<const typename detail::ParamsScalar<Params>::type> flat, Params& to,
             const Config& cfg, Op op) {
    using T = typename detail::ParamsScalar<Params>::type;
    using A = Eigen::Array<T, Eigen::Dynamic, 1>;
    Matrix<T> host;
    const T* at = flat.data;
    if constexpr (!BackendTraits<B>::host_accessible) {
        host.resize(1, flat.cols);
        Transfer<B, T>::download(flat, view_of(host));
        at = host.data();
    }
    for (const auto& s : detail::tensor_slots(to, cfg)) {
        op(s.array(), Eigen::Map<const A>(at, s.size()));
        at += s.size();
    }
}
}  // namespace edge_detail

/// The inverse of add_flat: the tensors of `to` (host structs) += `flat` (1 x their flat size
/// in B's memory), tensor by tensor in Params::tensors order; off the host one download.
template <class B, class Params, class Config>
void add_to_host(View<const typename detail::ParamsScalar<Params>::type> flat, Params& to,
                 const Config& cfg) {
    edge_detail::to_host<B>(flat, to, cfg, [](auto&& t, const auto& f) { t += f; });
}

/// As add_to_host, but the tensors of `to` take flat's entries (=, every bit).
template <class B, class Params, class Config>
void copy_to_host(View<const typename detail::ParamsScalar<Params>::type> flat, Params& to,
                  const Config& cfg) {
    edge_detail::to_host<B>(flat, to, cfg, [](auto&& t, const auto& f) { t = f; });
}

}  // namespace titans::backend
