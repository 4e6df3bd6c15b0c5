// Weight memory on 2 MiB pages (see huge_pages.h).

#include "huge_pages.h"

#include <c10/util/accumulate.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace statelm {

namespace {

constexpr int64_t kHugePage = int64_t{2} << 20;
constexpr int64_t kSmallPage = 4096;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

at::Tensor empty_on_huge_pages(at::IntArrayRef sizes) {
  const auto options = at::TensorOptions().dtype(at::kByte);
  const int64_t bytes = c10::multiply_integers(sizes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= kHugePage) {
    const int64_t length = round_up(bytes, kSmallPage);
    // over-map by a huge page, then unmap what lies before the first 2 MiB boundary and after the tensor
    void* raw = mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {
      const auto start = reinterpret_cast<uintptr_t>(raw);
      const auto aligned = static_cast<uintptr_t>(round_up(static_cast<int64_t>(start), kHugePage));
      if (aligned > start) munmap(raw, aligned - start);
      const uintptr_t end = aligned + length, mapped_end = start + length + kHugePage;
      if (mapped_end > end) munmap(reinterpret_cast<void*>(end), mapped_end - end);
      void* data = reinterpret_cast<void*>(aligned);
      madvise(data, length, MADV_HUGEPAGE);  // a hint: where refused, the pages are small
      return at::from_blob(data, sizes, [length](void* p) { munmap(p, length); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

void release_file_pages(const void* begin, const void* end) {
#if defined(__linux__) && defined(MADV_PAGEOUT)
  const auto first = (reinterpret_cast<uintptr_t>(begin) + kSmallPage - 1) / kSmallPage * kSmallPage;
  const auto last = reinterpret_cast<uintptr_t>(end) / kSmallPage * kSmallPage;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_PAGEOUT);  // refused: the pages stay
#else
  (void)begin, (void)end;
#endif
}

}  // namespace statelm
