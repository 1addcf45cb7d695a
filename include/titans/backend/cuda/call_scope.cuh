#pragma once
// titans/backend/cuda/call_scope.cuh: the context one call runs in on CUDA.
//
// Outside a CallScope every layer call runs on its own stream (a state's, or the calling
// thread's: thread_context()), checks its results' finiteness by reading a flag back, and
// returns with its stream idle: a call of a layer is complete when it returns, at the price of
// a host wait per layer call (and one per finiteness check).
//
// Inside a CallScope (what Model::forward opens, GlueKernels<Cuda, T>::CallScope) the whole
// call runs on this thread's stream in order, without waiting: a state's work goes to
// call_context(own) = thread_context() rather than to the state's own stream, a layer's
// "return idle" wait (idle(cx)) is skipped, and a finiteness check raises the scope's device
// flag instead of coming back (deferring()). The scope's owner reads that flag once, at the
// call's edge (flagged(): the call's one wait besides its transfers); if it is raised, the
// owner rolls the call back and runs it again outside the scope, where the first failing check
// throws its NonFiniteError with its place named, as it always did.
//
// Freed buffers stay safe without the waits: device buffers are freed stream-ordered on the
// legacy stream (runtime.cuh), which runs after the work already queued on every blocking
// stream, this thread's included.

#include <cstddef>

#include "../../view.hpp"
#include "launch.cuh"
#include "runtime.cuh"

namespace titans::backend::cuda {

/// This host thread's stream and cuBLAS handle (made on first use, with the TF32 setting of
/// that moment).
inline const StreamContext& thread_context() {
    thread_local const StreamContext ctx;
    return ctx;
}

/// A call on this thread's stream with its finiteness checks deferred to one device flag (see
/// the file comment). Scopes nest (the innermost one is active); a strict scope
/// (CallScope(false)) suspends the ones around it: inside it every check waits and throws at
/// its place again.
class CallScope {
public:
    explicit CallScope(bool defer = true) : prev_(active()), defer_(defer) {
        if (defer_) {
            flag_ = DeviceBuffer<unsigned>(1);
            check(cudaMemsetAsync(flag_.data(), 0, sizeof(unsigned), thread_context().stream()),
                  "cudaMemsetAsync (call flag)");
        }
        active() = defer_ ? this : nullptr;
    }
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;
    ~CallScope() { active() = prev_; }

    /// Whether a check of the call so far found a NaN or an infinity: the flag read back after
    /// everything queued on this thread's stream (one wait). False for a strict scope.
    [[nodiscard]] bool flagged() const {
        if (!defer_) {
            return false;
        }
        unsigned host = 0;
        const StreamContext& cx = thread_context();
        check(cudaMemcpyAsync(&host, flag_.data(), sizeof(unsigned), cudaMemcpyDeviceToHost,
                              cx.stream()),
              "cudaMemcpyAsync (call flag)");
        cx.synchronize();
        return host != 0;
    }

    /// The device flag a deferred check raises.
    [[nodiscard]] unsigned* flag() { return flag_.data(); }

    /// The active deferring scope of this thread, or null.
    static CallScope*& active() {
        thread_local CallScope* a = nullptr;
        return a;
    }

private:
    CallScope* prev_;
    bool defer_;
    DeviceBuffer<unsigned> flag_;
};

/// Whether finiteness checks are deferred (a deferring CallScope is active on this thread).
inline bool deferring() { return CallScope::active() != nullptr; }

/// This thread's stream with a handle of the other math mode than thread_context()'s (a
/// state made under the other TF32 setting keeps its precision inside a scope).
inline const StreamContext& thread_context_other_mode() {
    thread_local const StreamContext ctx(thread_context(), !thread_context().tf32());
    return ctx;
}

/// The context a state's work runs on: inside a deferring scope this thread's stream (with a
/// handle of the state's own math mode), else the state's own.
inline const StreamContext& call_context(const StreamContext& own) {
    if (!deferring()) {
        return own;
    }
    const StreamContext& t = thread_context();
    return own.tf32() == t.tf32() ? t : thread_context_other_mode();
}

/// The wait a layer call ends with outside a scope (its stream idle when it returns); inside
/// one the call's work stays queued in order on the thread's stream.
inline void idle(const StreamContext& cx) {
    if (!deferring()) {
        cx.synchronize();
    }
}

#if TITANS_CUDA_DEVICE_CODE
/// Raises the active scope's flag if y holds a NaN or an infinity (no wait). A scope must be
/// active (deferring()).
template <class T>
void defer_nonfinite(cudaStream_t stream, View<const T> y) {
    const T* yp = y.data;
    unsigned* f = CallScope::active()->flag();
    const long long ys = y.stride;
    const unsigned cols = static_cast<unsigned>(y.cols);
    each(stream, y.rows * y.cols, [=] __device__(unsigned i) {
        const T v = yp[(i / cols) * ys + i % cols];
        if (not_finite(v)) {
            atomicMax(f, 1u);
        }
    });
}

/// The first row of y holding a NaN or an infinity, or -1 (first_nonfinite_row, one wait);
/// inside a deferring scope -1 at once, the check deferred to the scope's flag.
template <class T>
long long checked_row(cudaStream_t stream, View<const T> y, unsigned* flag) {
    if (deferring()) {
        defer_nonfinite<T>(stream, y);
        return -1;
    }
    return first_nonfinite_row<T>(stream, y, flag);
}
#endif

}  // namespace titans::backend::cuda
