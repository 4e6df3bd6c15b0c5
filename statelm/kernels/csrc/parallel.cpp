// The kernels' thread pool (see parallel.h).
//
// One job at a time: its chunks are claimed through one 64-bit word, generation (24 bits) | back (20 bits)
// | front (20 bits), the unclaimed chunks being [front, back), by compare-and-swap, so a worker that wakes up late for an old generation can never claim a
// chunk of a newer job. Idle workers spin briefly (a decode step calls kernels a few tens of microseconds apart),
// yielding the core, then sleep on a condition variable.
//
// A read-ahead is a job of one chunk that only workers claim; the caller does not wait for it. Whoever posts the
// next job first stops it: raises a flag the reader checks every page, and either claims its chunk (no worker had)
// or waits for the worker that has it, which is then a page away from returning.

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
constexpr int64_t kChunksPerThread = 8;
constexpr int64_t kPage = 4096;
constexpr int64_t kLine = 64;

thread_local bool inside_chunk = false;
std::atomic<int64_t> configured_threads{0};  // 0: follow at::get_num_threads()

// A job's claim word: generation | back (one past the last unclaimed chunk) | front (the first unclaimed chunk).
uint64_t pack(uint64_t generation, uint64_t back, uint64_t front) {
  return ((generation & kGenerationMask) << (2 * kChunkBits)) | (back << kChunkBits) | front;
}

// Claims the front chunk (workers) or the back one (the caller) of `generation` by compare-and-swap on `word`;
// false once that job has no chunk left. Workers start where a read-ahead has loaded their caches.
bool claim(std::atomic<uint64_t>& word, uint64_t generation, bool from_back, uint64_t& chunk) {
  uint64_t state = word.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t back = (state >> kChunkBits) & kChunkMask, front = state & kChunkMask;
    if ((state >> (2 * kChunkBits)) != (generation & kGenerationMask) || front >= back) return false;
    chunk = from_back ? back - 1 : front;
    const uint64_t next = from_back ? pack(generation, back - 1, front) : state + 1;
    if (word.compare_exchange_weak(state, next, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
  }
}

class Pool {
 public:
  void run(int64_t n, int64_t grain, const Fn& fn, int64_t threads) {
    const int64_t chunks = (n + grain - 1) / grain;
    std::lock_guard<std::mutex> one_job(job_mutex_);
    stop_read_ahead();
    grow(threads - 1);
    const uint64_t generation = post(fn, n, grain);
    work(generation, true);
    while (done_.load(std::memory_order_acquire) < chunks) std::this_thread::yield();  // chunks others started
    if (error_) std::rethrow_exception(error_);
  }

  void read_ahead(std::vector<Span> spans, int64_t threads) {
    std::lock_guard<std::mutex> one_job(job_mutex_);
    stop_read_ahead();
    grow(threads - 1);
    spans_ = std::move(spans);
    stop_.store(false, std::memory_order_relaxed);
    reading_ = post(read_spans_, 1, 1);
  }

 private:
  void grow(int64_t count) {
    while (static_cast<int64_t>(workers_.size()) < count) workers_.emplace_back([this] { loop(); });
  }

  // Makes fn over [0, n) in chunks of `grain` the pool's job and wakes the workers; returns its generation.
  uint64_t post(const Fn& fn, int64_t n, int64_t grain) {
    fn_ = &fn;
    n_ = n;
    grain_ = grain;
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
    state_.store(pack(generation, static_cast<uint64_t>((n + grain - 1) / grain), 0), std::memory_order_seq_cst);
    generation_.store(generation, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    return generation;
  }

  // Ends the read-ahead in flight, if any (job_mutex_ held): claims its chunk or waits for the worker running it.
  void stop_read_ahead() {
    if (reading_ == 0) return;
    stop_.store(true, std::memory_order_release);
    uint64_t chunk = 0;
    if (claim(state_, reading_, true, chunk)) done_.fetch_add(1, std::memory_order_release);  // nobody reads
    while (done_.load(std::memory_order_acquire) < 1) STATELM_PAUSE();
    reading_ = 0;
  }

  // The read-ahead's one chunk: a volatile read of a byte in every 64 of spans_, checking stop_ every page.
  void read_spans() const {
    for (const Span& span : spans_) {
      const auto* data = static_cast<const volatile uint8_t*>(span.data);
      for (int64_t page = 0; page < span.bytes; page += kPage) {
        if (stop_.load(std::memory_order_relaxed)) return;
        for (int64_t at = page; at < std::min(span.bytes, page + kPage); at += kLine) (void)data[at];
      }
    }
  }

  // Claims and runs chunks of `generation` until none is left: the caller from the back, workers from the front.
  void work(uint64_t generation, bool from_back) {
    uint64_t chunk = 0;
    while (claim(state_, generation, from_back, chunk)) {
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
      work(generation, false);
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
  std::vector<Span> spans_;
  std::atomic<bool> stop_{false};
  uint64_t reading_ = 0;            // the generation of the read-ahead in flight, 0 when none
  const Fn read_spans_ = [this](int64_t, int64_t) { read_spans(); };
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

void read_ahead(std::vector<Span> spans) {
  const int64_t threads = num_threads();
  if (threads <= 1 || inside_chunk) return;
  pool().read_ahead(std::move(spans), threads);
}

}  // namespace statelm

TORCH_LIBRARY_FRAGMENT(statelm, m) {
  m.def("set_num_threads(int n) -> ()", [](int64_t n) { statelm::set_num_threads(n); });
  m.def("get_num_threads() -> int", []() { return statelm::num_threads(); });
}
