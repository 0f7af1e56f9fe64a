// PagedKVView: a paged KV cache addressed through a CSR page table (FlashInfer's paged_kv_t
// layout). Plain pointers and sizes, passed by value into kernels; accessors are host/device.
#pragma once

#include <cstdint>

#include "kvsift/core/checked_math.hpp"
#include "kvsift/core/config.hpp"
#include "kvsift/core/device.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

template <class T>
struct PagedKVView {
  T* k_pages = nullptr;                   // [num_pages, kv_heads, page_size, head_dim]
  T* v_pages = nullptr;                   // [num_pages, kv_heads, page_size, head_dim]
  const std::int32_t* indptr = nullptr;   // [batch + 1] first page-table entry of each sequence
  const std::int32_t* indices = nullptr;  // [indptr[batch]] page ids
  const std::int32_t* last_page_len = nullptr;  // [batch] tokens in each sequence's last page
  std::int32_t batch = 0;
  std::int32_t num_pages = 0;
  std::int32_t kv_heads = 0;
  std::int32_t page_size = 0;
  std::int32_t head_dim = 0;
  Device device = Device::cpu;

  KVSIFT_HOST_DEVICE std::int32_t num_pages_of(std::int32_t b) const {
    return indptr[b + 1] - indptr[b];
  }
  // Tokens of sequence b: full pages plus the partly filled last one.
  KVSIFT_HOST_DEVICE std::int32_t get_length(std::int32_t b) const {
    const std::int32_t n = num_pages_of(b);
    return n == 0 ? 0 : (n - 1) * page_size + last_page_len[b];
  }
  // Element offset of (page id, head, entry in page, dim).
  KVSIFT_HOST_DEVICE std::int64_t offset(std::int32_t page, std::int32_t head, std::int32_t entry,
                                         std::int32_t dim) const {
    return ((static_cast<std::int64_t>(page) * kv_heads + head) * page_size + entry) * head_dim +
           dim;
  }
  // Pointer to the key row of token `pos` of sequence b in `head`.
  KVSIFT_HOST_DEVICE T* k_ptr(std::int32_t b, std::int32_t head, std::int32_t pos) const {
    const std::int32_t page = indices[indptr[b] + pos / page_size];
    return k_pages + offset(page, head, pos % page_size, 0);
  }
  KVSIFT_HOST_DEVICE T* v_ptr(std::int32_t b, std::int32_t head, std::int32_t pos) const {
    const std::int32_t page = indices[indptr[b] + pos / page_size];
    return v_pages + offset(page, head, pos % page_size, 0);
  }

  // Host-side check of a table that lives in host memory.
  void validate() const {
    KVSIFT_CHECK(page_size > 0 && kv_heads > 0 && head_dim > 0, "PagedKVView: page_size (",
                 page_size, "), kv_heads (", kv_heads, ") and head_dim (", head_dim,
                 ") must be positive");
    KVSIFT_CHECK(batch >= 0 && num_pages >= 0, "PagedKVView: batch (", batch, ") and num_pages (",
                 num_pages, ") must be >= 0");
    // offset() multiplies these in int64: the pool's element count must fit.
    const std::int64_t extents[4] = {num_pages, kv_heads, page_size, head_dim};
    checked_product(extents, 4,
                    "PagedKVView: page pool [num_pages, kv_heads, page_size, head_dim]");
    KVSIFT_CHECK(indptr != nullptr && last_page_len != nullptr,
                 "PagedKVView: indptr and last_page_len must be set");
    KVSIFT_CHECK(indptr[0] == 0, "PagedKVView: indptr[0] = ", indptr[0], ", expected 0");
    for (std::int32_t b = 0; b < batch; ++b) {
      KVSIFT_CHECK(indptr[b + 1] >= indptr[b], "PagedKVView: indptr decreases at ", b, " (",
                   indptr[b], " -> ", indptr[b + 1], ")");
      const std::int32_t n = num_pages_of(b);
      // get_length() computes (n - 1) * page_size + last in int32.
      KVSIFT_CHECK(n == 0 || checked_mul(std::int64_t{n}, std::int64_t{page_size},
                                         "PagedKVView: pages * page_size") <= INT32_MAX,
                   "PagedKVView: sequence ", b, " spans ", n, " pages of ", page_size,
                   " tokens, beyond int32 token positions");
      KVSIFT_CHECK(n == 0 || (last_page_len[b] >= 1 && last_page_len[b] <= page_size),
                   "PagedKVView: last_page_len[", b, "] = ", last_page_len[b], " outside [1, ",
                   page_size, "]");
      for (std::int32_t i = indptr[b]; i < indptr[b + 1]; ++i) {
        KVSIFT_CHECK(indices[i] >= 0 && indices[i] < num_pages, "PagedKVView: indices[", i,
                     "] = ", indices[i], " outside [0, num_pages = ", num_pages, ")");
      }
    }
  }
};

}  // namespace kvsift
