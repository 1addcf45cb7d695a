#pragma once
// titans/detail/cpu_load.hpp: how many CPUs this process may use and how many of them other
// programs keep busy right now (Linux; elsewhere: nobody else is assumed busy).
//
// Read from /proc at the start of a call large enough to use threads (never per token):
//   usable CPUs       sched_getaffinity (the CPUs this process may run on)
//   runnable tasks    the 4th field of /proc/loadavg, "R/T": R tasks are runnable at this
//                     instant, system-wide, the reading thread included
//   our running ones  threads of this process in state R (/proc/self/task/*/stat): an
//                     OpenMP worker still spinning after the previous region is ours, not load
// busy_elsewhere = R - ours. A container whose /proc shows the host's tasks reads a busy
// machine and gets one thread: slower than it could be, never slower than one thread.

#include <chrono>
#include <cstdio>
#include <cstring>

#if defined(__linux__)
#include <dirent.h>
#include <sched.h>
#endif

namespace titans::detail {

/// CPUs this process may run on (at least 1).
inline int usable_cpus() {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        const int n = CPU_COUNT(&set);
        return n > 0 ? n : 1;
    }
#endif
    return 1;
}

#if defined(__linux__)
/// The state letter of a /proc/<pid>/stat or task stat file ('R' running), 0 if unreadable.
inline char proc_state(const char* path) {
    std::FILE* f = std::fopen(path, "r");
    if (f == nullptr) {
        return 0;
    }
    char buf[512];
    const std::size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const char* close = std::strrchr(buf, ')');  // the command name may hold spaces and ')'
    return (close != nullptr && close[1] == ' ') ? close[2] : char{0};
}

/// Threads of this process that are runnable now.
inline int own_running_threads() {
    DIR* dir = opendir("/proc/self/task");
    if (dir == nullptr) {
        return 1;
    }
    int running = 0;
    char path[64];
    while (const dirent* e = readdir(dir)) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') {
            continue;
        }
        std::snprintf(path, sizeof(path), "/proc/self/task/%.20s/stat", e->d_name);
        running += proc_state(path) == 'R' ? 1 : 0;
    }
    closedir(dir);
    return running > 0 ? running : 1;
}
#endif

/// Runnable tasks of other processes right now (0 where it cannot be known).
inline int read_busy_elsewhere() {
#if defined(__linux__)
    std::FILE* f = std::fopen("/proc/loadavg", "r");
    if (f == nullptr) {
        return 0;
    }
    double l1 = 0, l5 = 0, l15 = 0;
    int runnable = 0, total = 0;
    const int got = std::fscanf(f, "%lf %lf %lf %d/%d", &l1, &l5, &l15, &runnable, &total);
    std::fclose(f);
    if (got != 5) {
        return 0;
    }
    const int others = runnable - own_running_threads();
    return others > 0 ? others : 0;
#else
    return 0;
#endif
}

/// read_busy_elsewhere(), read at most once per millisecond per thread (a streamed token can
/// take less than 100 us; the read costs 25-50 us).
inline int busy_elsewhere() {
    using clock = std::chrono::steady_clock;
    thread_local clock::time_point last{};
    thread_local int value = 0;
    const auto now = clock::now();
    if (last == clock::time_point{} || now - last > std::chrono::milliseconds(1)) {
        value = read_busy_elsewhere();
        last = now;
    }
    return value;
}

}  // namespace titans::detail
