// KeepPlan: what survives one compression step of one layer — for every (sequence, KV head) the
// sorted cache slots to keep. Deciding (policies) is separate from moving memory (compact()).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvsift/core/checked_math.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache_view.hpp"

namespace kvsift {

class KeepPlan {
 public:
  KeepPlan() = default;

  // A plan for a cache of `batch` x `kv_heads` rows whose sequences hold `source_lengths` tokens.
  // Every row of sequence b will keep exactly kept_lengths[b] slots, the last `window` of them the
  // sequence's most recent tokens. Rows are then appended in (b, h) row-major order.
  KeepPlan(std::int64_t batch, std::int64_t kv_heads, std::int64_t capacity,
           std::vector<std::int32_t> source_lengths, std::vector<std::int32_t> kept_lengths,
           std::int32_t window)
      : batch_(batch),
        kv_heads_(kv_heads),
        capacity_(capacity),
        window_(window),
        source_lengths_(std::move(source_lengths)),
        kept_lengths_(std::move(kept_lengths)) {
    KVSIFT_CHECK(batch >= 0 && kv_heads > 0 && capacity >= 0, "KeepPlan: bad shape batch=", batch,
                 " kv_heads=", kv_heads, " capacity=", capacity);
    KVSIFT_CHECK(static_cast<std::int64_t>(source_lengths_.size()) == batch,
                 "KeepPlan: source_lengths has ", source_lengths_.size(), " entries, batch is ",
                 batch);
    KVSIFT_CHECK(static_cast<std::int64_t>(kept_lengths_.size()) == batch,
                 "KeepPlan: kept_lengths has ", kept_lengths_.size(), " entries, batch is ", batch);
    KVSIFT_CHECK(window >= 0, "KeepPlan: window must be >= 0, got ", window);
    for (std::int64_t b = 0; b < batch; ++b) {
      KVSIFT_CHECK(source_lengths_[b] >= 0 && source_lengths_[b] <= capacity,
                   "KeepPlan: source_lengths[", b, "] = ", source_lengths_[b],
                   " outside [0, capacity = ", capacity, "]");
      KVSIFT_CHECK(kept_lengths_[b] >= 0 && kept_lengths_[b] <= source_lengths_[b],
                   "KeepPlan: kept_lengths[", b, "] = ", kept_lengths_[b], " outside [0, ",
                   source_lengths_[b], "]");
    }
    // Rows are bounded by batch (the length vectors exist) times kv_heads (not yet): reserve only
    // what a sane plan needs, so an absurd kv_heads fails in append_row instead of allocating.
    const std::int64_t rows = checked_mul(batch, kv_heads, "KeepPlan: batch * kv_heads");
    KVSIFT_CHECK(rows < std::numeric_limits<std::int64_t>::max(), "KeepPlan: batch * kv_heads (",
                 rows, ") too large");
    if (rows <= kReserveRowsLimit) {
      indptr_.reserve(static_cast<std::size_t>(rows + 1));
      // The rows' slots, so append_row never reallocates (a batch-64 plan is 2 MiB).
      if (const std::int64_t n = total_slots(); n <= kReserveSlotsLimit)
        slots_.reserve(static_cast<std::size_t>(n));
    }
    indptr_.push_back(0);
  }

  // The plan that keeps everything (FullKV, or a sequence below budget).
  static KeepPlan keep_all(const KVCacheView& kv) {
    std::vector<std::int32_t> lens(kv.lengths, kv.lengths + kv.batch());
    KeepPlan plan(kv.batch(), kv.kv_heads(), kv.capacity(), lens, lens, 0);
    std::vector<std::int32_t> row;
    for (std::int64_t b = 0; b < kv.batch(); ++b) {
      row.resize(lens[b]);
      for (std::int32_t i = 0; i < lens[b]; ++i) row[i] = i;
      for (std::int64_t h = 0; h < kv.kv_heads(); ++h) plan.append_row(row.data(), lens[b]);
    }
    return plan;
  }

  // Appends the kept slots of the next (b, h) row; `slots` must be sorted ascending.
  void append_row(const std::int32_t* slots, std::int64_t n) {
    KVSIFT_CHECK(!indptr_.empty(),
                 "KeepPlan::append_row: the plan is default-constructed (no shape); construct it "
                 "with KeepPlan(batch, kv_heads, capacity, source_lengths, kept_lengths, window)");
    const std::int64_t r = rows_appended();
    KVSIFT_CHECK(r < batch_ * kv_heads_, "KeepPlan::append_row: all ", batch_ * kv_heads_,
                 " rows are already set");
    const std::int64_t b = r / kv_heads_;
    KVSIFT_CHECK(n == kept_lengths_[b], "KeepPlan::append_row: row (b=", b, ", h=", r % kv_heads_,
                 ") has ", n, " slots, expected kept_lengths[", b, "] = ", kept_lengths_[b]);
    slots_.insert(slots_.end(), slots, slots + n);
    indptr_.push_back(static_cast<std::int64_t>(slots_.size()));
  }
  void append_row(const std::vector<std::int32_t>& slots) {
    append_row(slots.data(), static_cast<std::int64_t>(slots.size()));
  }
  // Every row at once: `slots` holds the rows in (b, h) order, row (b, h) kept_lengths[b] long,
  // as append_row() for each row would store them; the vector is taken, not copied.
  void set_rows(std::vector<std::int32_t> slots) {
    KVSIFT_CHECK(!indptr_.empty() && rows_appended() == 0,
                 "KeepPlan::set_rows: needs a shaped plan with no row set yet (", rows_appended(),
                 " rows are set)");
    KVSIFT_CHECK(static_cast<std::int64_t>(slots.size()) == total_slots(),
                 "KeepPlan::set_rows: ", slots.size(), " slots, the kept lengths need ",
                 total_slots());
    indptr_.resize(static_cast<std::size_t>(batch_ * kv_heads_ + 1));
    for (std::int64_t r = 0; r < batch_ * kv_heads_; ++r)
      indptr_[r + 1] = indptr_[r] + kept_lengths_[r / kv_heads_];
    slots_ = std::move(slots);
  }

  std::int64_t batch() const { return batch_; }
  std::int64_t kv_heads() const { return kv_heads_; }
  std::int64_t capacity() const { return capacity_; }
  std::int32_t window() const { return window_; }
  std::int32_t source_length(std::int64_t b) const { return source_lengths_[b]; }
  std::int32_t kept_length(std::int64_t b) const { return kept_lengths_[b]; }
  const std::vector<std::int32_t>& source_lengths() const { return source_lengths_; }
  const std::vector<std::int32_t>& kept_lengths() const { return kept_lengths_; }
  const std::vector<std::int64_t>& indptr() const { return indptr_; }  // [batch * kv_heads + 1]
  const std::vector<std::int32_t>& slots() const { return slots_; }    // [indptr.back()]
  // 0 for a default-constructed plan (no indptr yet), so messages never say "-1 rows".
  std::int64_t rows_appended() const {
    return indptr_.empty() ? 0 : static_cast<std::int64_t>(indptr_.size()) - 1;
  }
  bool complete() const { return rows_appended() == batch_ * kv_heads_; }

  const std::int32_t* row(std::int64_t b, std::int64_t h) const {
    return slots_.data() + indptr_[b * kv_heads_ + h];
  }
  std::int64_t row_size(std::int64_t b, std::int64_t h) const {
    const std::int64_t r = b * kv_heads_ + h;
    return indptr_[r + 1] - indptr_[r];
  }
  // True when nothing moves: every sequence keeps all its tokens.
  bool keeps_everything() const { return source_lengths_ == kept_lengths_; }

  // Checks the plan on its own: complete, each row sorted, unique, in range, the right count, and
  // the last `window` tokens of every sequence kept. Throws kvsift::Error naming the first fault.
  // A complete plan cannot change, so one that passed as a non-const object is remembered as
  // valid and not checked again (the device path checks it when it is made and compact(), which
  // takes it const, then costs nothing). Only the non-const call writes the mark; a moved-from
  // plan keeps the mark but is no longer complete, so it is checked (and refused) again.
  void validate() const {
    if (!(validated_ && complete())) check();
  }
  void validate() {
    if (validated_ && complete()) return;
    check();
    validated_ = true;
  }

  // Checks that this plan was made for `kv` as it is now: same shape and the same lengths.
  // A plan from another cache, or one left over from an earlier step, fails here.
  void check_matches(const KVCacheView& kv) const {
    KVSIFT_CHECK(kv.batch() == batch_ && kv.kv_heads() == kv_heads_ && kv.capacity() == capacity_,
                 "KeepPlan: made for [batch=", batch_, ", kv_heads=", kv_heads_,
                 ", capacity=", capacity_, "], applied to ", kv.keys.shape_string());
    for (std::int64_t b = 0; b < batch_; ++b) {
      KVSIFT_CHECK(kv.lengths[b] == source_lengths_[b], "KeepPlan: made for lengths[", b,
                   "] = ", source_lengths_[b], " but the cache now holds ", kv.lengths[b],
                   " (a plan from another cache or step)");
    }
  }

 private:
  // What validate() checks.
  void check() const {
    KVSIFT_CHECK(!indptr_.empty(),
                 "KeepPlan: the plan is empty (default-constructed); build it with "
                 "KeepPlan(batch, kv_heads, capacity, source_lengths, kept_lengths, window) and "
                 "append_row() for every (sequence, head)");
    KVSIFT_CHECK(complete(), "KeepPlan: only ", rows_appended(), " of ", batch_ * kv_heads_,
                 " rows were set");
    for (std::int64_t b = 0; b < batch_; ++b) {
      const std::int32_t len = source_lengths_[b];
      const std::int32_t w = std::min(window_, kept_lengths_[b]);
      for (std::int64_t h = 0; h < kv_heads_; ++h) {
        const std::int32_t* s = row(b, h);
        const std::int64_t n = row_size(b, h);
        KVSIFT_CHECK(n == kept_lengths_[b], "KeepPlan: row (b=", b, ", h=", h, ") keeps ", n,
                     " slots, expected ", kept_lengths_[b]);
        // One branch-free pass (ascending and in range) first; the slow loop only finds the fault.
        bool bad = n > 0 && (s[0] < 0 || s[n - 1] >= len);
        for (std::int64_t i = 1; i < n; ++i) bad |= s[i] <= s[i - 1];
        for (std::int64_t i = 0; bad && i < n; ++i) {
          KVSIFT_CHECK(s[i] >= 0 && s[i] < len, "KeepPlan: row (b=", b, ", h=", h, ") slot[", i,
                       "] = ", s[i], " outside [0, length = ", len, ")");
          KVSIFT_CHECK(i == 0 || s[i] > s[i - 1], "KeepPlan: row (b=", b, ", h=", h,
                       ") is not sorted and unique at ", i, " (", s[i - 1], ", ", s[i], ")");
        }
        for (std::int32_t k = 0; k < w; ++k) {
          KVSIFT_CHECK(s[n - w + k] == len - w + k, "KeepPlan: row (b=", b, ", h=", h,
                       ") drops window token ", len - w + k, " (window ", window_, ")");
        }
      }
    }
  }

  // Slots of all rows: kept_lengths[b] for each of sequence b's kv_heads rows.
  std::int64_t total_slots() const {
    std::int64_t n = 0;
    for (const std::int32_t k : kept_lengths_) n += k;
    return checked_mul(n, kv_heads_, "KeepPlan: kept slots * kv_heads");
  }

  static constexpr std::int64_t kReserveRowsLimit = 1 << 20;
  static constexpr std::int64_t kReserveSlotsLimit = std::int64_t{1} << 28;
  std::int64_t batch_ = 0;
  std::int64_t kv_heads_ = 0;
  std::int64_t capacity_ = 0;
  std::int32_t window_ = 0;
  std::vector<std::int32_t> source_lengths_;  // [batch]
  std::vector<std::int32_t> kept_lengths_;    // [batch]
  std::vector<std::int64_t> indptr_;          // [batch * kv_heads + 1]
  std::vector<std::int32_t> slots_;           // [nnz], CSR rows in (b, h) order
  bool validated_ = false;                    // a non-const validate() passed
};

}  // namespace kvsift
