// The kernels' thread pool (see parallel.h).
//
// One job at a time: its chunks are claimed through one 64-bit word, generation (24 bits) | chunk count (20 bits)
// | next chunk (20 bits), by compare-and-swap, so a worker that wakes up late for an old generation can never claim a
// chunk of a newer job. Idle workers spin briefly (a decode step calls kernels a few tens of microseconds apart),
// yielding the core, then sleep on a condition variable.

#include "parallel.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STATELM_PAUSE() _mm_pause()
#else
#define STATELM_PAUSE() ((void)0)
#endif

namespace statelm {
namespace {

using Fn = std::function<void(int64_t, int64_t)>;

constexpr int kChunkBits = 20;
constexpr uint64_t kChunkMask = (uint64_t{1} << kChunkBits) - 1;
constexpr uint64_t kGenerationMask = (uint64_t{1} << (64 - 2 * kChunkBits)) - 1;
constexpr int kSpinRounds = 100;  // of a few pauses and a yield each: about 100 microseconds awake
constexpr int kPausesPerRound = 16;
constexpr int64_t kChunksPerThread = 4;

thread_local bool inside_chunk = false;
std::atomic<int64_t> configured_threads{0};  // 0: follow at::get_num_threads()

uint64_t pack(uint64_t generation, uint64_t chunks, uint64_t next) {
  return ((generation & kGenerationMask) << (2 * kChunkBits)) | (chunks << kChunkBits) | next;
}

class Pool {
 public:
  void run(int64_t n, int64_t grain, const Fn& fn, int64_t threads) {
    const int64_t chunks = (n + grain - 1) / grain;
    std::lock_guard<std::mutex> one_job(job_mutex_);
    grow(threads - 1);
    fn_ = &fn;
    n_ = n;
    grain_ = grain;
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
    state_.store(pack(generation, static_cast<uint64_t>(chunks), 0), std::memory_order_seq_cst);
    generation_.store(generation, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    work(generation);
    while (done_.load(std::memory_order_acquire) < chunks) std::this_thread::yield();  // chunks others started
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int64_t count) {
    while (static_cast<int64_t>(workers_.size()) < count) workers_.emplace_back([this] { loop(); });
  }

  // Claims and runs chunks of `generation` until none is left.
  void work(uint64_t generation) {
    for (;;) {
      uint64_t state = state_.load(std::memory_order_acquire);
      uint64_t chunk = 0;
      for (;;) {
        const uint64_t chunks = (state >> kChunkBits) & kChunkMask;
        chunk = state & kChunkMask;
        if ((state >> (2 * kChunkBits)) != (generation & kGenerationMask) || chunk >= chunks) return;
        if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
          break;
        }
      }
      const int64_t begin = static_cast<int64_t>(chunk) * grain_;
      inside_chunk = true;
      try {
        (*fn_)(begin, std::min(n_, begin + grain_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      inside_chunk = false;
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      uint64_t generation = seen;
      for (int round = 0; round < kSpinRounds && generation == seen; ++round) {
        for (int i = 0; i < kPausesPerRound; ++i) STATELM_PAUSE();
        std::this_thread::yield();
        generation = generation_.load(std::memory_order_acquire);
      }
      if (generation == seen) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        generation = generation_.load(std::memory_order_acquire);
      }
      seen = generation;
      work(generation);
    }
  }

  std::mutex job_mutex_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> state_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> done_{0};
  const Fn* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t grain_ = 1;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
};

Pool& pool() {
  static Pool* instance = new Pool;  // never destroyed: its threads sleep until the process exits
  return *instance;
}

}  // namespace

void set_num_threads(int64_t n) {
  TORCH_CHECK(n > 0, "set_num_threads: n must be positive");
  configured_threads.store(n);
}

int64_t num_threads() {
  const int64_t configured = configured_threads.load();
  return configured > 0 ? configured : at::get_num_threads();
}

void parallel_for(int64_t n, int64_t grain, const Fn& fn) {
  if (n <= 0) return;
  const int64_t threads = num_threads();
  // a few chunks per thread balance the load; more only add claims, each a contended compare-and-swap
  grain = std::max<int64_t>({1, grain, (n + kChunksPerThread * threads - 1) / (kChunksPerThread * threads)});
  if (threads <= 1 || n <= grain || inside_chunk) {
    fn(0, n);
    return;
  }
  pool().run(n, grain, fn, threads);
}

}  // namespace statelm

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def("set_num_threads(int n) -> ()", [](int64_t n) { statelm::set_num_threads(n); });
  m.def("get_num_threads() -> int", []() { return statelm::num_threads(); });
}
