// The demo plays the engine: it owns each layer's KV buffers and hands policies views of them.
// Alongside the rows it keeps the generation position of every slot, compacted with the same plan,
// so that "which tokens are still resident" can be asked in generation space (recall, sentences).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "demo_generator.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"

namespace kvsift::demo {

// Rounds through the storage dtype, so the FullKV reference sees exactly what a cache stores.
inline void round_to_dtype(std::vector<float>& xs, DType dtype) {
  KVSIFT_DISPATCH_DTYPE(dtype, T, [&] {
    for (float& x : xs) x = to_float(from_float<T>(x));
  });
}

class DemoLayerCache {
 public:
  // `capacity` is where the buffers start; append() doubles it when a sequence fills it, so the
  // demo need not know when a policy triggers (FullKV never does).
  DemoLayerCache(int batch, int kv_heads, std::int64_t capacity, int head_dim, DType dtype)
      : batch_(batch), kv_heads_(kv_heads), capacity_(0), head_dim_(head_dim), dtype_(dtype) {
    KVSIFT_CHECK(capacity >= 1, "DemoLayerCache: capacity must be >= 1, got ", capacity);
    lengths_.assign(batch, 0);
    reallocate(capacity);
  }
  // The view points into this object's buffers: copying would alias them.
  DemoLayerCache(const DemoLayerCache&) = delete;
  DemoLayerCache& operator=(const DemoLayerCache&) = delete;
  DemoLayerCache(DemoLayerCache&&) = default;  // vector moves keep their buffers, so the view holds
  DemoLayerCache& operator=(DemoLayerCache&&) = default;

  const KVCacheView& view() const { return view_; }
  std::int32_t length(int b) const { return lengths_[b]; }
  DType dtype() const { return dtype_; }
  // [length(b)] generation positions of the resident tokens of (b, h), ascending.
  const std::int32_t* positions(int b, int h) const { return positions_.data() + row(b, h, 0); }

  // Appends this layer's K/V of `step` to every sequence.
  void append(const DecodeStep& step, int layer) {
    for (int b = 0; b < batch_; ++b) {
      if (lengths_[b] == capacity_) reallocate(2 * capacity_);
      const std::int32_t slot = lengths_[b];
      for (int h = 0; h < kv_heads_; ++h) {
        write_row(keys_, row(b, h, slot), step.key(layer, b, h));
        write_row(values_, row(b, h, slot), step.value(layer, b, h));
        positions_[row(b, h, slot)] = static_cast<std::int32_t>(step.position);
      }
      lengths_[b] = slot + 1;
    }
  }

  // compact() the rows, then the positions with the same plan (same in-place order argument:
  // slots are sorted and unique, so slot[i] >= i).
  void apply(const KeepPlan& plan) {
    const std::vector<std::int32_t> before(lengths_);
    compact(view_, plan);
    for (int b = 0; b < batch_; ++b) {
      if (plan.kept_length(b) == before[b]) continue;
      for (int h = 0; h < kv_heads_; ++h) {
        const std::int32_t* keep = plan.row(b, h);
        std::int32_t* pos = positions_.data() + row(b, h, 0);
        for (std::int64_t i = 0; i < plan.kept_length(b); ++i) pos[i] = pos[keep[i]];
      }
    }
  }

  // Bytes of K and V held for the resident tokens (all sequences and heads of this layer).
  std::int64_t resident_bytes() const {
    std::int64_t tokens = 0;
    for (int b = 0; b < batch_; ++b) tokens += lengths_[b];
    return tokens * kv_heads_ * head_dim_ * 2 * static_cast<std::int64_t>(dtype_size(dtype_));
  }

 private:
  // Moves the resident rows into buffers of `capacity` slots and re-points the view.
  void reallocate(std::int64_t capacity) {
    const std::size_t rows = static_cast<std::size_t>(batch_) * kv_heads_ * capacity;
    const std::size_t row_bytes = static_cast<std::size_t>(head_dim_) * dtype_size(dtype_);
    std::vector<unsigned char> keys(rows * row_bytes), values(rows * row_bytes);
    std::vector<std::int32_t> positions(rows);
    for (int b = 0; b < batch_; ++b) {
      for (int h = 0; h < kv_heads_; ++h) {
        const std::size_t from = row(b, h, 0);
        const std::size_t to = (static_cast<std::size_t>(b) * kv_heads_ + h) * capacity;
        const std::size_t n = static_cast<std::size_t>(lengths_[b]);
        std::copy_n(keys_.begin() + from * row_bytes, n * row_bytes, keys.begin() + to * row_bytes);
        std::copy_n(values_.begin() + from * row_bytes, n * row_bytes,
                    values.begin() + to * row_bytes);
        std::copy_n(positions_.begin() + from, n, positions.begin() + to);
      }
    }
    keys_.swap(keys);
    values_.swap(values);
    positions_.swap(positions);
    capacity_ = capacity;
    view_ = make_kv_cache_view(keys_.data(), values_.data(), dtype_, Device::cpu, batch_, kv_heads_,
                               capacity_, head_dim_, lengths_.data());
  }

  std::size_t row(int b, int h, std::int64_t slot) const {
    return (static_cast<std::size_t>(b) * kv_heads_ + h) * capacity_ + slot;
  }
  void write_row(std::vector<unsigned char>& buf, std::size_t r, const float* src) {
    KVSIFT_DISPATCH_DTYPE(dtype_, T, [&] {
      T* dst = reinterpret_cast<T*>(buf.data()) + r * head_dim_;
      for (int d = 0; d < head_dim_; ++d) dst[d] = from_float<T>(src[d]);
    });
  }

  int batch_, kv_heads_;
  std::int64_t capacity_;
  int head_dim_;
  DType dtype_;
  std::vector<unsigned char> keys_;      // [batch, kv_heads, capacity, head_dim] of dtype
  std::vector<unsigned char> values_;    // [batch, kv_heads, capacity, head_dim] of dtype
  std::vector<std::int32_t> positions_;  // [batch, kv_heads, capacity] generation position per slot
  std::vector<std::int32_t> lengths_;    // [batch]
  KVCacheView view_;
};

// The last `window` decode queries of one layer, for StepInputs.window_queries.
class QueryWindow {
 public:
  QueryWindow(int batch, int q_heads, int window, int head_dim, DType dtype)
      : batch_(batch), q_heads_(q_heads), window_(window), head_dim_(head_dim), dtype_(dtype) {
    ring_.assign(static_cast<std::size_t>(window) * batch * q_heads * head_dim, 0.0f);
    packed_.resize(ring_.size() * dtype_size(dtype));
  }
  QueryWindow(const QueryWindow&) = delete;  // view() points into packed_
  QueryWindow& operator=(const QueryWindow&) = delete;
  QueryWindow(QueryWindow&&) = default;
  QueryWindow& operator=(QueryWindow&&) = default;

  void push(const DecodeStep& step, int layer) {
    const std::size_t n = static_cast<std::size_t>(batch_) * q_heads_ * head_dim_;
    std::copy(step.query(layer, 0, 0), step.query(layer, 0, 0) + n,
              ring_.begin() + static_cast<std::ptrdiff_t>((pushed_ % window_) * n));
    ++pushed_;
  }

  // [batch, q_heads, min(window, pushed), head_dim] oldest first, in the cache's dtype.
  TensorView view() {
    const std::int64_t w = std::min<std::int64_t>(window_, pushed_);
    const std::size_t per_step = static_cast<std::size_t>(batch_) * q_heads_ * head_dim_;
    KVSIFT_DISPATCH_DTYPE(dtype_, T, [&] {
      T* out = reinterpret_cast<T*>(packed_.data());
      for (std::int64_t i = 0; i < w; ++i) {
        const std::int64_t step = pushed_ - w + i;
        const float* src = ring_.data() + (step % window_) * per_step;  // [batch, q_heads, D]
        for (int b = 0; b < batch_; ++b) {
          for (int q = 0; q < q_heads_; ++q) {
            const float* s = src + (static_cast<std::size_t>(b) * q_heads_ + q) * head_dim_;
            T* d = out + ((static_cast<std::size_t>(b) * q_heads_ + q) * w + i) * head_dim_;
            for (int k = 0; k < head_dim_; ++k) d[k] = from_float<T>(s[k]);
          }
        }
      }
    });
    return TensorView::contiguous(packed_.data(), dtype_, Device::cpu,
                                  {batch_, q_heads_, w, head_dim_});
  }

 private:
  int batch_, q_heads_, window_, head_dim_;
  DType dtype_;
  std::int64_t pushed_ = 0;
  std::vector<float> ring_;            // [window, batch, q_heads, head_dim] ring of recent steps
  std::vector<unsigned char> packed_;  // [batch, q_heads, window, head_dim] of dtype
};

}  // namespace kvsift::demo
