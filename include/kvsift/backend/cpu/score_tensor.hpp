// ScoreTensor: per-token fp32 scores of one layer, [batch, kv_heads, capacity], as the CPU
// scorers return them. Sequence b has `count(b)` meaningful leading entries per head (S_b - W for
// window-sliced scores, S_b for the full-length redundancy, 0 for a sequence not scored); the
// rest are 0 and never read by selection.
#pragma once

#include <cstdint>
#include <vector>

#include "kvsift/core/checked_math.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::cpu {

class ScoreTensor {
 public:
  ScoreTensor() = default;
  ScoreTensor(std::int64_t batch, std::int64_t kv_heads, std::int64_t capacity)
      : batch_(batch),
        kv_heads_(kv_heads),
        capacity_(capacity),
        // The whole shape is checked before either allocation: a negative or overflowing shape is
        // an error, not a wrapped size_t that allocates the wrong amount.
        counts_((elements(batch, kv_heads, capacity), static_cast<std::size_t>(batch)), 0),
        data_(elements(batch, kv_heads, capacity), 0.0f) {}

  static std::size_t elements(std::int64_t batch, std::int64_t kv_heads, std::int64_t capacity) {
    checked_size(batch, "ScoreTensor: batch");
    checked_size(kv_heads, "ScoreTensor: kv_heads");
    checked_size(capacity, "ScoreTensor: capacity");
    return checked_size(checked_mul(checked_mul(batch, kv_heads, "ScoreTensor: batch * kv_heads"),
                                    capacity, "ScoreTensor: batch * kv_heads * capacity"),
                        "ScoreTensor: elements");
  }

  std::int64_t batch() const { return batch_; }
  std::int64_t kv_heads() const { return kv_heads_; }
  std::int64_t capacity() const { return capacity_; }

  // Meaningful entries of every head of sequence b.
  std::int32_t count(std::int64_t b) const { return counts_[static_cast<std::size_t>(b)]; }
  void set_count(std::int64_t b, std::int32_t n) {
    KVSIFT_CHECK(n >= 0 && n <= capacity_, "ScoreTensor: count ", n, " for sequence ", b,
                 " outside [0, capacity = ", capacity_, "]");
    counts_[static_cast<std::size_t>(b)] = n;
  }

  float* row(std::int64_t b, std::int64_t h) {
    return data_.data() + (b * kv_heads_ + h) * capacity_;
  }
  const float* row(std::int64_t b, std::int64_t h) const {
    return data_.data() + (b * kv_heads_ + h) * capacity_;
  }
  float at(std::int64_t b, std::int64_t h, std::int64_t j) const { return row(b, h)[j]; }

  const std::vector<float>& data() const { return data_; }  // [batch, kv_heads, capacity]

 private:
  std::int64_t batch_ = 0;
  std::int64_t kv_heads_ = 0;
  std::int64_t capacity_ = 0;
  std::vector<std::int32_t> counts_;  // [batch]
  std::vector<float> data_;           // [batch, kv_heads, capacity]
};

}  // namespace kvsift::cpu
