// Ragged batches on the GPU: sequences of different lengths S_b, some left-padded, some at or
// below the budget, scored and selected by kvsift::cuda (rkv_score/rkv_select/rkv_select_step,
// skipkv_score/skipkv_select, select_topk_slots) and compacted (compact, compact_device_rows),
// against the CPU reference of policy/baselines/rkv.hpp and policy/skipkv/sentence_scorer.hpp:
//   - scores of every sequence over its own S_b within |x − ref| <= 1e-6 + 1e-4·|ref|;
//   - each sequence's scores bit-identical to a batch-of-one call on that sequence alone (the
//     ragged layout must not change a single bit);
//   - kept sets: sequences at or below the budget keep 0 .. S_b − 1; the others exactly the CPU
//     selection rule on the GPU's own scores, and the CPU plan up to near-cut swaps;
//   - compaction on the device equal to kvsift::compact on the host, byte for byte;
//   - the DeviceBackend registered by linking kvsift::cuda, and its rkv_select / skipkv_select
//     equal to the direct calls and to the CPU plan.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "golden_case.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/cuda/sentence_scoring.hpp"
#include "kvsift/backend/device_backend.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/policy/skipkv/sentence_scorer.hpp"

using namespace kvsift;
using test::DeviceBuffer;
using test::within_score_tolerance;

namespace {

// One ragged batch: host cache [B, H, C, D] of storage type T with its device mirror, window
// queries [B, Hq, W, D], per-sequence lengths and left pads.
template <class T>
struct Ragged {
  std::int64_t B, H, Hq, C, D, W;
  std::vector<std::int32_t> lengths;  // [B] S_b
  std::vector<std::int32_t> pads;     // [B] left pads at the start of each sequence
  std::vector<T> keys, values, queries;
  std::vector<std::uint8_t> mask;  // [B, C], empty when no sequence has pads
  DeviceBuffer<T> d_keys, d_values, d_queries;
  DeviceBuffer<std::uint8_t> d_mask;
  std::vector<std::int32_t> host_len, dev_len;  // the views' lengths (compaction rewrites them)

  Ragged(std::int64_t h, std::int64_t g, std::int64_t c, std::int64_t d, std::int64_t w,
         std::vector<std::int32_t> lens, std::vector<std::int32_t> left_pads, std::uint32_t seed)
      : B(static_cast<std::int64_t>(lens.size())),
        H(h),
        Hq(h * g),
        C(c),
        D(d),
        W(w),
        lengths(std::move(lens)),
        pads(std::move(left_pads)),
        keys(make_keys(seed)),
        values(make_values(seed + 1)),
        queries(make_queries(seed + 2)),
        mask(make_mask()),
        d_keys(keys),
        d_values(values),
        d_queries(queries),
        d_mask(mask.empty() ? std::vector<std::uint8_t>(1) : mask),
        host_len(lengths),
        dev_len(lengths) {}

  // Normal keys, a quarter of the rows near-copies of an earlier row (so the last-match search
  // finds and spares near-duplicates), a shared direction per head raising every cosine a bit.
  std::vector<T> make_keys(std::uint32_t seed) const {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    std::vector<T> k(static_cast<std::size_t>(B * H * C * D));
    std::vector<float> row(static_cast<std::size_t>(D)), common(static_cast<std::size_t>(D));
    for (std::int64_t bh = 0; bh < B * H; ++bh) {
      for (float& x : common) x = nd(rng);
      for (std::int64_t i = 0; i < C; ++i) {
        T* out = &k[static_cast<std::size_t>((bh * C + i) * D)];
        if (i > 0 && ud(rng) < 0.25f) {
          const std::int64_t src = std::uniform_int_distribution<std::int64_t>(0, i - 1)(rng);
          const T* from = &k[static_cast<std::size_t>((bh * C + src) * D)];
          for (std::int64_t e = 0; e < D; ++e)
            out[e] = from_float<T>(to_float(from[e]) + 0.05f * nd(rng));
        } else {
          for (std::int64_t e = 0; e < D; ++e) out[e] = from_float<T>(nd(rng) + 0.3f * common[e]);
        }
      }
    }
    return k;
  }
  std::vector<T> make_values(std::uint32_t seed) const {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::vector<T> v(static_cast<std::size_t>(B * H * C * D));
    for (T& x : v) x = from_float<T>(nd(rng));
    return v;
  }
  std::vector<T> make_queries(std::uint32_t seed) const {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::vector<T> q(static_cast<std::size_t>(B * Hq * W * D));
    for (T& x : q) x = from_float<T>(nd(rng));
    return q;
  }
  std::vector<std::uint8_t> make_mask() const {
    if (std::all_of(pads.begin(), pads.end(), [](std::int32_t p) { return p == 0; })) return {};
    std::vector<std::uint8_t> m(static_cast<std::size_t>(B * C), 1);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int32_t i = 0; i < pads[b]; ++i) m[static_cast<std::size_t>(b * C + i)] = 0;
    return m;
  }

  std::uint8_t* host_mask() { return mask.empty() ? nullptr : mask.data(); }
  KVCacheView host_kv() {
    return make_kv_cache_view(keys.data(), values.data(), dtype_of<T>::value, Device::cpu, B, H, C,
                              D, host_len.data(), host_mask());
  }
  KVCacheView dev_kv() {
    return make_kv_cache_view(d_keys.get(), d_values.get(), dtype_of<T>::value, Device::cuda, B, H,
                              C, D, dev_len.data(), mask.empty() ? nullptr : d_mask.get());
  }
  // Sequence b alone, as a batch of one over the same device memory.
  KVCacheView dev_kv_one(std::int64_t b) {
    const std::int64_t off = b * H * C * D;
    return make_kv_cache_view(d_keys.get() + off, d_values.get() + off, dtype_of<T>::value,
                              Device::cuda, 1, H, C, D, &dev_len[b],
                              mask.empty() ? nullptr : d_mask.get() + b * C);
  }
  TensorView host_q() {
    return TensorView::contiguous(queries.data(), dtype_of<T>::value, Device::cpu, {B, Hq, W, D});
  }
  TensorView dev_q() {
    return TensorView::contiguous(d_queries.get(), dtype_of<T>::value, Device::cuda, {B, Hq, W, D});
  }
  TensorView dev_q_one(std::int64_t b) {
    return TensorView::contiguous(d_queries.get() + b * Hq * W * D, dtype_of<T>::value,
                                  Device::cuda, {1, Hq, W, D});
  }
  std::int64_t longest() const { return *std::max_element(lengths.begin(), lengths.end()); }
  std::int64_t pitch() const { return longest() - W; }  // n of the pitched score rows
  std::int64_t rows() const { return B * H; }
  bool any_over(int budget) const {
    return std::any_of(lengths.begin(), lengths.end(), [&](std::int32_t s) { return s > budget; });
  }
};

// GPU score rows [B*H, pitch] (row (b, h) uses its first n_b = S_b − W) as a CPU ScoreTensor.
cpu::ScoreTensor as_score_tensor(const std::vector<float>& s, std::int64_t pitch,
                                 const std::vector<std::int32_t>& lengths, std::int64_t H,
                                 std::int64_t C, std::int64_t W) {
  const std::int64_t B = static_cast<std::int64_t>(lengths.size());
  cpu::ScoreTensor t(B, H, C);
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t n = std::max<std::int64_t>(lengths[b] - W, 0);
    t.set_count(b, static_cast<std::int32_t>(n));
    for (std::int64_t h = 0; h < H; ++h)
      std::copy_n(s.begin() + (b * H + h) * pitch, n, t.row(b, h));
  }
  return t;
}

// Entries [b, h, 0 .. count(b)) of `ours` [B*H, pitch] outside tolerance of `ref`, for the
// sequences `use(b)` selects.
std::int64_t count_off(const std::vector<float>& ours, std::int64_t pitch,
                       const cpu::ScoreTensor& ref, const std::function<bool(std::int64_t)>& use,
                       const char* what) {
  std::int64_t bad = 0;
  for (std::int64_t b = 0; b < ref.batch(); ++b) {
    if (!use(b)) continue;
    for (std::int64_t h = 0; h < ref.kv_heads(); ++h)
      for (std::int64_t j = 0; j < ref.count(b); ++j) {
        const float x = ours[(b * ref.kv_heads() + h) * pitch + j], y = ref.at(b, h, j);
        if (!within_score_tolerance(x, y) && bad++ < 5)
          UNSCOPED_INFO(what << " [" << b << ", " << h << ", " << j << "]: " << x << " vs " << y);
      }
  }
  return bad;
}

// The GPU plan against the CPU plan: same source and kept lengths; a sequence at or below the
// budget keeps exactly 0 .. S_b − 1; elsewhere the kept sets differ only by slots whose CPU score
// lies within tolerance of the cut (the (budget − W)-th best candidate, pads left out when
// `exclude_pads`).
void check_against_cpu_plan(const KeepPlan& gpu, const KeepPlan& cpu_plan,
                            const cpu::ScoreTensor& cpu_score, const std::uint8_t* mask,
                            std::int64_t C, const std::vector<std::int32_t>& lengths, int budget,
                            int W, bool exclude_pads) {
  REQUIRE_NOTHROW(gpu.validate());
  REQUIRE(gpu.source_lengths() == lengths);
  REQUIRE(gpu.kept_lengths() == cpu_plan.kept_lengths());
  std::int64_t swaps = 0;
  for (std::int64_t b = 0; b < gpu.batch(); ++b)
    for (std::int64_t h = 0; h < gpu.kv_heads(); ++h) {
      INFO("sequence " << b << " (S_b = " << lengths[b] << "), head " << h);
      const std::vector<std::int32_t> ours(gpu.row(b, h), gpu.row(b, h) + gpu.row_size(b, h));
      const std::vector<std::int32_t> ref(cpu_plan.row(b, h),
                                          cpu_plan.row(b, h) + cpu_plan.row_size(b, h));
      if (lengths[b] <= budget) {
        std::vector<std::int32_t> all(static_cast<std::size_t>(lengths[b]));
        for (std::int32_t j = 0; j < lengths[b]; ++j) all[j] = j;
        CHECK(ours == all);
        continue;
      }
      const std::int64_t n = lengths[b] - W;
      std::vector<float> cand;
      for (std::int64_t j = 0; j < n; ++j)
        if (!exclude_pads || mask == nullptr || mask[b * C + j])
          cand.push_back(cpu_score.at(b, h, j));
      std::sort(cand.begin(), cand.end(), std::greater<float>());
      const std::size_t keep =
          std::min<std::size_t>(cand.size(), static_cast<std::size_t>(budget - W));
      const float cut = keep > 0 ? cand[keep - 1] : 0.0f;
      std::vector<std::int32_t> diff;
      std::set_symmetric_difference(ours.begin(), ours.end(), ref.begin(), ref.end(),
                                    std::back_inserter(diff));
      for (std::int32_t j : diff) {
        INFO("slot " << j << " kept by one side only");
        REQUIRE(j < n);
        INFO("score " << cpu_score.at(b, h, j) << ", cut " << cut);
        CHECK(within_score_tolerance(cpu_score.at(b, h, j), cut));
      }
      swaps += static_cast<std::int64_t>(diff.size());
    }
  UNSCOPED_INFO(swaps << " near-cut slots differ from the CPU plan");
}

// The first `count` bytes of row (b, h, i) of a [B, H, C, D] cache in two host copies agree for
// i < kept(b): the device compaction against kvsift::compact on the host.
template <class T>
void check_same_rows(const std::vector<T>& got, const std::vector<T>& want,
                     const std::vector<std::int32_t>& kept, std::int64_t H, std::int64_t C,
                     std::int64_t D, const char* what) {
  std::int64_t bad = 0;
  for (std::size_t b = 0; b < kept.size(); ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::size_t off = static_cast<std::size_t>(((std::int64_t(b) * H + h) * C) * D);
      bad += std::memcmp(got.data() + off, want.data() + off,
                         static_cast<std::size_t>(kept[b] * D) * sizeof(T)) != 0;
    }
  INFO(what);
  CHECK(bad == 0);
}

template <class T>
struct HostCompacted {
  std::vector<T> keys, values;
  std::vector<std::uint8_t> mask;
  std::vector<std::int32_t> lengths;
};

// kvsift::compact of `plan` on a host copy of the case's original cache.
template <class T>
HostCompacted<T> host_compact(const Ragged<T>& c, const KeepPlan& plan) {
  HostCompacted<T> h{c.keys, c.values, c.mask, c.lengths};
  KVCacheView kv =
      make_kv_cache_view(h.keys.data(), h.values.data(), dtype_of<T>::value, Device::cpu, c.B, c.H,
                         c.C, c.D, h.lengths.data(), h.mask.empty() ? nullptr : h.mask.data());
  compact(kv, plan);
  return h;
}

RKVConfig rkv_config(int budget, int W, bool tensor_core) {
  RKVConfig cfg;
  cfg.budget = budget;
  cfg.window = W;
  cfg.tensor_core_search = tensor_core;
  return cfg;
}

template <class T>
void check_rkv_ragged(Ragged<T>& c, const RKVConfig& cfg) {
  const std::int64_t rows = c.rows(), pitch = c.pitch(), S = c.longest();
  INFO("dtype " << dtype_name(dtype_of<T>::value) << ", tensor_core_search "
                << cfg.tensor_core_search);

  // Scores of every sequence over its own S_b, against the CPU reference.
  DeviceBuffer<float> score(rows * pitch), imp(rows * pitch), red(rows * S);
  DeviceBuffer<char> ws(cuda::rkv_workspace_bytes(c.dev_kv(), c.dev_q(), cfg));
  cuda::rkv_score(c.dev_kv(), c.dev_q(), cfg, {score.get(), imp.get(), red.get()}, ws.get(),
                  ws.size(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> g_score = score.download(), g_imp = imp.download(),
                           g_red = red.download();
  const RKVScores ref = cpu::rkv_scores(c.host_kv(), c.host_q(), cfg);
  auto all = [](std::int64_t) { return true; };
  CHECK(count_off(g_score, pitch, ref.score, all, "score") == 0);
  CHECK(count_off(g_imp, pitch, ref.importance, all, "importance") == 0);
  CHECK(count_off(g_red, S, ref.redundancy_full, all, "redundancy") == 0);

  // Each sequence alone (a batch of one of its own length) gives the very same bits.
  for (std::int64_t b = 0; b < c.B; ++b) {
    INFO("sequence " << b << " alone");
    const std::int64_t n = c.lengths[b] - c.W;
    DeviceBuffer<float> s1(c.H * n), r1(c.H * c.lengths[b]);
    DeviceBuffer<char> ws1(cuda::rkv_workspace_bytes(c.dev_kv_one(b), c.dev_q_one(b), cfg));
    cuda::rkv_score(c.dev_kv_one(b), c.dev_q_one(b), cfg, {s1.get(), nullptr, r1.get()}, ws1.get(),
                    ws1.size(), nullptr);
    const std::vector<float> one = s1.download(), one_r = r1.download();
    for (std::int64_t h = 0; h < c.H; ++h) {
      CHECK(std::memcmp(one.data() + h * n, g_score.data() + (b * c.H + h) * pitch,
                        static_cast<std::size_t>(n) * sizeof(float)) == 0);
      CHECK(std::memcmp(one_r.data() + h * c.lengths[b], g_red.data() + (b * c.H + h) * S,
                        static_cast<std::size_t>(c.lengths[b]) * sizeof(float)) == 0);
    }
  }

  // Selection: the scored sequences' scores equal rkv_score's; the plan follows the CPU rule.
  DeviceBuffer<std::int32_t> slots(rows * cfg.budget);
  DeviceBuffer<float> sel(rows * pitch);
  const bool compressed = cuda::rkv_select(c.dev_kv(), c.dev_q(), cfg, slots.get(), sel.get(),
                                           ws.get(), ws.size(), nullptr);
  REQUIRE(compressed == c.any_over(cfg.budget));
  const KeepPlan plan =
      cuda::download_keep_plan(c.dev_kv(), slots.get(), cfg.budget, cfg.window, nullptr);
  const std::vector<float> g_sel = sel.download();
  for (std::int64_t b = 0; b < c.B; ++b) {
    if (c.lengths[b] <= cfg.budget) continue;
    for (std::int64_t h = 0; h < c.H; ++h)
      CHECK(std::memcmp(g_sel.data() + (b * c.H + h) * pitch,
                        g_score.data() + (b * c.H + h) * pitch,
                        static_cast<std::size_t>(c.lengths[b] - c.W) * sizeof(float)) == 0);
  }
  const cpu::ScoreTensor own = as_score_tensor(g_score, pitch, c.lengths, c.H, c.C, c.W);
  const KeepPlan rule = cpu::plan_from_scores(c.host_kv(), &own, cfg.selection());
  CHECK(plan.indptr() == rule.indptr());
  CHECK(plan.slots() == rule.slots());
  const KeepPlan cpu_plan =
      cpu::select_scored_over_budget(c.host_kv(), cfg.selection(), [&](const std::uint8_t* over) {
        return cpu::rkv_scores(c.host_kv(), c.host_q(), cfg, over).score;
      });
  check_against_cpu_plan(plan, cpu_plan, ref.score, c.host_mask(), c.C, c.lengths, cfg.budget,
                         cfg.window, true);

  // select_topk_slots on the pitched scores makes the same rows.
  DeviceBuffer<std::int32_t> slots2(rows * cfg.budget);
  cuda::select_topk_slots(score.get(), c.lengths.data(), c.mask.empty() ? nullptr : c.d_mask.get(),
                          static_cast<int>(c.B), static_cast<int>(c.H), c.C, cfg.budget, cfg.window,
                          slots2.get(), nullptr);
  CHECK(slots2.download() == slots.download());

  // Determinism.
  DeviceBuffer<std::int32_t> again(rows * cfg.budget);
  cuda::rkv_select(c.dev_kv(), c.dev_q(), cfg, again.get(), nullptr, ws.get(), ws.size(), nullptr);
  CHECK(again.download() == slots.download());

  // Compaction from the device rows, in place, against kvsift::compact on the host.
  const HostCompacted<T> want = host_compact(c, plan);
  DeviceBuffer<std::int32_t> new_lengths(static_cast<std::size_t>(c.B));
  cuda::compact_device_rows(c.dev_kv(), slots.get(), cfg.budget, new_lengths.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(new_lengths.download() == plan.kept_lengths());
  check_same_rows(c.d_keys.download(), want.keys, plan.kept_lengths(), c.H, c.C, c.D, "keys");
  check_same_rows(c.d_values.download(), want.values, plan.kept_lengths(), c.H, c.C, c.D, "values");
  if (!c.mask.empty()) {
    const std::vector<std::uint8_t> m = c.d_mask.download();
    for (std::int64_t b = 0; b < c.B; ++b)
      CHECK(std::memcmp(m.data() + b * c.C, want.mask.data() + b * c.C,
                        static_cast<std::size_t>(plan.kept_length(b))) == 0);
  }
  // And from the host plan (cuda::compact) on a fresh copy; it rewrites the host lengths.
  c.d_keys.upload(c.keys);
  c.d_values.upload(c.values);
  if (!c.mask.empty()) c.d_mask.upload(c.mask);
  DeviceBuffer<char> cws(cuda::compact_workspace_bytes(plan));
  cuda::compact(c.dev_kv(), plan, cws.get(), cws.size(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(c.dev_len == want.lengths);
  check_same_rows(c.d_keys.download(), want.keys, plan.kept_lengths(), c.H, c.C, c.D,
                  "keys (host plan)");
  c.dev_len = c.lengths;
  c.d_keys.upload(c.keys);
  c.d_values.upload(c.values);
  if (!c.mask.empty()) c.d_mask.upload(c.mask);
}

}  // namespace

TEST_CASE("cuda R-KV on a ragged, left-padded batch equals the CPU reference",
          "[cuda][rkv][ragged]") {
  // Over budget with and without pads, at the budget, below it, and over it by length but with
  // so many pads that the real tokens fit (keeps exactly those).
  const std::vector<std::int32_t> lengths = {300, 150, 128, 96, 211, 300};
  const std::vector<std::int32_t> pads = {0, 20, 5, 0, 150, 37};
  for (bool tensor_core : {true, false}) {
    SECTION(std::string("f32, tensor_core_search ") + (tensor_core ? "on" : "off")) {
      Ragged<float> c(2, 2, 320, 64, 8, lengths, pads, 101);
      check_rkv_ragged(c, rkv_config(128, 8, tensor_core));
    }
    SECTION(std::string("bf16, tensor_core_search ") + (tensor_core ? "on" : "off")) {
      Ragged<bf16_t> c(2, 4, 320, 128, 8, lengths, pads, 102);
      check_rkv_ragged(c, rkv_config(128, 8, tensor_core));
    }
  }
  SECTION("f16, no pads, every sequence over budget, head_dim 40") {
    Ragged<f16_t> c(3, 1, 260, 40, 4, {260, 180, 259, 131}, {0, 0, 0, 0}, 103);
    check_rkv_ragged(c, rkv_config(100, 4, true));
  }
  SECTION("bf16, every sequence at or below budget: nothing is scored") {
    Ragged<bf16_t> c(2, 2, 200, 32, 8, {100, 37, 9}, {0, 3, 0}, 104);
    const RKVConfig cfg = rkv_config(100, 8, true);
    DeviceBuffer<std::int32_t> slots(c.rows() * cfg.budget);
    DeviceBuffer<char> ws(cuda::rkv_workspace_bytes(c.dev_kv(), c.dev_q(), cfg));
    CHECK_FALSE(cuda::rkv_select(c.dev_kv(), c.dev_q(), cfg, slots.get(), nullptr, ws.get(),
                                 ws.size(), nullptr));
    const KeepPlan plan =
        cuda::download_keep_plan(c.dev_kv(), slots.get(), cfg.budget, cfg.window, nullptr);
    CHECK(plan.keeps_everything());
    CHECK(plan.kept_lengths() == c.lengths);
  }
}

TEST_CASE("cuda rkv_select_step on a ragged batch equals rkv_select layer by layer",
          "[cuda][rkv][ragged]") {
  const std::vector<std::int32_t> lengths = {300, 120, 211, 300};
  const std::vector<std::int32_t> pads = {0, 10, 0, 40};
  Ragged<bf16_t> l0(2, 2, 320, 64, 8, lengths, pads, 201), l1(2, 2, 320, 64, 8, lengths, pads, 202);
  l1.d_mask.upload(l0.mask);  // the mask is per sequence: one for all layers
  const RKVConfig cfg = rkv_config(128, 8, true);
  std::vector<KVCacheView> kvs = {l0.dev_kv(), l1.dev_kv()};
  kvs[1].valid_mask = kvs[0].valid_mask;
  kvs[1].lengths = kvs[0].lengths;
  const std::vector<TensorView> qs = {l0.dev_q(), l1.dev_q()};
  const std::int64_t rows = l0.rows(), pitch = l0.pitch();
  DeviceBuffer<std::int32_t> step_slots(2 * rows * cfg.budget);
  DeviceBuffer<float> step_scores(2 * rows * pitch);
  KVSIFT_CUDA_CHECK(cudaMemset(step_scores.get(), 0, step_scores.size() * sizeof(float)));
  DeviceBuffer<char> ws(cuda::rkv_step_workspace_bytes(kvs.data(), qs.data(), 2, cfg));
  REQUIRE(cuda::rkv_select_step(kvs.data(), qs.data(), 2, cfg, step_slots.get(), step_scores.get(),
                                ws.get(), ws.size(), nullptr));
  const std::vector<std::int32_t> all_slots = step_slots.download();
  const std::vector<float> all_scores = step_scores.download();
  for (int l = 0; l < 2; ++l) {
    INFO("layer " << l);
    DeviceBuffer<std::int32_t> slots(rows * cfg.budget);
    DeviceBuffer<float> scores(rows * pitch);
    KVSIFT_CUDA_CHECK(cudaMemset(scores.get(), 0, scores.size() * sizeof(float)));
    DeviceBuffer<char> ws1(cuda::rkv_workspace_bytes(kvs[l], qs[l], cfg));
    cuda::rkv_select(kvs[l], qs[l], cfg, slots.get(), scores.get(), ws1.get(), ws1.size(), nullptr);
    const std::vector<std::int32_t> one = slots.download();
    CHECK(std::equal(one.begin(), one.end(), all_slots.begin() + l * rows * cfg.budget));
    const std::vector<float> sc = scores.download();
    CHECK(std::memcmp(sc.data(), all_scores.data() + l * rows * pitch, sc.size() * sizeof(float)) ==
          0);
  }
  // One compaction for both layers; the new lengths are the plan's.
  const KeepPlan plan =
      cuda::download_keep_plan(kvs[0], step_slots.get(), cfg.budget, cfg.window, nullptr);
  DeviceBuffer<std::int32_t> new_lengths(lengths.size());
  cuda::compact_device_rows_step(kvs.data(), 2, step_slots.get(), cfg.budget, new_lengths.get(),
                                 nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(new_lengths.download() == plan.kept_lengths());
}

namespace {

// Random penalty ranges per (b, h): some inside S_b, some past it (they subtract nothing).
SentencePenalties random_penalties(const std::vector<std::int32_t>& lengths, std::int64_t H,
                                   std::mt19937& rng) {
  SentencePenalties p(lengths.size() * static_cast<std::size_t>(H));
  for (std::size_t b = 0; b < lengths.size(); ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      auto& list = p[b * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)];
      const int count = std::uniform_int_distribution<int>(0, 6)(rng);
      for (int i = 0; i < count; ++i) {
        const std::int64_t lo =
            std::uniform_int_distribution<std::int64_t>(0, lengths[b] + 20)(rng);
        const std::int64_t hi = lo + std::uniform_int_distribution<std::int64_t>(0, 30)(rng);
        list.push_back({lo, hi, std::uniform_real_distribution<float>(0.95f, 1.0f)(rng)});
      }
    }
  return p;
}

template <class T>
void check_skipkv_ragged(Ragged<T>& c, const SentenceScorerConfig& cfg,
                         const SentencePenalties& penalties) {
  const std::int64_t rows = c.rows(), pitch = c.pitch();
  const bool faithful = cfg.pad_mode == PadMode::faithful;
  INFO("pad mode " << pad_mode_name(cfg.pad_mode));
  const cuda::SentencePenaltyCsr csr = cuda::build_penalty_csr(penalties, c.B, c.H);
  DeviceBuffer<char> pen_ws(cuda::sentence_penalty_workspace_bytes(csr));
  const cuda::SentencePenaltiesDevice pen =
      cuda::upload_sentence_penalties(csr, pen_ws.get(), pen_ws.size(), nullptr);
  DeviceBuffer<char> ws(cuda::skipkv_workspace_bytes(c.dev_kv(), c.dev_q(), cfg));

  DeviceBuffer<float> score(rows * pitch);
  cuda::RKVScoreOutputs out;
  out.score = score.get();
  cuda::skipkv_score(c.dev_kv(), c.dev_q(), cfg, pen, out, ws.get(), ws.size(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> g_score = score.download();
  const SentenceScores ref = cpu::sentence_scores(c.host_kv(), c.host_q(), cfg, penalties);
  CHECK(count_off(
            g_score, pitch, ref.score, [](std::int64_t) { return true; }, "score") == 0);

  DeviceBuffer<std::int32_t> slots(rows * cfg.rkv.budget);
  DeviceBuffer<float> sel(rows * pitch);
  const bool compressed = cuda::skipkv_select(c.dev_kv(), c.dev_q(), cfg, pen, slots.get(),
                                              sel.get(), ws.get(), ws.size(), nullptr);
  REQUIRE(compressed == c.any_over(cfg.rkv.budget));
  const KeepPlan plan =
      cuda::download_keep_plan(c.dev_kv(), slots.get(), cfg.rkv.budget, cfg.rkv.window, nullptr);
  const std::vector<float> g_sel = sel.download();
  for (std::int64_t b = 0; b < c.B; ++b) {
    if (c.lengths[b] <= cfg.rkv.budget) continue;
    for (std::int64_t h = 0; h < c.H; ++h)
      CHECK(std::memcmp(g_sel.data() + (b * c.H + h) * pitch,
                        g_score.data() + (b * c.H + h) * pitch,
                        static_cast<std::size_t>(c.lengths[b] - c.W) * sizeof(float)) == 0);
  }
  const cpu::ScoreTensor own = as_score_tensor(g_score, pitch, c.lengths, c.H, c.C, c.W);
  const KeepPlan rule = plan_sentence_scores(c.host_kv(), own, cfg);
  CHECK(plan.indptr() == rule.indptr());
  CHECK(plan.slots() == rule.slots());
  const KeepPlan cpu_plan = SentenceScorer(cfg).select(c.host_kv(), c.host_q(), penalties);
  check_against_cpu_plan(plan, cpu_plan, ref.score, c.host_mask(), c.C, c.lengths, cfg.rkv.budget,
                         cfg.rkv.window, !faithful);

  // Each sequence alone gives the same eq. 6 bits (its penalties are its own rows).
  for (std::int64_t b = 0; b < c.B; ++b) {
    INFO("sequence " << b << " alone");
    const SentencePenalties mine(penalties.begin() + b * c.H, penalties.begin() + (b + 1) * c.H);
    const cuda::SentencePenaltyCsr csr1 = cuda::build_penalty_csr(mine, 1, c.H);
    DeviceBuffer<char> pws1(cuda::sentence_penalty_workspace_bytes(csr1));
    const cuda::SentencePenaltiesDevice pen1 =
        cuda::upload_sentence_penalties(csr1, pws1.get(), pws1.size(), nullptr);
    const std::int64_t n = c.lengths[b] - c.W;
    DeviceBuffer<float> s1(c.H * n);
    DeviceBuffer<char> ws1(cuda::skipkv_workspace_bytes(c.dev_kv_one(b), c.dev_q_one(b), cfg));
    cuda::RKVScoreOutputs o1;
    o1.score = s1.get();
    cuda::skipkv_score(c.dev_kv_one(b), c.dev_q_one(b), cfg, pen1, o1, ws1.get(), ws1.size(),
                       nullptr);
    const std::vector<float> one = s1.download();
    for (std::int64_t h = 0; h < c.H; ++h)
      CHECK(std::memcmp(one.data() + h * n, g_score.data() + (b * c.H + h) * pitch,
                        static_cast<std::size_t>(n) * sizeof(float)) == 0);
  }
}

}  // namespace

TEST_CASE("cuda SkipKV on a ragged, left-padded batch equals the CPU reference",
          "[cuda][skipkv][ragged]") {
  const std::vector<std::int32_t> lengths = {300, 150, 128, 96, 211, 300};
  const std::vector<std::int32_t> pads = {0, 20, 5, 0, 150, 37};
  std::mt19937 rng(7);
  for (PadMode mode : {PadMode::exclude, PadMode::faithful}) {
    SECTION(std::string("bf16, pads ") + pad_mode_name(mode)) {
      Ragged<bf16_t> c(2, 2, 320, 64, 8, lengths, pads, 301);
      SentenceScorerConfig cfg;
      cfg.rkv.budget = 128;
      cfg.rkv.window = 8;
      cfg.pad_mode = mode;
      check_skipkv_ragged(c, cfg, random_penalties(lengths, 2, rng));
    }
    SECTION(std::string("f32, fp32 search, pads ") + pad_mode_name(mode)) {
      Ragged<float> c(2, 3, 320, 32, 8, lengths, pads, 302);
      SentenceScorerConfig cfg;
      cfg.rkv.budget = 128;
      cfg.rkv.window = 8;
      cfg.pad_mode = mode;
      cfg.rkv.tensor_core_search = false;
      check_skipkv_ragged(c, cfg, random_penalties(lengths, 2, rng));
    }
  }
}

TEST_CASE("linking kvsift::cuda registers the DeviceBackend; its selections equal the CPU plan",
          "[cuda][backend][ragged]") {
  REQUIRE(has_device_backend());
  const DeviceBackend& backend = device_backend();
  const std::vector<std::int32_t> lengths = {300, 150, 128, 211, 300};
  const std::vector<std::int32_t> pads = {0, 20, 5, 150, 37};
  Ragged<bf16_t> c(2, 2, 320, 64, 8, lengths, pads, 401);
  cudaStream_t stream = nullptr;
  KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));

  SECTION("rkv_select") {
    const RKVConfig cfg = rkv_config(128, 8, true);
    DeviceBuffer<char> ws(backend.rkv_workspace_bytes(c.dev_kv(), c.dev_q(), cfg));
    const ExecContext ctx{ws.get(), ws.size(), stream};
    const KeepPlan plan = backend.rkv_select(c.dev_kv(), c.dev_q(), cfg, ctx);
    const RKVScores ref = cpu::rkv_scores(c.host_kv(), c.host_q(), cfg);
    const KeepPlan cpu_plan =
        cpu::select_scored_over_budget(c.host_kv(), cfg.selection(), [&](const std::uint8_t* over) {
          return cpu::rkv_scores(c.host_kv(), c.host_q(), cfg, over).score;
        });
    check_against_cpu_plan(plan, cpu_plan, ref.score, c.host_mask(), c.C, c.lengths, cfg.budget,
                           cfg.window, true);
    // The same plan as the direct calls.
    DeviceBuffer<std::int32_t> slots(c.rows() * cfg.budget);
    DeviceBuffer<char> ws1(cuda::rkv_workspace_bytes(c.dev_kv(), c.dev_q(), cfg));
    cuda::rkv_select(c.dev_kv(), c.dev_q(), cfg, slots.get(), nullptr, ws1.get(), ws1.size(),
                     nullptr);
    const KeepPlan direct =
        cuda::download_keep_plan(c.dev_kv(), slots.get(), cfg.budget, cfg.window, nullptr);
    CHECK(plan.slots() == direct.slots());
    CHECK(plan.indptr() == direct.indptr());

    // Too small a workspace is refused before anything runs (the lengths are still over budget).
    REQUIRE_THROWS_WITH(
        backend.rkv_select(c.dev_kv(), c.dev_q(), cfg, ExecContext{ws.get(), 100, stream}),
        Catch::Matchers::Contains("workspace of 100 bytes is too small"));

    // compact through the backend equals kvsift::compact on the host.
    const HostCompacted<bf16_t> want = host_compact(c, plan);
    DeviceBuffer<char> cws(backend.compact_workspace_bytes(plan));
    backend.compact(c.dev_kv(), plan, ExecContext{cws.get(), cws.size(), stream});
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(c.dev_len == want.lengths);
    check_same_rows(c.d_values.download(), want.values, plan.kept_lengths(), c.H, c.C, c.D,
                    "values");
  }
  SECTION("skipkv_select") {
    SentenceScorerConfig cfg;
    cfg.rkv.budget = 128;
    cfg.rkv.window = 8;
    std::mt19937 rng(9);
    const SentencePenalties penalties = random_penalties(lengths, 2, rng);
    DeviceBuffer<char> ws(backend.skipkv_workspace_bytes(c.dev_kv(), c.dev_q(), cfg, penalties));
    const KeepPlan plan = backend.skipkv_select(c.dev_kv(), c.dev_q(), cfg, penalties,
                                                ExecContext{ws.get(), ws.size(), stream});
    const SentenceScores ref = cpu::sentence_scores(c.host_kv(), c.host_q(), cfg, penalties);
    const KeepPlan cpu_plan = SentenceScorer(cfg).select(c.host_kv(), c.host_q(), penalties);
    check_against_cpu_plan(plan, cpu_plan, ref.score, c.host_mask(), c.C, c.lengths, cfg.rkv.budget,
                           cfg.rkv.window, true);
  }
  SECTION("at or below the budget: the plan keeps everything without touching the device") {
    const RKVConfig cfg = rkv_config(400, 8, true);
    const KeepPlan plan = backend.rkv_select(c.dev_kv(), c.dev_q(), cfg, ExecContext{});
    CHECK(plan.keeps_everything());
  }
  SECTION("copy_to_host") {
    const std::vector<float> src = {1.5f, -2.0f, 3.25f};
    DeviceBuffer<float> d(src);
    std::vector<float> dst(3, 0.0f);
    backend.copy_to_host(dst.data(), d.get(), 3 * sizeof(float), ExecContext{nullptr, 0, stream});
    CHECK(dst == src);
  }
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
}
