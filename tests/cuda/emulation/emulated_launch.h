#pragma once
// tests/cuda/emulation/emulated_launch.h: kernel launches of the CPU emulation of CUDA
// (cuda_runtime.h includes it): the launch checks, the built-in variables, __syncthreads, warp
// shuffles and atomics.
//
// A launch runs at the call, on the launching host thread: its blocks one after another, a
// block's threads as fibers of that host thread (on x86-64 a stack switch of our own, which
// costs a few nanoseconds; elsewhere ucontext, whose swapcontext makes a system call). A fiber runs threads of the block
// in order until one of them waits (at __syncthreads or a warp shuffle); the block's scheduler
// then starts the next threads on other fibers and resumes a waiting fiber once its barrier
// has opened. A kernel that never waits (the element-wise each()) thus runs as a plain loop on
// one fiber; one that waits gets a fiber per thread, from a pool kept across launches.
//
// Shared memory (__shared__ = static thread_local) is per host thread, so the blocks of one
// launch, which run one at a time, share it as a block's threads do; it is not cleared
// between blocks. A cluster launch (launch_cluster) runs a cluster's blocks together, on the
// same scheduler, each with dynamic shared memory of its own that the others reach through
// cluster_shared (distributed shared memory), and cluster_sync a barrier over all their
// threads; its kernels keep their shared memory dynamic (static __shared__ would be one for
// the whole cluster). Dynamic shared memory (a launch's `shmem` bytes, dynamic_shared()) is a
// buffer of the host thread, filled with 0xFF bytes (NaN in float and double) before each
// block, so a read of what the block did not write shows; above 48 KB a launch needs the
// kernel's cudaFuncAttributeMaxDynamicSharedMemorySize raised first (cudaFuncSetAttribute), as
// on a GPU. Threads that have exited count as arrived at __syncthreads (as on sm_70 and
// later). Undefined behaviour the emulator sees (a block deadlocked at its barriers, a shuffle
// whose mask names a lane that is not there or that does not take part, lanes disagreeing on
// the mask) aborts the process with a message naming the block and thread.

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define CUDA_EMULATION_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDA_EMULATION_ASAN 1
#endif
#endif
#if defined(CUDA_EMULATION_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

// Built-in variables: the running thread's, set by the scheduler before it resumes a fiber.
inline constexpr int warpSize = 32;
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace cuda_emulation {

#if defined(__x86_64__)
/// A suspended context: its stack pointer, where switch_context pushed its callee-saved
/// registers, its floating-point control words and its resume address.
struct Context {
    void* sp = nullptr;
};

/// Saves the running context into *from (its stack pointer after pushing rbp, rbx, r12-r15
/// and the MXCSR and x87 control words) and resumes the context whose stack pointer is `to`.
[[gnu::naked, gnu::noinline]] inline void switch_stack(void** /*from*/, void* /*to*/) {
    asm volatile(
        "pushq %rbp\n\t"
        "pushq %rbx\n\t"
        "pushq %r12\n\t"
        "pushq %r13\n\t"
        "pushq %r14\n\t"
        "pushq %r15\n\t"
        "subq $8, %rsp\n\t"
        "stmxcsr (%rsp)\n\t"
        "fnstcw 4(%rsp)\n\t"
        "movq %rsp, (%rdi)\n\t"
        "movq %rsi, %rsp\n\t"
        "ldmxcsr (%rsp)\n\t"
        "fldcw 4(%rsp)\n\t"
        "addq $8, %rsp\n\t"
        "popq %r15\n\t"
        "popq %r14\n\t"
        "popq %r13\n\t"
        "popq %r12\n\t"
        "popq %rbx\n\t"
        "popq %rbp\n\t"
        "ret\n\t");
}

inline void switch_context(Context& from, Context& to) { switch_stack(&from.sp, to.sp); }

/// A context that starts entry() (which must never return) on the stack [base, base + size):
/// the frame switch_stack pops, with the default control words (MXCSR 0x1F80: exceptions
/// masked, round to nearest, no flush of subnormals; x87 0x037F) and entry as the return
/// address, placed so that entry starts with the stack aligned as after a call. Not the host
/// thread's current words: a fiber made inside a call that flushes subnormals on the host
/// (MemoryConfig::flush_denormals) kept FTZ/DAZ for every later kernel thread it ran, as a
/// GPU's threads never do (the host's MXCSR is not the device's).
inline void make_context(Context& c, void* base, std::size_t size, void (*entry)()) {
    auto top = (reinterpret_cast<std::uintptr_t>(base) + size) & ~std::uintptr_t(15);
    auto* frame = reinterpret_cast<std::uint64_t*>(top - 72);  // 9 slots, 8 mod 16
    std::memset(frame, 0, 72);
    const std::uint32_t mxcsr = 0x1F80u;
    const std::uint16_t fpucw = 0x037Fu;
    std::memcpy(frame, &mxcsr, 4);
    std::memcpy(reinterpret_cast<char*>(frame) + 4, &fpucw, 2);
    frame[7] = reinterpret_cast<std::uint64_t>(entry);  // after the control words and 6 registers
    c.sp = frame;
}
#else
/// A suspended context (ucontext elsewhere than x86-64).
struct Context {
    ucontext_t uc{};
};

inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

inline void make_context(Context& c, void* base, std::size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = base;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

struct Block;

/// A fiber: a stack and a context. `busy` while it is inside a thread of the block (running or
/// waiting), idle between blocks.
struct Fiber {
    Context ctx;
    void* stack = nullptr;
    std::size_t stack_size = 0;
    Block* block = nullptr;               // the block of the thread it runs
    unsigned thread = 0;                  // the block-linear index of the thread it runs
    bool busy = false;
    const unsigned* wait_on = nullptr;    // waiting until *wait_on != wait_seen
    unsigned wait_seen = 0;
    void* fake_stack = nullptr;           // AddressSanitizer's, while switched away

    Fiber() = default;
    Fiber(const Fiber&) = delete;
    Fiber& operator=(const Fiber&) = delete;
    ~Fiber() {
        if (stack != nullptr) {  // the mapping starts a guard page below the stack
            const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
            munmap(static_cast<char*>(stack) - page, stack_size + page);
        }
    }
};

/// A warp's shuffle exchange: a slot per lane and a barrier (count and generation).
struct Warp {
    std::uint64_t slot[32];
    unsigned mask = 0;
    unsigned lanes = 32;  // lanes that exist (the block's last warp may be partial)
    unsigned arrived = 0;
    unsigned generation = 0;
};

/// A thread-block cluster being run (launch_cluster): its blocks, which run together, and the
/// barrier of cluster_sync over all their threads (those that exited count as arrived).
struct Cluster {
    std::vector<Block*> blocks;  // by rank
    unsigned threads = 0;
    unsigned finished = 0;
    unsigned arrived = 0;
    unsigned generation = 0;
};

/// A block being run: how to run a thread, its index, its dynamic shared memory, its cluster
/// (cluster launches), and its counters and barriers.
struct Block {
    void (*run)(const void*) = nullptr;  // calls the kernel with the launch's arguments
    const void* call = nullptr;
    uint3 idx{0, 0, 0};
    unsigned char* shared = nullptr;  // dynamic shared memory, `shared_size` bytes
    std::size_t shared_size = 0;
    Cluster* cluster = nullptr;
    unsigned rank = 0;  // in the cluster
    unsigned threads = 0;
    unsigned next = 0;      // the next thread not started
    unsigned finished = 0;
    unsigned arrived = 0;   // at __syncthreads
    unsigned generation = 0;
    std::vector<Warp> warps;
};

/// A host thread's emulated device: its fibers and the block they run (the running thread's,
/// set before each fiber resumes).
struct Scheduler {
    Context main;
    std::vector<std::unique_ptr<Fiber>> fibers;
    std::vector<Fiber*> idle;
    std::vector<Fiber*> waiting;
    Fiber* current = nullptr;
    Block* block = nullptr;
    void* fake_stack = nullptr;         // AddressSanitizer's, while on a fiber
    const void* main_bottom = nullptr;  // the host thread's stack (AddressSanitizer)
    std::size_t main_size = 0;
};
inline thread_local Scheduler scheduler;

/// Stack of a fiber: enough for the kernels' frames under AddressSanitizer too.
inline constexpr std::size_t fiber_stack = std::size_t(256) << 10;

[[noreturn]] inline void fault(const char* what) {
    const Block* b = scheduler.block;
    const unsigned t = scheduler.current != nullptr ? scheduler.current->thread : 0;
    std::fprintf(stderr,
                 "CUDA emulation: kernel fault in block (%u, %u, %u), thread %u of %u "
                 "(warp %u, lane %u): %s\n",
                 blockIdx.x, blockIdx.y, blockIdx.z, t, b != nullptr ? b->threads : 0u, t / 32,
                 t % 32, what);
    std::abort();
}

/// threadIdx of block-linear thread t.
inline void set_thread(unsigned t) {
    threadIdx = uint3{t % blockDim.x, (t / blockDim.x) % blockDim.y,
                      t / (blockDim.x * blockDim.y)};
}

// Context switches, told to AddressSanitizer (it keeps a shadow per stack).
inline void to_fiber(Scheduler& s, Fiber& f) {
    s.current = &f;
#if defined(CUDA_EMULATION_ASAN)
    __sanitizer_start_switch_fiber(&s.fake_stack, f.stack, f.stack_size);
#endif
    switch_context(s.main, f.ctx);
#if defined(CUDA_EMULATION_ASAN)
    __sanitizer_finish_switch_fiber(s.fake_stack, nullptr, nullptr);
#endif
    s.current = nullptr;
}

inline void arrived_on_fiber(Scheduler& s, Fiber& f) {
#if defined(CUDA_EMULATION_ASAN)
    __sanitizer_finish_switch_fiber(f.fake_stack, &s.main_bottom, &s.main_size);
#else
    (void)s;
    (void)f;
#endif
}

inline void to_scheduler(Scheduler& s, Fiber& f) {
#if defined(CUDA_EMULATION_ASAN)
    __sanitizer_start_switch_fiber(&f.fake_stack, s.main_bottom, s.main_size);
#endif
    switch_context(f.ctx, s.main);
    arrived_on_fiber(s, f);
}

/// A fiber's life: run the current block's threads not yet started, then idle until the
/// scheduler gives it a block again.
inline void fiber_main() {
    Scheduler& s = scheduler;
    arrived_on_fiber(s, *s.current);
    for (;;) {
        Fiber& f = *s.current;
        Block& b = *s.block;
        f.block = &b;
        while (b.next < b.threads) {
            f.thread = b.next++;
            set_thread(f.thread);
            b.run(b.call);
            ++b.finished;
            if (b.arrived > 0 && b.arrived + b.finished == b.threads) {  // the last ones exited
                b.arrived = 0;
                ++b.generation;
            }
            if (Cluster* c = b.cluster; c != nullptr && ++c->finished + c->arrived == c->threads &&
                                        c->arrived > 0) {
                c->arrived = 0;
                ++c->generation;
            }
        }
        f.busy = false;
        to_scheduler(s, f);
    }
}

/// An idle fiber (a new one when every fiber is busy).
inline Fiber& idle_fiber(Scheduler& s) {
    if (!s.idle.empty()) {
        Fiber* f = s.idle.back();
        s.idle.pop_back();
        return *f;
    }
    auto f = std::make_unique<Fiber>();
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    void* mem = mmap(nullptr, fiber_stack + page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
        fault("no memory for a fiber's stack");
    }
    mprotect(mem, page, PROT_NONE);  // guard page: a stack overflow faults
    f->stack = static_cast<char*>(mem) + page;
    f->stack_size = fiber_stack;
    make_context(f->ctx, f->stack, fiber_stack, fiber_main);
    s.fibers.push_back(std::move(f));
    return *s.fibers.back();
}

/// Runs fiber f (a new thread of s.block, or one whose barrier opened) until it waits or goes
/// idle.
inline void resume(Scheduler& s, Fiber& f) {
    if (f.busy) {
        s.block = f.block;
        blockIdx = f.block->idx;
        set_thread(f.thread);
    }
    f.busy = true;
    to_fiber(s, f);
    if (!f.busy) {
        s.idle.push_back(&f);
    }
}

/// Runs every thread of the n blocks to its end, the blocks together (a cluster's; one block
/// otherwise): their threads start in block order, and a waiting thread of any block resumes
/// once its barrier opens.
inline void run_blocks(Scheduler& s, Block* const* blocks, std::size_t n) {
    s.waiting.clear();
    for (;;) {
        bool started = true;
        for (std::size_t i = 0; i < n; ++i) {
            Block& b = *blocks[i];
            while (b.next < b.threads) {  // start the threads not started
                s.block = &b;
                blockIdx = b.idx;
                Fiber& f = idle_fiber(s);
                resume(s, f);
                if (f.busy) {
                    s.waiting.push_back(&f);
                }
            }
        }
        if (s.waiting.empty()) {
            break;
        }
        bool progress = false;
        std::size_t kept = 0;
        for (std::size_t i = 0; i < s.waiting.size(); ++i) {
            Fiber* f = s.waiting[i];
            if (*f->wait_on != f->wait_seen) {
                resume(s, *f);
                progress = true;
            }
            if (f->busy) {
                s.waiting[kept++] = f;
            }
        }
        s.waiting.resize(kept);
        for (std::size_t i = 0; i < n; ++i) {
            started = started && blocks[i]->next == blocks[i]->threads;
        }
        if (!progress && started) {
            s.current = s.waiting.front();
            s.block = s.current->block;
            blockIdx = s.block->idx;
            fault("deadlock: every live thread of the block waits at a barrier that cannot open "
                  "(__syncthreads or cluster_sync in divergent code, or a shuffle lane that "
                  "never comes)");
        }
    }
    s.block = nullptr;
}

/// Runs every thread of block b to its end.
inline void run_block(Scheduler& s, Block& b) {
    Block* one = &b;
    run_blocks(s, &one, 1);
}

/// The running thread's block, fiber and linear index (device code only).
inline Block& this_block() {
    if (scheduler.block == nullptr || scheduler.current == nullptr) {
        std::fprintf(stderr, "CUDA emulation: a device function called outside a kernel\n");
        std::abort();
    }
    return *scheduler.block;
}

/// Waits (yields to the scheduler) until generation moves past `seen`.
inline void wait_until_moved(const unsigned& generation, unsigned seen) {
    Scheduler& s = scheduler;
    Fiber& f = *s.current;
    f.wait_on = &generation;
    f.wait_seen = seen;
    to_scheduler(s, f);
    f.wait_on = nullptr;
}

/// A barrier of `count` participants: counter `arrived`, generation `gen`.
inline void barrier(unsigned& arrived, unsigned& gen, unsigned count) {
    const unsigned seen = gen;
    if (++arrived == count) {
        arrived = 0;
        ++gen;
        return;
    }
    wait_until_moved(gen, seen);
}

/// Arrival at the barrier of a block or cluster: `threads` threads, of which `finished` have
/// exited and count as arrived (the last thread to exit opens it too: fiber_main).
inline void arrive(unsigned& arrived, unsigned& generation, unsigned finished, unsigned threads) {
    const unsigned seen = generation;
    if (++arrived + finished == threads) {
        arrived = 0;
        ++generation;
        return;
    }
    wait_until_moved(generation, seen);
}

/// The running thread's warp, checking that `mask` names it and only lanes that exist.
inline Warp& warp_for(Block& b, unsigned mask, unsigned lane) {
    Warp& w = b.warps[scheduler.current->thread / 32];
    if ((mask >> lane & 1u) == 0) {
        fault("a warp-synchronous call whose mask leaves out the calling lane");
    }
    if (w.lanes < 32 && (mask >> w.lanes) != 0) {
        fault("a warp-synchronous call whose mask names lanes past the block's end");
    }
    if (w.arrived == 0) {
        w.mask = mask;
    } else if (w.mask != mask) {
        fault("lanes of a warp call a warp-synchronous function with different masks");
    }
    return w;
}

/// Lane `src`'s value of var, every lane of `mask` taking part (src clamped by the caller).
template <class T>
T exchange(unsigned mask, T var, unsigned src) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                  "CUDA shuffles move at most 8 bytes");
    Block& b = this_block();
    const unsigned lane = scheduler.current->thread % 32;
    Warp& w = warp_for(b, mask, lane);
    if ((mask >> src & 1u) == 0) {
        fault("a shuffle reads a lane that is not in its mask");
    }
    std::memcpy(&w.slot[lane], &var, sizeof(T));
    const auto count = static_cast<unsigned>(std::popcount(mask));
    barrier(w.arrived, w.generation, count);  // every lane's value is in
    T out;
    std::memcpy(&out, &w.slot[src], sizeof(T));
    barrier(w.arrived, w.generation, count);  // every lane has read
    return out;
}

/// The lane of the running thread (device code only).
inline unsigned lane_id() {
    (void)this_block();
    return scheduler.current->thread % 32;
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------
/// The dynamic shared memory of the running block (dynamic_shared()), and each kernel's
/// raised limit (cudaFuncSetAttribute; 48 KB where never raised).
struct DynamicShared {
    std::vector<unsigned char> bytes;
    std::size_t size = 0;
};
inline thread_local DynamicShared dynamic_shared_memory;
inline std::mutex shared_limits_mutex;
inline std::map<const void*, std::size_t> shared_limits;

inline std::size_t shared_limit(const void* kernel) {
    std::lock_guard<std::mutex> lock(shared_limits_mutex);
    const auto it = shared_limits.find(kernel);
    return it == shared_limits.end() ? std::size_t(48) << 10 : it->second;
}

/// The running block's dynamic shared memory (16-byte aligned), as `extern __shared__`.
inline void* dynamic_shared() { return this_block().shared; }

/// Whether a launch of grid x block threads with `shmem` bytes of dynamic shared memory is
/// one the device accepts (else cudaErrorInvalidConfiguration, as on an H100).
inline bool valid_configuration(dim3 grid, dim3 block, std::size_t shmem,
                                std::size_t limit = std::size_t(48) << 10) {
    const unsigned long long threads =
        static_cast<unsigned long long>(block.x) * block.y * block.z;
    return block.x >= 1 && block.y >= 1 && block.z >= 1 && block.x <= 1024 && block.y <= 1024 &&
           block.z <= 64 && threads <= max_threads_per_block && grid.x >= 1 &&
           grid.x <= 2147483647u && grid.y >= 1 && grid.y <= 65535 && grid.z >= 1 &&
           grid.z <= 65535 && shmem <= limit;
}

/// A grid's start: not from device code; gridDim and blockDim set.
inline Scheduler& start_grid(dim3 grid, dim3 block) {
    Scheduler& s = scheduler;
    if (s.block != nullptr) {
        std::fprintf(stderr, "CUDA emulation: a kernel launch from device code\n");
        std::abort();
    }
    gridDim = grid;
    blockDim = block;
    return s;
}

/// b set to run blockDim's threads of run(call), one thread's kernel body.
inline void prepare_block(Block& b, void (*run)(const void*), const void* call) {
    b.run = run;
    b.call = call;
    b.threads = blockDim.x * blockDim.y * blockDim.z;
    b.warps.resize((b.threads + 31) / 32);
    b.warps.back().lanes = b.threads - 32 * (static_cast<unsigned>(b.warps.size()) - 1);
}

/// Runs every block of the grid: run(call) is one thread's kernel body.
inline void run_grid(dim3 grid, dim3 block, void (*run)(const void*), const void* call) {
    Scheduler& s = start_grid(grid, block);
    Block b;
    prepare_block(b, run, call);
    b.shared = dynamic_shared_memory.bytes.data();
    b.shared_size = dynamic_shared_memory.size;
    for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = b.idx = uint3{x, y, z};
                b.next = b.finished = b.arrived = 0;
                if (dynamic_shared_memory.size > 0) {  // memset of a null pointer is undefined
                    std::memset(dynamic_shared_memory.bytes.data(), 0xFF,
                                dynamic_shared_memory.size);
                }
                run_block(s, b);
            }
        }
    }
}

/// Runs every cluster of the grid (`cluster` blocks each, the grid a multiple of it), a
/// cluster's blocks together, each with dynamic shared memory of its own (`shmem` bytes of
/// 0xFF). Static __shared__ variables stay one per host thread, so the blocks of a cluster
/// would share them: a cluster kernel keeps its shared memory dynamic.
inline void run_cluster_grid(dim3 grid, dim3 block, dim3 cluster, std::size_t shmem,
                             void (*run)(const void*), const void* call) {
    Scheduler& s = start_grid(grid, block);
    const unsigned n = cluster.x * cluster.y * cluster.z;
    std::vector<Block> blocks(n);
    std::vector<Block*> order(n);
    std::vector<unsigned char> shared(std::max<std::size_t>(shmem, 1) * n);
    Cluster c;
    for (unsigned i = 0; i < n; ++i) {
        Block& b = blocks[i];
        prepare_block(b, run, call);
        c.threads += b.threads;
        b.shared = shared.data() + i * std::max<std::size_t>(shmem, 1);
        b.shared_size = shmem;
        b.cluster = &c;
        b.rank = i;
        order[i] = &b;
    }
    c.blocks = order;
    for (unsigned z = 0; z < grid.z; z += cluster.z) {
        for (unsigned y = 0; y < grid.y; y += cluster.y) {
            for (unsigned x = 0; x < grid.x; x += cluster.x) {
                for (unsigned i = 0; i < n; ++i) {  // rank: x fastest, then y, then z
                    Block& b = blocks[i];
                    b.idx = uint3{x + i % cluster.x, y + i / cluster.x % cluster.y,
                                  z + i / (cluster.x * cluster.y)};
                    b.next = b.finished = b.arrived = 0;
                }
                c.finished = c.arrived = 0;
                std::memset(shared.data(), 0xFF, shared.size());
                run_blocks(s, order.data(), n);
            }
        }
    }
}

/// Kernel launches so far, per kernel (its address): what a test counts to see how many
/// launches a call makes.
inline std::mutex launch_counts_mutex;
inline std::map<const void*, long> launch_counts;
inline void count_launch(const void* kernel) {
    const std::lock_guard<std::mutex> lock(launch_counts_mutex);
    ++launch_counts[kernel];
}
/// How many launches of `kernel` ran so far.
inline long launches(const void* kernel) {
    const std::lock_guard<std::mutex> lock(launch_counts_mutex);
    const auto it = launch_counts.find(kernel);
    return it == launch_counts.end() ? 0 : it->second;
}

/// How many launches ran so far, of every kernel.
inline long total_launches() {
    const std::lock_guard<std::mutex> lock(launch_counts_mutex);
    long n = 0;
    for (const auto& [kernel, count] : launch_counts) {
        n += count;
    }
    return n;
}

/// Whether clusters of `cluster` blocks tile the grid: at most 8 blocks a cluster (the
/// portable size) and the grid a multiple of the cluster in each dimension.
inline bool valid_cluster(dim3 grid, dim3 cluster) {
    const unsigned long long n =
        static_cast<unsigned long long>(cluster.x) * cluster.y * cluster.z;
    return cluster.x >= 1 && cluster.y >= 1 && cluster.z >= 1 && n <= 8 &&
           grid.x % cluster.x == 0 && grid.y % cluster.y == 0 && grid.z % cluster.z == 0;
}

/// launch() and launch_cluster() (clustered: in clusters of `cluster` blocks).
template <class... P, class... A>
void launch_grid(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shmem, dim3 cluster,
                 bool clustered, cudaStream_t stream, A&&... args) {
    if (!valid_configuration(grid, block, shmem,
                             shared_limit(reinterpret_cast<const void*>(kernel))) ||
        (clustered && !valid_cluster(grid, cluster))) {
        fail(cudaErrorInvalidConfiguration);
        return;
    }
    if (!valid_stream(stream)) {
        fail(cudaErrorInvalidResourceHandle);
        return;
    }
    count_launch(reinterpret_cast<const void*>(kernel));
    struct Call {
        void (*kernel)(P...);
        std::tuple<std::decay_t<P>...> args;
    };
    auto call = std::make_shared<const Call>(
        Call{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)});
    submit(stream, [call, grid, block, shmem, cluster, clustered] {  // now, or when waited for
        void (*run)(const void*) = [](const void* c) {
            const Call& k = *static_cast<const Call*>(c);
            std::apply(k.kernel, k.args);
        };
        if (clustered) {
            run_cluster_grid(grid, block, cluster, shmem, run, call.get());
            return;
        }
        DynamicShared& dyn = dynamic_shared_memory;
        dyn.size = shmem;
        if (dyn.bytes.size() < shmem) {
            dyn.bytes.resize(shmem);
        }
        run_grid(grid, block, run, call.get());
    });
}

/// kernel<<<grid, block, shmem, stream>>>(args...): checks the configuration and the stream
/// (an error is left for cudaGetLastError, as a failed launch is), then runs the kernel.
/// The arguments are converted to the kernel's parameter types once, as a launch does, and
/// every thread gets its own copy.
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shmem, cudaStream_t stream,
            A&&... args) {
    launch_grid(kernel, grid, block, shmem, dim3(1, 1, 1), false, stream,
                std::forward<A>(args)...);
}

/// launch() in thread-block clusters of `cluster` blocks (cudaLaunchKernelEx with
/// cudaLaunchAttributeClusterDimension; valid_cluster, else cudaErrorInvalidConfiguration for
/// cudaGetLastError). Counted as launch() counts.
template <class... P, class... A>
void launch_cluster(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shmem, dim3 cluster,
                    cudaStream_t stream, A&&... args) {
    launch_grid(kernel, grid, block, shmem, cluster, true, stream, std::forward<A>(args)...);
}

/// The running block's rank in its cluster (0 outside a cluster launch, a cluster of one).
inline unsigned cluster_rank() { return this_block().rank; }

/// Blocks in the running block's cluster (1 outside a cluster launch).
inline unsigned cluster_blocks() {
    const Block& b = this_block();
    return b.cluster != nullptr ? static_cast<unsigned>(b.cluster->blocks.size()) : 1u;
}

/// The cluster's barrier: every thread of every block of the cluster arrives (those that
/// exited count as arrived); outside a cluster launch the block's.
inline void cluster_sync() {
    Block& b = this_block();
    if (b.cluster == nullptr) {
        arrive(b.arrived, b.generation, b.finished, b.threads);
    } else {
        Cluster& c = *b.cluster;
        arrive(c.arrived, c.generation, c.finished, c.threads);
    }
}

/// Where `p`, an address in the running block's dynamic shared memory, lies in block
/// `rank`'s of the same cluster (distributed shared memory, map_shared_rank).
inline void* cluster_shared(const void* p, unsigned rank) {
    Block& b = this_block();
    auto* at = const_cast<unsigned char*>(static_cast<const unsigned char*>(p));
    if (at < b.shared || at >= b.shared + b.shared_size) {
        fault("cluster_shared of an address outside the block's dynamic shared memory");
    }
    if (rank >= cluster_blocks()) {
        fault("cluster_shared of a rank outside the cluster");
    }
    return b.cluster == nullptr ? at : b.cluster->blocks[rank]->shared + (at - b.shared);
}

}  // namespace cuda_emulation

// ---------------------------------------------------------------------------------------------
// Device functions
// ---------------------------------------------------------------------------------------------
inline void __syncthreads() {
    cuda_emulation::Block& b = cuda_emulation::this_block();
    cuda_emulation::arrive(b.arrived, b.generation, b.finished, b.threads);
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    cuda_emulation::Block& b = cuda_emulation::this_block();
    cuda_emulation::Warp& w = cuda_emulation::warp_for(b, mask, cuda_emulation::lane_id());
    cuda_emulation::barrier(w.arrived, w.generation, static_cast<unsigned>(std::popcount(mask)));
}

/// Lane lane ^ lane_mask's var (within groups of `width` lanes; a lane past its group reads
/// its own).
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
    const auto lane = cuda_emulation::lane_id(), w = static_cast<unsigned>(width);
    const unsigned src = lane ^ static_cast<unsigned>(lane_mask);
    return cuda_emulation::exchange(mask, var, src >= (lane / w + 1) * w ? lane : src);
}

/// Lane lane + delta's var (a lane whose source is past its group reads its own).
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    const auto lane = cuda_emulation::lane_id(), w = static_cast<unsigned>(width);
    return cuda_emulation::exchange(mask, var, lane % w + delta >= w ? lane : lane + delta);
}

/// Lane lane - delta's var (a lane whose source is before its group reads its own).
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    const auto lane = cuda_emulation::lane_id(), w = static_cast<unsigned>(width);
    return cuda_emulation::exchange(mask, var, lane % w < delta ? lane : lane - delta);
}

/// Lane src_lane's var (within the caller's group of `width` lanes).
template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
    const auto lane = cuda_emulation::lane_id(), w = static_cast<unsigned>(width);
    return cuda_emulation::exchange(mask, var, lane / w * w + static_cast<unsigned>(src_lane) % w);
}

/// Memory fences: every emulated thread of a launch runs on one host thread.
inline void __threadfence() {}
inline void __threadfence_block() {}

// Atomics (std::atomic_ref: host threads may run launches concurrently). Each returns the old
// value.
template <class T>
T atomicAdd(T* address, T val) {
    return std::atomic_ref<T>(*address).fetch_add(val);
}
template <class T>
T atomicSub(T* address, T val) {
    return std::atomic_ref<T>(*address).fetch_sub(val);
}
template <class T>
T atomicExch(T* address, T val) {
    return std::atomic_ref<T>(*address).exchange(val);
}
template <class T>
T atomicMin(T* address, T val) {
    static_assert(std::is_integral_v<T>, "CUDA's atomicMin is for integers");
    std::atomic_ref<T> a(*address);
    T old = a.load();
    while (val < old && !a.compare_exchange_weak(old, val)) {
    }
    return old;
}
template <class T>
T atomicMax(T* address, T val) {
    static_assert(std::is_integral_v<T>, "CUDA's atomicMax is for integers");
    std::atomic_ref<T> a(*address);
    T old = a.load();
    while (val > old && !a.compare_exchange_weak(old, val)) {
    }
    return old;
}
template <class T>
T atomicCAS(T* address, T compare, T val) {
    std::atomic_ref<T>(*address).compare_exchange_strong(compare, val);
    return compare;
}
