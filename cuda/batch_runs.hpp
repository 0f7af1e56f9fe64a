// Ragged batches on the GPU (internal to cuda/*.cu, not installed). The scoring kernels address a
// sequence's rows through one length S (their per-token buffers are [rows, S] and their grids
// span S), so a batch whose sequences hold different lengths is cut into runs of consecutive
// sequences of equal length, and each run is scored by the unchanged kernels over a view of its
// slice of the batch. An equal-length batch is one run: the same single set of launches as
// before, and every result (determinism, the tensor-core search's exactness) is the kernels' own.
#pragma once

#include <cstdint>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift::cuda::detail {

// Sequences [first, first + count) of the batch, all `length` tokens long.
struct LengthRun {
  std::int64_t first = 0, count = 0;
  std::int32_t length = 0;
};

//   lengths [batch] host
inline std::vector<LengthRun> equal_length_runs(const std::int32_t* lengths, std::int64_t batch) {
  std::vector<LengthRun> runs;
  for (std::int64_t b = 0; b < batch; ++b) {
    if (!runs.empty() && runs.back().length == lengths[b]) {
      ++runs.back().count;
    } else {
      runs.push_back({b, 1, lengths[b]});
    }
  }
  return runs;
}

// Sequences [first, first + count) of a [batch, ...] tensor: same strides, shifted base.
inline TensorView batch_slice(const TensorView& t, std::int64_t first, std::int64_t count) {
  TensorView s = t;
  s.data = static_cast<char*>(t.data) +
           first * t.stride[0] * static_cast<std::int64_t>(dtype_size(t.dtype));
  s.shape[0] = count;
  return s;
}

// The cache of sequences [first, first + count): keys, values, host lengths and padding mask rows.
inline KVCacheView batch_slice(const KVCacheView& kv, std::int64_t first, std::int64_t count) {
  KVCacheView s = kv;
  s.keys = batch_slice(kv.keys, first, count);
  s.values = batch_slice(kv.values, first, count);
  s.lengths = kv.lengths + first;
  s.valid_mask = kv.valid_mask != nullptr ? kv.valid_mask + first * kv.capacity() : nullptr;
  return s;
}

}  // namespace kvsift::cuda::detail
