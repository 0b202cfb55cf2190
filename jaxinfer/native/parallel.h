// How the native CPU kernels (paged_attention.cc,
// matmul.cc, q8_matmul.cc) spread their tasks over the
// cores: one rule, stated here once. build.py builds every kernel with this header.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// Threads that run a ParallelFor's tasks: the calling thread and one helper
// fewer than the pool has threads (see ParallelFor). Kernels size their task
// splits by it.
inline int64_t NumWorkers(xla::ffi::ThreadPool& pool) { return std::max<int64_t>(1, pool.num_threads()); }

// One worker's share of a ParallelFor's tasks, [front, back): its owner
// takes tasks from the front, thieves from the back. Both ends in one word
// (32 bits each: a call has far fewer tasks), changed by compare-and-swap,
// so a task is taken exactly once.
class alignas(64) Share {
 public:
  void Set(int64_t begin, int64_t end) { ends_.store(Pack(begin, end), std::memory_order_relaxed); }

  // The next task from the front (owner) or the back (thief); -1 when empty.
  int64_t Take(bool from_front) {
    uint64_t ends = ends_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<uint32_t>(ends), back = static_cast<int64_t>(ends >> 32);
      if (front >= back) return -1;
      const uint64_t taken = from_front ? Pack(front + 1, back) : Pack(front, back - 1);
      if (ends_.compare_exchange_weak(ends, taken, std::memory_order_acq_rel)) return from_front ? front : back - 1;
    }
  }

 private:
  static uint64_t Pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  std::atomic<uint64_t> ends_{0};
};

// The first task of worker w's share of num_tasks tasks (ParallelFor's
// split over min(NumWorkers, num_tasks) workers).
inline int64_t ShareBegin(int64_t num_tasks, int64_t workers, int64_t w) { return num_tasks * w / workers; }

// Where each of num_tasks tasks sorted longest first should go so that every
// share of ParallelFor holds every workers-th of them, still longest first:
// each core starts on a long task, and what a thief takes from a share's end
// is short. order[k] is the index task k of the sorted list takes. (For
// kernels whose tasks differ in length more than they gain from reading
// memory in order, like attention over contexts of different lengths.)
inline std::vector<int64_t> LongestFirstOrder(int64_t num_tasks, int64_t max_workers) {
  const int64_t workers = std::min(max_workers, num_tasks);
  std::vector<int64_t> next(workers), order(num_tasks);
  for (int64_t w = 0; w < workers; ++w) next[w] = ShareBegin(num_tasks, workers, w);
  for (int64_t k = 0, w = 0; k < num_tasks; ++k, w = (w + 1) % workers) {
    while (next[w] == ShareBegin(num_tasks, workers, w + 1)) w = (w + 1) % workers;  // share full
    order[k] = next[w]++;
  }
  return order;
}

// Runs task(i) for i in [0, num_tasks) and returns when every one has
// finished. The calling thread works too, with helpers scheduled on XLA's
// intra-op pool.
//
// Each worker owns a contiguous share of the tasks and runs it in order, then
// takes what is left of the other shares from their ends. Kernels number
// their tasks in the order of the memory they read, so each core streams one
// run of memory: tasks dealt out one by one from a shared counter went to the
// two cores alternately, and a core that reads every other 18 KB block
// streamed at 24-26 GB/s where one reading contiguous halves streamed at
// 33-49 (a microbenchmark of the default model's 64-column tiles,
// BENCHMARKS.md, "Why the CPU path is built this way"). A late helper's share is taken from its end
// by the workers already running, so no call waits for a helper to wake.
//
// One helper fewer than the pool has threads: the calls are short (tens of
// microseconds) and many, and a third runnable thread on the dev VM's two
// cores made a batch-1 decode step slower (12.5 against 9.2 ms per token).
//
// A helper the pool starts late finds no task left and only touches the
// shared state, which it co-owns; it never runs `task`, so `task` may refer
// to the caller's stack.
//
// Written once for all tasks (the task is called through a pointer): a copy
// of this body per call site added a third of a second to each kernel's
// build, which a machine's first start waits for.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t num_tasks, void (*run)(const void*, int64_t),
                        const void* task) {
  struct Shared {
    Shared(void (*run)(const void*, int64_t), const void* task, int64_t num_tasks, int64_t workers)
        : run(run), task(task), num_tasks(num_tasks), workers(workers), shares(new Share[workers]) {
      for (int64_t w = 0; w < workers; ++w) {
        shares[w].Set(ShareBegin(num_tasks, workers, w), ShareBegin(num_tasks, workers, w + 1));
      }
    }

    void (*run)(const void*, int64_t);
    const void* task;
    int64_t num_tasks, workers;
    std::unique_ptr<Share[]> shares;
    std::atomic<int64_t> next_share{0};
    std::atomic<int64_t> done{0};

    void Run(int64_t i) {
      run(task, i);
      done.fetch_add(1, std::memory_order_release);
    }

    void Drain() {
      const int64_t own = next_share.fetch_add(1);
      if (own < workers)
        for (int64_t i = shares[own].Take(true); i >= 0; i = shares[own].Take(true)) Run(i);
      for (int64_t k = 1; k <= workers; ++k) {
        Share& other = shares[(own + k) % workers];
        for (int64_t i = other.Take(false); i >= 0; i = other.Take(false)) Run(i);
      }
    }
  };
  const int64_t workers = std::min<int64_t>(NumWorkers(pool), num_tasks);
  auto shared = std::make_shared<Shared>(run, task, num_tasks, workers);
  for (int64_t i = 1; i < workers; ++i) pool.Schedule([shared] { shared->Drain(); });
  shared->Drain();
  while (shared->done.load(std::memory_order_acquire) < num_tasks) std::this_thread::yield();
}

template <typename Task>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t num_tasks, const Task& task) {
  ParallelFor(pool, num_tasks, [](const void* t, int64_t i) { (*static_cast<const Task*>(t))(i); }, &task);
}

// Runs of input groups each 64-column tile's sum is cut into, on every path
// of a matmul kernel's tiles, whatever the rows: a weight of few tiles split
// by columns alone leaves cores idle (the default model's 576 outputs are 9
// tiles, 5 on one core and 4 on the other, and its 192-output k and v
// projections 3). The parts' sums add up in order, so a row's result depends
// on the weight's shape and the core count only, never on the rows beside it.
inline int64_t InputParts(int64_t column_tiles, int64_t num_groups, int64_t workers) {
  int64_t best = 1;
  double best_idle = 1e9;
  for (int64_t parts = 1; parts <= std::min<int64_t>(4, num_groups); ++parts) {
    const int64_t tasks = column_tiles * parts;
    const double idle = static_cast<double>((tasks + workers - 1) / workers * workers - tasks) / tasks;
    if (idle < best_idle - 1e-9) best = parts, best_idle = idle;
  }
  return best;
}

// The first row of each run of rows that share a matrix, then `rows`:
// matrix[r] names row r's matrix (a MoE's expert), non-decreasing, so a
// kernel multiplies each run by its matrix once. False where the rows are
// not sorted so.
inline bool MatrixRuns(const int32_t* matrix, int64_t rows, std::vector<int64_t>* run_begin) {
  run_begin->clear();
  for (int64_t r = 0; r < rows; ++r) {
    if (r > 0 && matrix[r] < matrix[r - 1]) return false;
    if (r == 0 || matrix[r] != matrix[r - 1]) run_begin->push_back(r);
  }
  run_begin->push_back(rows);
  return true;
}

// Every task of several plans in one ParallelFor, the plans' tasks one after
// another (a layer's q, k and v as one loop: the cores share out all their
// tasks at once), then each plan's Finish(). A Plan has num_tasks, run(plan,
// task) and Finish(); the pointers stay put while its tasks refer to it.
template <typename Plan>
void RunPlans(xla::ffi::ThreadPool& pool, const std::vector<std::unique_ptr<Plan>>& plans) {
  std::vector<int64_t> first_task{0};
  for (const auto& plan : plans) first_task.push_back(first_task.back() + plan->num_tasks);
  ParallelFor(pool, first_task.back(), [&plans, &first_task](int64_t task) {
    const int64_t j = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    plans[j]->run(*plans[j], task - first_task[j]);
  });
  for (const auto& plan : plans) plan->Finish();
}

}  // namespace jaxinfer
