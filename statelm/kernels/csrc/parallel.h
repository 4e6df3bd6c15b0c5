// A thread pool for statelm's kernels whose caller never waits for a thread that is not running.
//
// at::parallel_for (OpenMP) gives every thread of its team a fixed share and joins them at a barrier: when the OS
// has another thread on a worker's core (the server's event loop, another process), the caller finishes its share
// and waits a whole scheduler time slice, milliseconds, for work of microseconds (measured: a 576-wide matmul of one
// row took 8 ms instead of 70 us on a 2-core machine with other work running). Here the caller and the workers
// claim chunks one at a time from a shared word, the caller from the back and workers from the front (where a
// read_ahead has put the data in their caches): a worker that has not woken up claims nothing, the caller does
// the chunks itself, and it waits only for chunks another thread has already started.
//
// Which thread runs a chunk must not change the result: statelm's kernels split output columns, heads or rows,
// never a reduction, so every row is computed the same way whatever the scheduling.

#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace statelm {

// The number of threads kernels use, the caller included: set_num_threads(n) (n > 0), else at::get_num_threads().
void set_num_threads(int64_t n);
int64_t num_threads();

// Calls fn(begin, end) over [0, n) in chunks of at most `grain`, on the calling thread and up to
// num_threads() - 1 pool threads. Runs inline when there is one chunk, one thread, or it is called from
// inside a chunk. Rethrows the first exception a chunk threw, after every started chunk has finished.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Bytes a kernel will read soon.
struct Span {
  const void* data;
  int64_t bytes;
};

// Reads `spans` into the caches on one pool thread and returns at once: while the caller runs serial work (a
// decode step's attention, norms, activations), an idle core loads the weights of the next matmul. The next
// parallel_for or read_ahead stops it first. Does nothing with one thread or inside a chunk.
void read_ahead(std::vector<Span> spans);

}  // namespace statelm
