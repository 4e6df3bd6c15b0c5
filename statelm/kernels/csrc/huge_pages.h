// Memory for weights the kernels stream at every step, on 2 MiB pages where the OS gives them.
//
// A decode step reads every weight once, hundreds of megabytes, at the memory's rate. On 4 KiB pages each page is a
// TLB miss and a new stream for the hardware prefetchers: two cores read 25 GB/s from such memory where they read
// 33 GB/s from 2 MiB pages (a 2-core EPYC, measured with a plain read loop). Weights read in place stay on the
// file mapping's pages; the copies the kernels lay out at load (gguf_interleave) go here.

#pragma once

#include <ATen/ATen.h>

namespace statelm {

// An uninitialised uint8 tensor of `sizes` in a mapping of its own, aligned to 2 MiB and advised MADV_HUGEPAGE
// (transparent huge pages, in the kernel's "always" or "madvise" modes); its last partial 2 MiB stays on small
// pages, so nothing is wasted. Below 2 MiB, or where the OS has no such mapping, a plain at::empty.
at::Tensor empty_on_huge_pages(at::IntArrayRef sizes);

// Asks the OS to take back the pages of a file mapping wholly inside [begin, end) (MADV_PAGEOUT, Linux 5.4+; a hint:
// what is read again comes back from the file, and a kernel without it keeps them). Only for a mapped file's pages:
// anonymous memory would go to swap.
void release_file_pages(const void* begin, const void* end);

}  // namespace statelm
