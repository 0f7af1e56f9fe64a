// PM-KVQ stream of one layer (docs/algorithms.md §5.2): sink tokens and a recent window at 16
// bits, the body at a width that halves 16 → 8 → 4 → 2 when the layer's byte budget is exceeded.
// Two orderings of the reference: PmkvqRealStream stores integer codes (window flushed to the
// body through repeated exact right shifts, ERS); PmkvqFakeStream keeps an fp32 cache whose
// values are replaced in place by their quantize-dequantize (the paper's accuracy runs).
// Both are fed one update at a time: the prefill, then one token per decode step.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvsift/config/pmkvq_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/quant/pmkvq_codec.hpp"

namespace kvsift {

// What one update did; `mem_bytes` is the count compared with the budget BEFORE any halving or
// eviction of this update (the reference's `real.mem_bytes` / `fake.mem_bytes`).
struct PmkvqUpdateResult {
  std::int64_t mem_bytes = 0;
  bool over_budget = false;  // mem_bytes > budget: the reference halves (or raises) here
  int n_bits = 16;           // body width after the update
  int halvings = 0;          // 0 or 1 with reference_exact, any number otherwise
  std::int64_t evicted = 0;  // body tokens evicted (library mode, below 2 bits only)
  bool fits = true;          // memory after the update is within the budget
  // Over budget where the reference raises (an empty body, or already at 2 bits): reported in
  // library mode too, which degrades (evicts) instead.
  bool reference_would_raise = false;
};

// The reference's MemoryError (reference_exact only): the layer is over its budget and cannot
// halve further. The stream is left at its last successful update.
class PmkvqBudgetError : public Error {
 public:
  using Error::Error;
};

namespace pmkvq_detail {

// Token counts after appending u tokens and flushing the window (the same for both orderings).
struct Counts {
  std::int64_t sink = 0, window = 0, body = 0, flushed = 0;
};
inline Counts next_counts(const Counts& c0, std::int64_t u, std::int64_t n_sink,
                          std::int64_t n_window) {
  Counts c = c0;
  const std::int64_t to_sink = std::min(u, std::max<std::int64_t>(0, n_sink - c.sink));
  c.sink += to_sink;
  const std::int64_t w = c.window + (u - to_sink);
  c.flushed = (w / n_window) * n_window;
  c.body += c.flushed;
  c.window = w - c.flushed;
  return c;
}

}  // namespace pmkvq_detail

class PmkvqStreamBase {
 public:
  PmkvqStreamBase(PmkvqConfig cfg, std::int64_t layer) : cfg_(std::move(cfg)) {
    cfg_.validate();
    budget_ = cfg_.budget_bytes(layer);
    layer_ = layer;
    n_bits_ = cfg_.n_init_bits;
  }
  const PmkvqConfig& config() const { return cfg_; }
  int n_bits() const { return n_bits_; }
  std::int64_t n_sink() const { return counts_.sink; }
  std::int64_t n_window() const { return counts_.window; }
  std::int64_t n_body() const { return counts_.body; }
  std::int64_t tokens() const { return counts_.sink + counts_.window + counts_.body; }
  double budget_bytes() const { return budget_; }

  // Bytes of the layer with these counts at body width n: packed int16 words of codes of sinks,
  // window (16 bit) and body (n bit), keys and values; in library mode also one scale and one
  // zero point per group (bf16 for the real ordering, fp32 for the fake one).
  std::int64_t memory_bytes(const pmkvq_detail::Counts& c, int n) const {
    return bytes_of(c, n, !cfg_.reference_exact);
  }
  std::int64_t memory_bytes() const { return memory_bytes(counts_, n_bits_); }
  // What the layer's storage holds in either mode: codes plus every scale and zero point (the
  // reference_exact budget rule leaves the parameters out; the storage still has them).
  std::int64_t storage_bytes() const { return bytes_of(counts_, n_bits_, true); }

 protected:
  std::int64_t bytes_of(const pmkvq_detail::Counts& c, int n, bool with_params) const {
    const std::int64_t groups = cfg_.head_dim / cfg_.group_size;
    const std::int64_t w16 = groups * pmkvq::packed_words(cfg_.group_size, 16);
    const std::int64_t wn = groups * pmkvq::packed_words(cfg_.group_size, n);
    std::int64_t words = (c.sink + c.window) * w16 + c.body * wn;
    std::int64_t bytes = 2 * 2 * cfg_.kv_heads * words;  // 2 bytes a word; keys and values
    if (with_params) {
      const std::int64_t param = cfg_.backend == PmkvqBackend::real ? 2 : 4;
      bytes += 2 * cfg_.kv_heads * (c.sink + c.window + c.body) * groups * 2 * param;
    }
    return bytes;
  }

  // What every update does first: checks u and src_seq, the counts after appending u tokens, the
  // memory they would take at the current width and whether the reference would raise there
  // (raising now in reference_exact mode, before anything changes).
  pmkvq_detail::Counts begin_update(std::int64_t u, std::int64_t src_seq, const char* who,
                                    PmkvqUpdateResult& r) const {
    KVSIFT_CHECK(u > 0, who, ".update: u must be > 0, got ", u);
    KVSIFT_CHECK(src_seq >= u, who, ".update: src_seq (", src_seq, ") must be >= u (", u, ")");
    const pmkvq_detail::Counts next =
        pmkvq_detail::next_counts(counts_, u, cfg_.n_sink, cfg_.n_window);
    r.mem_bytes = memory_bytes(next, n_bits_);
    r.over_budget = static_cast<double>(r.mem_bytes) > budget_;
    r.reference_would_raise = r.over_budget && (next.body == 0 || n_bits_ <= 2);
    check_reference_error(next, r.mem_bytes);
    return next;
  }
  // The reference's error (MemoryError) before any state changes, so the stream stays at its
  // last successful update: over budget with an empty body, or no width left to halve to.
  void check_reference_error(const pmkvq_detail::Counts& c, std::int64_t mem) const {
    if (!cfg_.reference_exact || static_cast<double>(mem) <= budget_) return;
    if (c.body == 0)
      throw PmkvqBudgetError(detail::concat("PM-KVQ layer ", layer_, ": ", mem,
                                            " bytes exceed the budget of ", budget_,
                                            " bytes with an empty body (nothing to requantize)"));
    if (n_bits_ <= 2)
      throw PmkvqBudgetError(detail::concat("PM-KVQ layer ", layer_, ": ", mem,
                                            " bytes exceed the budget of ", budget_, " bytes at ",
                                            n_bits_, " bits (no narrower width than 2 bits)"));
  }

  PmkvqConfig cfg_;
  double budget_ = 0;
  std::int64_t layer_ = 0;
  int n_bits_ = 16;
  pmkvq_detail::Counts counts_;
};

// Integer-code storage: per segment token-major codes [token][head][dim] and parameters
// [token][head][group]. Codes are held unpacked (one uint16 each); the byte count is that of
// the packed int16 words (pmkvq::pack_msb_first gives the words).
class PmkvqRealStream : public PmkvqStreamBase {
 public:
  struct Segment {
    std::vector<std::uint16_t> codes;  // [tokens, kv_heads, head_dim]
    std::vector<float> scales, zeros;  // [tokens, kv_heads, groups], bf16 values
    std::int64_t tokens = 0;
  };

  PmkvqRealStream(PmkvqConfig cfg, std::int64_t layer) : PmkvqStreamBase(std::move(cfg), layer) {
    KVSIFT_CHECK(cfg_.backend == PmkvqBackend::real,
                 "PmkvqRealStream needs PmkvqConfig.backend = real");
  }

  // Appends u tokens (bf16 values held in fp32).
  // keys, values: element (h, t, d) at [h·src_seq·head_dim + t·head_dim + d] — a [kv_heads,
  // src_seq, head_dim] tensor whose first u positions are this update's tokens.
  PmkvqUpdateResult update(const float* keys, const float* values, std::int64_t u,
                           std::int64_t src_seq) {
    PmkvqUpdateResult r;
    const pmkvq_detail::Counts next = begin_update(u, src_seq, "PmkvqRealStream", r);

    for (std::int64_t t = 0; t < u; ++t) {
      const bool to_sink = counts_.sink + t < cfg_.n_sink;
      append_token(to_sink ? sink_[0] : window_[0], keys, t, src_seq);
      append_token(to_sink ? sink_[1] : window_[1], values, t, src_seq);
    }
    if (next.flushed > 0)
      for (int kv = 0; kv < 2; ++kv) flush(window_[kv], body_[kv], next.flushed);
    counts_ = next;
    counts_.flushed = 0;

    if (r.over_budget) shrink_to_budget(r);
    r.n_bits = n_bits_;
    r.fits = static_cast<double>(memory_bytes()) <= budget_;
    return r;
  }

  const Segment& sink(int kv) const { return sink_[kv]; }  // kv: 0 keys, 1 values
  const Segment& body(int kv) const { return body_[kv]; }
  const Segment& window(int kv) const { return window_[kv]; }

 private:
  std::int64_t groups() const { return cfg_.head_dim / cfg_.group_size; }

  void append_token(Segment& s, const float* x, std::int64_t t, std::int64_t src_seq) {
    const std::int64_t H = cfg_.kv_heads, D = cfg_.head_dim, G = cfg_.group_size;
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t g = 0; g < groups(); ++g) {
        const float* grp = x + (h * src_seq + t) * D + g * G;
        const std::size_t at = s.codes.size();
        s.codes.resize(at + static_cast<std::size_t>(G));
        const GroupParams p = pmkvq::quantize_group(grp, G, 16, pmkvq::Arith::bf16, &s.codes[at]);
        s.scales.push_back(p.scale);
        s.zeros.push_back(p.zero);
      }
    ++s.tokens;
  }

  // Moves the first n tokens of the window to the body, shrinking 16 → n_bits by repeated ERS.
  void flush(Segment& win, Segment& body, std::int64_t n) {
    const std::int64_t per_tok_codes = cfg_.kv_heads * cfg_.head_dim;
    const std::int64_t per_tok_params = cfg_.kv_heads * groups();
    for (std::int64_t i = 0; i < n * per_tok_codes; ++i) {
      std::uint16_t q = win.codes[static_cast<std::size_t>(i)];
      for (int w = 8; w >= n_bits_; w /= 2) q = pmkvq::ers_code(q, w);
      body.codes.push_back(q);
    }
    for (std::int64_t i = 0; i < n * per_tok_params; ++i) {
      float s = win.scales[static_cast<std::size_t>(i)];
      for (int w = 8; w >= n_bits_; w /= 2) s = pmkvq::ers_scale(s, w);
      body.scales.push_back(s);
      body.zeros.push_back(win.zeros[static_cast<std::size_t>(i)]);
    }
    win.codes.erase(win.codes.begin(), win.codes.begin() + n * per_tok_codes);
    win.scales.erase(win.scales.begin(), win.scales.begin() + n * per_tok_params);
    win.zeros.erase(win.zeros.begin(), win.zeros.begin() + n * per_tok_params);
    win.tokens -= n;
    body.tokens += n;
  }

  // One ERS step of every body code and scale: n → n/2.
  void halve_body() {
    const int to = n_bits_ / 2;
    for (int kv = 0; kv < 2; ++kv) {
      for (auto& q : body_[kv].codes) q = pmkvq::ers_code(q, to);
      for (auto& s : body_[kv].scales) s = pmkvq::ers_scale(s, to);
    }
    n_bits_ = to;
  }

  void evict_oldest_body_token() {
    const std::int64_t pc = cfg_.kv_heads * cfg_.head_dim, pp = cfg_.kv_heads * groups();
    for (int kv = 0; kv < 2; ++kv) {
      Segment& b = body_[kv];
      b.codes.erase(b.codes.begin(), b.codes.begin() + pc);
      b.scales.erase(b.scales.begin(), b.scales.begin() + pp);
      b.zeros.erase(b.zeros.begin(), b.zeros.begin() + pp);
      --b.tokens;
    }
    --counts_.body;
  }

  void shrink_to_budget(PmkvqUpdateResult& r) {
    if (cfg_.reference_exact) {  // check_reference_error already ruled out the error cases
      halve_body();
      r.halvings = 1;
      return;
    }
    while (static_cast<double>(memory_bytes()) > budget_ && counts_.body > 0 && n_bits_ > 2) {
      halve_body();
      ++r.halvings;
    }
    while (static_cast<double>(memory_bytes()) > budget_ && counts_.body > 0) {
      evict_oldest_body_token();
      ++r.evicted;
    }
  }

  Segment sink_[2], body_[2], window_[2];
};

// The fake ordering: an fp32 cache [token][head][dim] in stream order (sinks, body, window),
// values replaced in place by their quantize-dequantize; `nbits_pos` the width each position was
// last quantized at.
class PmkvqFakeStream : public PmkvqStreamBase {
 public:
  PmkvqFakeStream(PmkvqConfig cfg, std::int64_t layer) : PmkvqStreamBase(std::move(cfg), layer) {
    KVSIFT_CHECK(cfg_.backend == PmkvqBackend::fake,
                 "PmkvqFakeStream needs PmkvqConfig.backend = fake");
  }

  // Appends u fp32 tokens; layout as PmkvqRealStream::update.
  PmkvqUpdateResult update(const float* keys, const float* values, std::int64_t u,
                           std::int64_t src_seq) {
    PmkvqUpdateResult r;
    const pmkvq_detail::Counts next = begin_update(u, src_seq, "PmkvqFakeStream", r);

    const std::int64_t H = cfg_.kv_heads, D = cfg_.head_dim;
    const std::int64_t first_new = tokens();
    // The flush moves the oldest window positions [flush_begin, flush_end) to the body.
    const std::int64_t flush_begin = counts_.sink + counts_.body;
    const std::int64_t flush_end = flush_begin + next.flushed;
    for (std::int64_t t = 0; t < u; ++t) {
      for (int kv = 0; kv < 2; ++kv) {
        const float* x = kv == 0 ? keys : values;
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t d = 0; d < D; ++d) cache_[kv].push_back(x[(h * src_seq + t) * D + d]);
      }
      nbits_pos_.push_back(16);
      // Sinks and arriving window tokens: bf16(Q16(x)); a token flushed in the update it arrives
      // in is quantized once, directly at the body width from its own values (the reference
      // quantizes the flushed block from the values attention saw).
      const std::int64_t p = first_new + t;
      if (p < flush_begin || p >= flush_end) quantize_position(p, 16);
    }
    // Flush: the oldest window tokens become body tokens at the current width, from current values.
    for (std::int64_t p = flush_begin; p < flush_end; ++p) quantize_position(p, n_bits_);
    // A multi-token update that flushed re-quantizes the older tokens left in its window at 16
    // bits (docs/algorithms.md §5.2; golden/README "Fake backend").
    if (next.flushed > 0 && u > 1)
      for (std::int64_t p = flush_end; p < first_new; ++p) quantize_position(p, 16);
    counts_ = next;
    counts_.flushed = 0;

    if (r.over_budget) shrink_to_budget(r);
    r.n_bits = n_bits_;
    r.fits = static_cast<double>(memory_bytes()) <= budget_;
    return r;
  }

  const std::vector<float>& keys() const { return cache_[0]; }      // [tokens, kv_heads, head_dim]
  const std::vector<float>& values() const { return cache_[1]; }    // [tokens, kv_heads, head_dim]
  const std::vector<int>& nbits_pos() const { return nbits_pos_; }  // [tokens]

 private:
  // Q_n of position p (every head and group, keys and values) from its current values; 16-bit
  // results are rounded to bf16 (docs/algorithms.md §5.2).
  void quantize_position(std::int64_t p, int n) {
    const std::int64_t H = cfg_.kv_heads, D = cfg_.head_dim, G = cfg_.group_size;
    std::vector<std::uint16_t> codes(static_cast<std::size_t>(G));
    for (int kv = 0; kv < 2; ++kv)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t g = 0; g < D / G; ++g) {
          float* grp = cache_[kv].data() + (p * H + h) * D + g * G;
          const GroupParams gp = pmkvq::quantize_group(grp, G, n, pmkvq::Arith::f32, codes.data());
          for (std::int64_t i = 0; i < G; ++i) {
            const float y = pmkvq::dequantize_f32(codes[static_cast<std::size_t>(i)], gp);
            grp[i] = n == 16 ? pmkvq::round_bf16(y) : y;
          }
        }
    nbits_pos_[static_cast<std::size_t>(p)] = n;
  }

  // n → n/2 and the whole body re-quantized from current values with a fresh min/max (no ERS).
  void halve_body() {
    n_bits_ /= 2;
    for (std::int64_t p = counts_.sink; p < counts_.sink + counts_.body; ++p)
      quantize_position(p, n_bits_);
  }

  void evict_oldest_body_token() {
    const std::int64_t row = cfg_.kv_heads * cfg_.head_dim;
    const std::int64_t p = counts_.sink;
    for (int kv = 0; kv < 2; ++kv)
      cache_[kv].erase(cache_[kv].begin() + p * row, cache_[kv].begin() + (p + 1) * row);
    nbits_pos_.erase(nbits_pos_.begin() + p);
    --counts_.body;
  }

  void shrink_to_budget(PmkvqUpdateResult& r) {
    if (cfg_.reference_exact) {
      halve_body();
      r.halvings = 1;
      return;
    }
    while (static_cast<double>(memory_bytes()) > budget_ && counts_.body > 0 && n_bits_ > 2) {
      halve_body();
      ++r.halvings;
    }
    while (static_cast<double>(memory_bytes()) > budget_ && counts_.body > 0) {
      evict_oldest_body_token();
      ++r.evicted;
    }
  }

  std::vector<float> cache_[2];
  std::vector<int> nbits_pos_;
};

}  // namespace kvsift
