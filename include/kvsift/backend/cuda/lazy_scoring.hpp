// kvsift::cuda LazyEviction scoring (docs/algorithms.md §5.3) on device counters: the per-token
// last-hit step TS and maximum recurrence interval MRI updated from one decode step's attention,
// and the released code's eviction score. The same arithmetic as the CPU reference
// (policy/baselines/lazy_counters.hpp: append_tokens, record_hits, score), restated here because
// this backend layer never includes policy/; the caller (the policy) owns the step counter and
// the selection.
//
// Counters: TS and MRI are int32 [batch, kv_heads, capacity]; slot j of row (b, h) is the j-th
// cached token of that row (cache order). In LazyCounters::fp16 mode every counter value and
// every score operation is rounded to fp16 as on the host (the reference's fp16 counters).
//
// Exactness: TS and MRI are integers computed exactly as the host does (the same double → fp32 →
// fp16 roundings), so they are equal bit for bit. The score uses the host's double arithmetic;
// CUDA's double exp() is within 1 ulp of the correctly rounded result where glibc's may round the
// other way, so a score can differ from the CPU's by one fp32 (or fp16) ulp in rare cases.
//
// Every call validates on the host (kvsift::Error naming the argument; nothing enqueued) and only
// enqueues on `stream`: no allocation, no synchronisation, no workspace.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/config/lazy_config.hpp"

namespace kvsift::cuda {

struct LazyDeviceCounters {
  std::int32_t* ts = nullptr;   // device [batch, kv_heads, capacity]
  std::int32_t* mri = nullptr;  // device [batch, kv_heads, capacity]
  std::int64_t batch = 0, kv_heads = 0, capacity = 0;
};

// The step t as a counter value, lazy::counter_of_step's rule: t in [0, 65504] for fp16
// counters (rounded to fp16) and [0, INT32_MAX] for int32 ones, else kvsift::Error.
std::int32_t lazy_counter_of_step(LazyCounters counters, std::int64_t step);

// One observation of a layer (LazyEviction::observe): for every row (b, h), slots
// [prev_lengths[b], lengths[b]) are new tokens and start with TS = `start` (the counter of the
// step before this one: lazy_counter_of_step(c, t − 1), or of 0 before decoding) and MRI = 0;
// then, when `probs` is given (a decode step t), every slot j < lengths[b] with valid_mask[b, j]
// (or no mask) and max over the GQA group of probs[b, h·group + g, j] >= alpha is a hit:
// MRI ← max(MRI, round(now − TS)), TS ← now, with now = lazy_counter_of_step(c, t).
//   probs        device [batch, q_heads, capacity] fp32: the step's softmax weights of every
//                query head (pads already 0); q_heads a multiple of kv_heads (scope query_head:
//                q_heads == kv_heads). nullptr: a prompt chunk, no hits recorded.
//   lengths      device [batch] int32, 0 <= lengths[b] <= capacity
//   prev_lengths device [batch] int32, 0 <= prev_lengths[b] <= lengths[b] (the counters' sizes)
//   valid_mask   device [batch, capacity] uint8 (1 = real token) or nullptr (all valid)
// Returns nothing; `counters` rows are updated in place, slots >= lengths[b] untouched.
void lazy_observe(const LazyDeviceCounters& counters, const float* probs, std::int64_t q_heads,
                  const std::int32_t* lengths, const std::int32_t* prev_lengths,
                  const std::uint8_t* valid_mask, std::int32_t start, std::int64_t step,
                  float alpha, LazyCounters mode, cudaStream_t stream);

// The eviction score of every candidate slot at step t (lazy::score):
//   2/(1 + exp(1 + (t − TS)/(MRI + 1e-5))) + (MRI == 0 ? 0 : 2/(1 + exp(MRI − 1)))
// scores device [batch, kv_heads, capacity] fp32: slot j < lengths[b] − window of row (b, h)
// gets its score (pads included: the selection masks them, as cpu::top_k_slots does); slots
// from max(lengths[b] − window, 0) on are left untouched.
void lazy_scores(const LazyDeviceCounters& counters, const std::int32_t* lengths, int window,
                 std::int64_t step, LazyCounters mode, float* scores, cudaStream_t stream);

}  // namespace kvsift::cuda
