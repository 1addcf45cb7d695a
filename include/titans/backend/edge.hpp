#pragma once
// titans/backend/edge.hpp: how a layer's public call hands host matrices to its backend.
//
// The public forward/read calls take Eigen matrices (MatrixRef in, Matrix out); the kernels
// take views in the backend's memory. On a backend that reads host memory
// (BackendTraits<B>::host_accessible, the CPU) the views are the caller's own matrices, no
// copy; on any other the inputs are uploaded and the outputs downloaded through Transfer<B, T>,
// once per call.

#include <optional>

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
            buffer_.emplace(Transfer<B, T>::upload(view_of<T>(host)));
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
            buffer_.emplace(Transfer<B, T>::allocate(rows, cols));
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

}  // namespace titans::backend
