// How the native CPU kernels (models/cpu_paged_attention.cc,
// quant/cpu_matmul.cc) spread their tasks over the cores: one rule, stated
// here once. utils.native_library builds every kernel with this header.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// Threads that run a ParallelFor's tasks: the calling thread and one helper
// fewer than the pool has threads (see ParallelFor). Kernels size their task
// splits by it.
inline int64_t NumWorkers(xla::ffi::ThreadPool& pool) { return std::max<int64_t>(1, pool.num_threads()); }

// Runs task(i) for i in [0, num_tasks) and returns when every one has
// finished. The calling thread works too, with helpers scheduled on XLA's
// intra-op pool, all taking the next task from an atomic counter.
//
// One helper fewer than the pool has threads: the calls are short (tens of
// microseconds) and many, and a third runnable thread on the dev VM's two
// cores made a batch-1 decode step slower (12.5 against 9.2 ms per token).
//
// A helper the pool starts late finds no task left and only touches the
// shared state, which it co-owns; it never runs `task`, so `task` may refer
// to the caller's stack.
template <typename Task>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t num_tasks, Task task) {
  struct Shared {
    Shared(Task task, int64_t num_tasks) : task(std::move(task)), num_tasks(num_tasks) {}

    Task task;
    int64_t num_tasks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    void Drain() {
      for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) {
        task(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(task), num_tasks);
  const int64_t helpers = std::min<int64_t>(NumWorkers(pool) - 1, num_tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->Drain(); });
  shared->Drain();
  while (shared->done.load(std::memory_order_acquire) < num_tasks) std::this_thread::yield();
}

}  // namespace jaxinfer
