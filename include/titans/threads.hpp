#pragma once
// titans/threads.hpp: how many threads a call may use (docs/design.md, "Threads").
//
// Every public forward/read of a memory, attention layer, block or model opens one decision
// for the whole call (nested layers follow it): the team is
//   1                      when the call's work is below kParallelWork multiply-adds (a
//                          token of a small model, a few rows: waking threads costs more),
//   min(max, free CPUs)    otherwise (never above the usable CPUs), where max comes from a
//                          ThreadLimit on the calling thread,
//                          else the object's set_threads(), else omp_get_max_threads()
//                          (OMP_NUM_THREADS), and free CPUs = usable CPUs - tasks of other
//                          programs runnable right now (adapt_to_load; Linux /proc).
// The team size is installed with omp_set_num_threads for the duration of the call (a
// per-thread setting, restored on return), so the library's own parallel regions and Eigen's
// parallel products both use it, and never nest: inside a region Eigen runs serially.

#include "error.hpp"
#include "detail/cpu_load.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>

namespace titans {

/// Thread settings of an object (set_threads) or of a call (ThreadLimit).
///   max            at most this many threads (and never more than the usable CPUs);
///                  0 = omp_get_max_threads() (OMP_NUM_THREADS)
///   adapt_to_load  use fewer when other programs keep CPUs busy at the start of the call
///                  (false: exactly `max` for every call large enough to use threads)
struct Threads {
    int max = 0;
    bool adapt_to_load = true;

    /// Throws ConfigError unless max >= 0.
    void validate(const char* where) const {
        detail::require<ConfigError>(max >= 0, where, "threads.max", max,
                                     ">= 0 (0 = OpenMP's default)");
    }
};

/// Calls below this many multiply-adds run on one thread whatever the settings.
inline constexpr double kParallelWork = 1.0e6;

namespace detail {

struct ThreadContext {
    const Threads* limit = nullptr;  // the innermost ThreadLimit of this thread, if any
    int depth = 0;                   // open ThreadScopes on this thread
};

inline ThreadContext& thread_context() {
    thread_local ThreadContext ctx;
    return ctx;
}

inline int openmp_max_threads() {
#if defined(_OPENMP)
    return omp_get_max_threads();
#else
    return 1;
#endif
}

inline void openmp_set_threads([[maybe_unused]] int n) {
#if defined(_OPENMP)
    omp_set_num_threads(n);
#endif
}

/// The team of an outermost call: see the file comment.
/// Never more threads than usable CPUs: more only oversubscribe the machine (and a huge `max`
/// would make OpenMP fail to start its threads).
inline int choose_team(const Threads& object, double work) {
    const Threads* call = thread_context().limit;
    const Threads& s = call != nullptr ? *call : object;
    const int cpus = usable_cpus();
    const int cap = std::min(s.max > 0 ? s.max : openmp_max_threads(), cpus);
    if (cap <= 1 || work < kParallelWork) {
        return 1;
    }
    if (!s.adapt_to_load) {
        return cap;
    }
    return std::clamp(cpus - busy_elsewhere(), 1, cap);
}

}  // namespace detail

/// One call's thread decision (RAII), opened by every public forward/read. The outermost scope
/// on a thread chooses the team from the settings, the work (multiply-adds) and the load; a
/// nested one (a block's memory) may only lower it with its own object setting. While it
/// lives, OpenMP regions and Eigen's products started from this thread use that team; the
/// previous OpenMP setting is restored on exit. Programs may open one around their own Eigen
/// or OpenMP work to get the same behaviour (one thread for small work, fewer under load):
///
///     { titans::ThreadScope team({}, 2.0e6); scores = Y * V.transpose(); }
class ThreadScope {
public:
    ThreadScope(const Threads& object, double work) {
        detail::ThreadContext& ctx = detail::thread_context();
        const int current = detail::openmp_max_threads();
        int team = 0;
        if (ctx.depth == 0) {
            team = detail::choose_team(object, work);
        } else {  // a ThreadLimit overrides the objects' settings here too
            const bool lower = ctx.limit == nullptr && object.max > 0;
            team = lower ? std::min(current, object.max) : current;
        }
        ++ctx.depth;
        if (team != current) {
            previous_ = current;
            detail::openmp_set_threads(team);
        }
    }
    ~ThreadScope() {
        --detail::thread_context().depth;
        if (previous_ > 0) {
            detail::openmp_set_threads(previous_);
        }
    }
    ThreadScope(const ThreadScope&) = delete;
    ThreadScope& operator=(const ThreadScope&) = delete;

private:
    int previous_ = 0;
};

/// Per call: while a ThreadLimit lives, the library's calls made from this thread use these
/// settings instead of the objects' own (innermost limit wins). Not shared with other threads.
///
///     { titans::ThreadLimit one({.max = 1}); y = model.forward(state, x); }
class ThreadLimit {
public:
    explicit ThreadLimit(Threads settings) : settings_(settings) {
        settings_.validate("ThreadLimit");
        previous_ = detail::thread_context().limit;
        detail::thread_context().limit = &settings_;
    }
    ~ThreadLimit() { detail::thread_context().limit = previous_; }
    ThreadLimit(const ThreadLimit&) = delete;
    ThreadLimit& operator=(const ThreadLimit&) = delete;

private:
    Threads settings_;
    const Threads* previous_ = nullptr;
};

}  // namespace titans
