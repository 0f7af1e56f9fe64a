// kvsift::cuda SkipKV scoring (docs/algorithms.md §2.4) against the CPU SentenceScorer
// (policy/skipkv/sentence_scorer.hpp) and the SkipKV reference (golden skipkv_pad,
// skipkv_sentences):
//   - eq. 6 scores within |x − ref| <= 1e-6 + 1e-4·|ref| of the CPU and of the reference;
//   - the penalty and pad pass bit-exact: the GPU's own R-KV score minus the λ's of the mapped
//     ranges, subtracted in list order by a per-token host oracle, faithful pads exactly +100;
//   - the selection exactly the CPU rule (plan_sentence_scores) applied to the GPU's own scores,
//     and the CPU plan up to near-cut swaps; the downloaded plan accepted by compact();
//   - random penalty ranges (overlaps, one-token, past the end, in the window, > 256 per row) in
//     both pad modes and every storage dtype; the error paths.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/sentence_scoring.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/policy/skipkv/sentence_scorer.hpp"
#include "kvsift/policy/skipkv/sentence_tracker.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

bool within_tolerance(double x, double ref) {
  return std::fabs(x - ref) <= 1e-6 + 1e-4 * std::fabs(ref);
}

// A cache of storage type T on host and device, with window queries and an optional pad mask.
template <class T>
struct Case {
  std::int64_t B, H, Hq, S, D, W;
  std::vector<T> keys, queries;
  std::vector<std::uint8_t> mask;  // [B, S] or empty
  std::vector<std::int32_t> host_lengths, dev_lengths;
  DeviceBuffer<T> d_keys, d_queries;
  DeviceBuffer<std::uint8_t> d_mask;

  Case(std::int64_t b, std::int64_t h, std::int64_t hq, std::int64_t s, std::int64_t d,
       std::int64_t w, const std::vector<float>& k, const std::vector<float>& q,
       std::vector<std::uint8_t> m)
      : B(b),
        H(h),
        Hq(hq),
        S(s),
        D(d),
        W(w),
        keys(convert(k)),
        queries(convert(q)),
        mask(std::move(m)),
        host_lengths(static_cast<std::size_t>(b), static_cast<std::int32_t>(s)),
        dev_lengths(host_lengths),
        d_keys(keys),
        d_queries(queries),
        d_mask(mask.empty() ? std::vector<std::uint8_t>(1) : mask) {
    REQUIRE(keys.size() == static_cast<std::size_t>(B * H * S * D));
    REQUIRE(queries.size() == static_cast<std::size_t>(B * Hq * W * D));
    REQUIRE((mask.empty() || mask.size() == static_cast<std::size_t>(B * S)));
  }
  static std::vector<T> convert(const std::vector<float>& x) {
    std::vector<T> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = from_float<T>(x[i]);
    return out;
  }
  std::uint8_t* host_mask() { return mask.empty() ? nullptr : mask.data(); }
  // Values alias the keys: scoring never reads them (check_compact() uses separate copies).
  KVCacheView host_kv() {
    return make_kv_cache_view(keys.data(), keys.data(), dtype_of<T>::value, Device::cpu, B, H, S, D,
                              host_lengths.data(), host_mask());
  }
  KVCacheView dev_kv() {
    return make_kv_cache_view(d_keys.get(), d_keys.get(), dtype_of<T>::value, Device::cuda, B, H, S,
                              D, dev_lengths.data(), mask.empty() ? nullptr : d_mask.get());
  }
  TensorView host_q() {
    return TensorView::contiguous(queries.data(), dtype_of<T>::value, Device::cpu, {B, Hq, W, D});
  }
  TensorView dev_q() {
    return TensorView::contiguous(d_queries.get(), dtype_of<T>::value, Device::cuda, {B, Hq, W, D});
  }
  bool is_pad(std::int64_t b, std::int64_t j) const { return !mask.empty() && !mask[b * S + j]; }
};

// The CPU scorer takes the same config (config/sentence_scorer_config.hpp).
SentenceScorerConfig cpu_config(const SentenceScorerConfig& c) { return c; }

// Everything one GPU run produces. Outputs are poisoned (0xFF bytes: NaN scores, slot −1... all
// bits set) before the run so an element the kernels forget shows up.
struct GpuRun {
  std::vector<float> score;  // [B*H, n] eq. 6 (skipkv_score)
  std::vector<float> rkv;    // [B*H, n] the plain R-KV score (rkv_score), for the exact oracle
  std::vector<float> select_scores;  // [B*H, n] the scores skipkv_select wrote
  bool compressed = false;
  KeepPlan plan;
};

template <class T>
GpuRun run_gpu(Case<T>& c, const SentenceScorerConfig& cfg,
               const std::vector<std::vector<PenaltyRange>>& penalties) {
  const std::int64_t rows = c.B * c.H, n = std::max<std::int64_t>(c.S - c.W, 1);
  const KVCacheView kv = c.dev_kv();
  const cuda::SentencePenaltyCsr csr = cuda::build_penalty_csr(penalties, c.B, c.H);
  DeviceBuffer<char> pen_ws(cuda::sentence_penalty_workspace_bytes(csr));
  const cuda::SentencePenaltiesDevice pen =
      cuda::upload_sentence_penalties(csr, pen_ws.get(), pen_ws.size(), nullptr);
  DeviceBuffer<char> ws(cuda::skipkv_workspace_bytes(kv, c.dev_q(), cfg));
  DeviceBuffer<float> score(rows * n), rkv(rows * n), sel_scores(rows * n);
  DeviceBuffer<std::int32_t> slots(rows * cfg.rkv.budget);
  for (void* p : {static_cast<void*>(score.get()), static_cast<void*>(rkv.get()),
                  static_cast<void*>(sel_scores.get())})
    KVSIFT_CUDA_CHECK(cudaMemset(p, 0xFF, rows * n * sizeof(float)));
  KVSIFT_CUDA_CHECK(cudaMemset(slots.get(), 0x7F, slots.size() * sizeof(std::int32_t)));

  GpuRun r;
  if (c.S > c.W) {
    cuda::RKVScoreOutputs out;
    out.score = score.get();
    cuda::skipkv_score(kv, c.dev_q(), cfg, pen, out, ws.get(), ws.size(), nullptr);
    DeviceBuffer<char> rkv_ws(cuda::rkv_workspace_bytes(kv, c.dev_q(), cfg.rkv));
    cuda::RKVScoreOutputs plain;
    plain.score = rkv.get();
    cuda::rkv_score(kv, c.dev_q(), cfg.rkv, plain, rkv_ws.get(), rkv_ws.size(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  r.compressed = cuda::skipkv_select(kv, c.dev_q(), cfg, pen, slots.get(), sel_scores.get(),
                                     ws.get(), ws.size(), nullptr);
  r.plan = cuda::download_keep_plan(kv, slots.get(), cfg.rkv.budget, cfg.rkv.window, nullptr);
  r.score = score.download();
  r.rkv = rkv.download();
  r.select_scores = sel_scores.download();
  return r;
}

// The penalty and pad pass written per token: walk the row's ranges in list order, subtract λ
// from every token a mapped range (lo < hi < S) covers, then pin faithful pads to +100.
template <class T>
std::vector<float> penalty_oracle(const Case<T>& c, const std::vector<float>& rkv,
                                  const std::vector<std::vector<PenaltyRange>>& penalties,
                                  bool faithful_pads) {
  const std::int64_t n = c.S - c.W;
  std::vector<float> out(rkv);
  for (std::int64_t r = 0; r < c.B * c.H; ++r)
    for (std::int64_t t = 0; t < n; ++t) {
      float x = rkv[r * n + t];
      if (!penalties.empty())
        for (const PenaltyRange& p : penalties[r])
          if (p.lo < p.hi && p.hi < c.S && p.lo <= t && t <= p.hi) x = x - p.lambda;
      if (faithful_pads && c.is_pad(r / c.H, t)) x = kFaithfulPadScore;
      out[r * n + t] = x;
    }
  return out;
}

std::int64_t count_off(const std::vector<float>& ours, const cpu::ScoreTensor& ref, std::int64_t H,
                       std::int64_t n, const char* what) {
  std::int64_t bad = 0;
  for (std::int64_t b = 0; b < ref.batch(); ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < n; ++j) {
        const float x = ours[(b * H + h) * n + j], y = ref.at(b, h, j);
        if (!within_tolerance(x, y) && bad++ < 5)
          UNSCOPED_INFO(what << " [" << b << ", " << h << ", " << j << "]: " << x << " vs " << y);
      }
  return bad;
}

// GPU scores as a CPU ScoreTensor, to run the CPU selection rule on them.
cpu::ScoreTensor as_score_tensor(const std::vector<float>& s, std::int64_t B, std::int64_t H,
                                 std::int64_t n) {
  cpu::ScoreTensor t(B, H, n);
  for (std::int64_t b = 0; b < B; ++b) t.set_count(b, static_cast<std::int32_t>(n));
  for (std::int64_t r = 0; r < B * H; ++r)
    std::copy(s.begin() + r * n, s.begin() + (r + 1) * n, t.row(r / H, r % H));
  return t;
}

// Kept sets equal `ref` except for slots whose score in `ref_score` lies within `eps` of the cut
// (the (budget − W)-th largest candidate; pads left out in exclude mode). Returns the swaps.
std::int64_t check_near_cut(const KeepPlan& ours, const KeepPlan& ref,
                            const cpu::ScoreTensor& ref_score, const std::uint8_t* mask,
                            std::int64_t S, std::int64_t keep, bool exclude_pads,
                            const std::function<bool(float, float)>& near) {
  std::int64_t swaps = 0;
  const std::int64_t n = ref_score.count(0);
  for (std::int64_t b = 0; b < ours.batch(); ++b)
    for (std::int64_t h = 0; h < ours.kv_heads(); ++h) {
      REQUIRE(ours.row_size(b, h) == ref.row_size(b, h));
      std::vector<float> cand;
      for (std::int64_t j = 0; j < n; ++j)
        if (!exclude_pads || mask == nullptr || mask[b * S + j])
          cand.push_back(ref_score.at(b, h, j));
      std::sort(cand.begin(), cand.end(), std::greater<float>());
      const std::size_t k = std::min<std::size_t>(cand.size(), static_cast<std::size_t>(keep));
      const float cut = k > 0 ? cand[k - 1] : 0.0f;
      std::vector<std::int32_t> a(ours.row(b, h), ours.row(b, h) + ours.row_size(b, h));
      std::vector<std::int32_t> e(ref.row(b, h), ref.row(b, h) + ref.row_size(b, h));
      std::vector<std::int32_t> diff;
      std::set_symmetric_difference(a.begin(), a.end(), e.begin(), e.end(),
                                    std::back_inserter(diff));
      for (std::int32_t j : diff) {
        INFO("(b=" << b << ", h=" << h << ") slot " << j << " kept by one side only");
        REQUIRE(j < n);
        INFO("score " << ref_score.at(b, h, j) << ", cut " << cut);
        CHECK(near(ref_score.at(b, h, j), cut));
      }
      swaps += static_cast<std::int64_t>(diff.size());
    }
  return swaps;
}

// Applies the plan to a host copy of the cache: compact() must accept it (pads agree across
// heads) and the kept pads / lengths must follow the pad mode.
template <class T>
void check_compact(Case<T>& c, const KeepPlan& plan, bool faithful_pads, int budget) {
  std::vector<T> keys(c.keys), values(c.keys);
  std::vector<std::uint8_t> mask(c.mask);
  std::vector<std::int32_t> lengths(c.host_lengths);
  KVCacheView kv =
      make_kv_cache_view(keys.data(), values.data(), dtype_of<T>::value, Device::cpu, c.B, c.H, c.S,
                         c.D, lengths.data(), mask.empty() ? nullptr : mask.data());
  REQUIRE_NOTHROW(compact(kv, plan));
  for (std::int64_t b = 0; b < c.B; ++b) {
    std::int64_t pads = 0;
    for (std::int64_t j = 0; j < c.S; ++j) pads += c.is_pad(b, j) ? 1 : 0;
    const std::int64_t real = c.S - pads;
    INFO("sequence " << b << ": " << pads << " pads");
    if (c.S <= budget) {
      CHECK(lengths[b] == c.S);
    } else if (faithful_pads) {
      CHECK(lengths[b] == budget);
    } else {
      CHECK(lengths[b] == std::min<std::int64_t>(budget, real));
      for (std::int64_t j = 0; j < lengths[b]; ++j) CHECK(kv.is_valid(b, j));
    }
  }
}

// The full comparison of one case with the CPU SentenceScorer.
template <class T>
void check_case(Case<T>& c, const SentenceScorerConfig& cfg,
                const std::vector<std::vector<PenaltyRange>>& penalties) {
  const std::int64_t n = c.S - c.W, keep = cfg.rkv.budget - cfg.rkv.window;
  const SentenceScorerConfig ccfg = cpu_config(cfg);
  const GpuRun g = run_gpu(c, cfg, penalties);

  // Scores: the CPU reference, and the exact penalty/pad arithmetic on the GPU's R-KV score.
  const SentenceScores ref = cpu::sentence_scores(c.host_kv(), c.host_q(), ccfg, penalties);
  CHECK(count_off(g.score, ref.score, c.H, n, "score") == 0);
  const std::vector<float> exact =
      penalty_oracle(c, g.rkv, penalties, (cfg.pad_mode == PadMode::faithful));
  std::int64_t inexact = 0;
  for (std::size_t i = 0; i < exact.size(); ++i)
    if (std::memcmp(&exact[i], &g.score[i], sizeof(float)) != 0 && inexact++ < 5)
      UNSCOPED_INFO("element " << i << ": " << g.score[i] << " vs oracle " << exact[i]);
  CHECK(inexact == 0);

  // Selection.
  REQUIRE(g.compressed == (c.S > cfg.rkv.budget));
  REQUIRE_NOTHROW(g.plan.validate());
  const KeepPlan cpu_plan = SentenceScorer(ccfg).select(c.host_kv(), c.host_q(), penalties);
  REQUIRE(g.plan.kept_lengths() == cpu_plan.kept_lengths());
  if (!g.compressed) {
    CHECK(g.plan.slots() == cpu_plan.slots());
  } else {
    CHECK(std::memcmp(g.select_scores.data(), g.score.data(), g.score.size() * sizeof(float)) == 0);
    // Exactly the CPU selection rule on the GPU's own scores.
    const KeepPlan rule =
        plan_sentence_scores(c.host_kv(), as_score_tensor(g.score, c.B, c.H, n), ccfg);
    CHECK(g.plan.slots() == rule.slots());
    CHECK(g.plan.indptr() == rule.indptr());
    // Against the CPU's own scores: differences only at the cut.
    const std::int64_t swaps = check_near_cut(
        g.plan, cpu_plan, ref.score, c.host_mask(), c.S, keep, !(cfg.pad_mode == PadMode::faithful),
        [](float x, float cut) { return within_tolerance(x, cut); });
    UNSCOPED_INFO(swaps << " near-cut slots differ from the CPU plan");
  }
  check_compact(c, g.plan, (cfg.pad_mode == PadMode::faithful), cfg.rkv.budget);

  // Determinism: the scores of a second run are bit-identical.
  const GpuRun again = run_gpu(c, cfg, penalties);
  CHECK(std::memcmp(again.score.data(), g.score.data(), g.score.size() * sizeof(float)) == 0);
  CHECK(again.plan.slots() == g.plan.slots());
}

std::vector<float> normal_values(std::size_t count, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> v(count);
  for (float& x : v) x = nd(rng);
  return v;
}

// Keys with some near-duplicate rows (so R varies), [B, H, S, D].
std::vector<float> make_keys(std::int64_t B, std::int64_t H, std::int64_t S, std::int64_t D,
                             std::mt19937& rng) {
  std::vector<float> k = normal_values(static_cast<std::size_t>(B * H * S * D), rng);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  for (std::int64_t r = 0; r < B * H; ++r)
    for (std::int64_t i = 1; i < S; ++i) {
      if (ud(rng) >= 0.2f) continue;
      const std::int64_t src = std::uniform_int_distribution<std::int64_t>(0, i - 1)(rng);
      for (std::int64_t d = 0; d < D; ++d)
        k[(r * S + i) * D + d] = k[(r * S + src) * D + d] + 0.05f * ud(rng);
    }
  return k;
}

// Random ranges for every (b, h): ordinary sentences, overlaps, one-token ranges (no effect),
// ranges reaching past the end (no effect), ranges inside or into the window, and, for `dense`
// rows, several hundred short ranges (more than one block-sized chunk).
std::vector<std::vector<PenaltyRange>> random_penalties(std::int64_t B, std::int64_t H,
                                                        std::int64_t S, std::int64_t W,
                                                        std::mt19937& rng, bool dense) {
  std::vector<std::vector<PenaltyRange>> pen(static_cast<std::size_t>(B * H));
  std::uniform_real_distribution<float> big(0.95f, 1.0f), small(0.0f, 0.01f);
  auto pos = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  const std::int64_t n = S - W;
  for (std::int64_t r = 0; r < B * H; ++r) {
    std::vector<PenaltyRange>& row = pen[r];
    const int kinds = static_cast<int>(pos(0, 7));
    for (int i = 0; i < kinds; ++i) {
      const std::int64_t lo = pos(0, n - 2), len = pos(1, 30);
      row.push_back({lo, std::min(lo + len, S - 1), big(rng)});
    }
    if (r % 2 == 0 && !row.empty())  // overlapping the first one, a small λ
      row.push_back({row[0].lo + 1, row[0].hi + 5 < S ? row[0].hi + 5 : S - 1, small(rng)});
    const std::int64_t one = pos(0, n - 1);
    row.push_back({one, one, 0.99f});                      // one token: lo == hi, no penalty
    row.push_back({pos(0, n - 1), S + pos(0, 3), 0.97f});  // hi >= S: not mapped, no penalty
    row.push_back({n + pos(0, W - 1), S - 1, 0.96f});      // inside the window (lo may = hi)
    row.push_back({n - 3, S - 1, 0.98f});                  // runs into the window
    if (dense && r == 0)
      for (std::int64_t lo = 0; lo + 2 < n; lo += 3) row.push_back({lo, lo + pos(0, 2), big(rng)});
    std::shuffle(row.begin(), row.end(), rng);  // order matters only where ranges overlap
  }
  return pen;
}

template <class T>
void run_random(std::int64_t B, std::int64_t H, std::int64_t G, std::int64_t S, std::int64_t D,
                std::int64_t W, int budget, std::int64_t pads_step, bool faithful_pads,
                bool faithful_redundancy, std::uint32_t seed, bool dense = false) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> mask;
  if (pads_step > 0) {  // left pads: sequence b has b * pads_step
    mask.assign(static_cast<std::size_t>(B * S), 1);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = 0; j < std::min(S, b * pads_step); ++j) mask[b * S + j] = 0;
  }
  Case<T> c(B, H, H * G, S, D, W, make_keys(B, H, S, D, rng),
            normal_values(static_cast<std::size_t>(B * H * G * W * D), rng), mask);
  SentenceScorerConfig cfg;
  cfg.rkv.budget = budget;
  cfg.rkv.window = static_cast<int>(W);
  cfg.rkv.redundancy = faithful_redundancy ? RedundancyMode::faithful : RedundancyMode::sound;
  cfg.pad_mode = faithful_pads ? PadMode::faithful : PadMode::exclude;
  INFO("B=" << B << " H=" << H << " G=" << G << " S=" << S << " D=" << D << " W=" << W
            << " budget=" << budget << " pads_step=" << pads_step << " pads "
            << (faithful_pads ? "faithful" : "exclude") << " dtype "
            << dtype_name(dtype_of<T>::value) << " seed " << seed);
  {
    INFO("random penalties");
    check_case(c, cfg, random_penalties(B, H, S, W, rng, dense));
  }
  {
    INFO("no penalties");
    check_case(c, cfg, {});
  }
}

// ---- golden cases (the SkipKV reference, faithful pads) ----

struct Golden {
  SafetensorsFile file;
  nlohmann::json config;
  std::int64_t B = 0, H = 0, S = 0, D = 0, Hq = 0, W = 0;
  std::vector<float> k, q;
  std::vector<std::uint8_t> mask;

  explicit Golden(const std::string& name)
      : file(SafetensorsFile::load(std::string(KVSIFT_GOLDEN_DIR) + "/" + name)) {
    config = nlohmann::json::parse(file.metadata().at("config"));
    const StTensor& kt = file.get("keys", {-1, -1, -1, -1});
    B = kt.shape[0], H = kt.shape[1], S = kt.shape[2], D = kt.shape[3];
    k = kt.to_f32();
    const StTensor& qt = file.get("queries", {B, -1, -1, D});
    Hq = qt.shape[1], W = qt.shape[2];
    q = qt.to_f32();
    const std::vector<std::int64_t> m = file.get("valid_mask", {B, S}).to_i64();
    mask.assign(m.begin(), m.end());
  }
  std::int64_t pads(std::int64_t b) const {
    std::int64_t p = 0;
    while (p < S && mask[b * S + p] == 0) ++p;
    return p;
  }
  // The reference's settings: the column-0 redundancy fallback and +100 pads.
  SentenceScorerConfig gpu_config() const {
    SentenceScorerConfig c;
    c.rkv.budget = config.at("budget").get<int>();
    c.rkv.window = config.at("window").get<int>();
    c.rkv.kernel = config.at("kernel").get<int>();
    c.rkv.mix_lambda = config.at("mix_lambda").get<float>();
    c.rkv.threshold = config.at("threshold").get<float>();
    c.rkv.redundancy = RedundancyMode::faithful;
    c.pad_mode = PadMode::faithful;
    return c;
  }
};

// The golden `sentences` rows [batch, start, end, λ] as SegmentTable penalties, built the way
// tests/test_sentence_scorer.cpp does: each sequence's token stream rebuilt from its pads and the
// row ends (delimiter id 1), the marks applied as given, cache range = generation range.
std::vector<std::vector<PenaltyRange>> golden_penalties(const Golden& g,
                                                        std::vector<SentenceTracker>& trackers) {
  const std::vector<float> rows = g.file.get("sentences", {-1, 4}).to_f32();
  SentenceTrackerConfig tc;
  tc.tokens = SentenceTokens{{1}, {}};
  for (std::int64_t b = 0; b < g.B; ++b) {
    SentenceTracker t(tc);
    t.add_padding(g.pads(b));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(g.S - g.pads(b)), 5);
    for (std::size_t r = 0; r < rows.size() / 4; ++r)
      if (rows[4 * r] == b) ids[static_cast<std::size_t>(rows[4 * r + 2]) - g.pads(b)] = 1;
    t.observe(ids);
    trackers.push_back(t);
  }
  apply_sentence_marks(trackers, rows.data(), static_cast<std::int64_t>(rows.size() / 4));
  SegmentTable table(1, g.B, g.H);
  std::vector<std::vector<PenaltyRange>> pen(static_cast<std::size_t>(g.B * g.H));
  for (std::int64_t b = 0; b < g.B; ++b) {
    table.set_first_position(b, g.pads(b));
    table.append_closed(0, b, trackers[b].sentences(), trackers[b].position(), g.S);
    for (std::int64_t h = 0; h < g.H; ++h)
      pen[b * g.H + h] = table.penalty_ranges(0, b, h, trackers[b].sentences());
  }
  return pen;
}

// Scores against the reference's `score`, kept sets against its `keep_sorted` (near-cut rule of
// golden/README.md: 1e-6 of the cut), the window after them, and the CPU SentenceScorer.
void check_golden(Golden& g, const std::vector<std::vector<PenaltyRange>>& pen, GpuRun* out) {
  Case<float> c(g.B, g.H, g.Hq, g.S, g.D, g.W, g.k, g.q, g.mask);
  const SentenceScorerConfig cfg = g.gpu_config();
  const std::int64_t n = g.S - g.W, keep = cfg.rkv.budget - g.W;
  const GpuRun r = run_gpu(c, cfg, pen);
  REQUIRE(r.compressed);
  const cpu::ScoreTensor ref =
      as_score_tensor(g.file.get("score", {g.B, g.H, n}).to_f32(), g.B, g.H, n);
  CHECK(count_off(r.score, ref, g.H, n, "score vs reference") == 0);
  const SentenceScores cpu_s = cpu::sentence_scores(c.host_kv(), c.host_q(), cpu_config(cfg), pen);
  CHECK(count_off(r.score, cpu_s.score, g.H, n, "score vs CPU") == 0);

  const std::vector<std::int64_t> ref_keep = g.file.get("keep_sorted", {g.B, g.H, keep}).to_i64();
  // The reference's kept set as a plan (its top-k, then the window).
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(g.B), static_cast<std::int32_t>(g.S));
  std::vector<std::int32_t> kept(static_cast<std::size_t>(g.B), cfg.rkv.budget);
  KeepPlan ref_plan(g.B, g.H, g.S, lengths, kept, static_cast<std::int32_t>(g.W));
  for (std::int64_t r2 = 0; r2 < g.B * g.H; ++r2) {
    std::vector<std::int32_t> row(ref_keep.begin() + r2 * keep, ref_keep.begin() + (r2 + 1) * keep);
    for (std::int64_t w = 0; w < g.W; ++w) row.push_back(static_cast<std::int32_t>(n + w));
    ref_plan.append_row(row);
  }
  check_near_cut(r.plan, ref_plan, ref, c.host_mask(), g.S, keep, false,
                 [](float x, float cut) { return std::fabs(x - cut) <= 1e-6f; });
  for (std::int64_t b = 0; b < g.B; ++b)
    for (std::int64_t h = 0; h < g.H; ++h)
      for (std::int64_t w = 0; w < g.W; ++w) CHECK(r.plan.row(b, h)[keep + w] == n + w);
  check_compact(c, r.plan, true, cfg.rkv.budget);
  *out = r;
}

}  // namespace

TEST_CASE("cuda SkipKV: the pad score is the CPU's", "[cuda][skipkv]") {
  CHECK(cuda::kSkipKVPadScore == kFaithfulPadScore);
}

TEST_CASE("cuda SkipKV golden skipkv_pad: faithful pads (+100, force-kept) match the reference",
          "[cuda][skipkv][golden]") {
  Golden g("skipkv_pad.safetensors");
  GpuRun r;
  check_golden(g, {}, &r);
  const std::int64_t n = g.S - g.W;
  REQUIRE(g.pads(1) == 17);
  REQUIRE(g.pads(2) == 40);
  for (std::int64_t b = 0; b < g.B; ++b)
    for (std::int64_t h = 0; h < g.H; ++h) {
      for (std::int64_t j = 0; j < g.pads(b); ++j) {
        CHECK(r.score[(b * g.H + h) * n + j] == kFaithfulPadScore);  // exactly
        CHECK(r.plan.row(b, h)[j] == j);  // every pad kept, first, in every head
      }
    }
}

TEST_CASE("cuda SkipKV golden skipkv_sentences: the penalty and its eviction match the reference",
          "[cuda][skipkv][golden]") {
  Golden g("skipkv_sentences.safetensors");
  std::vector<SentenceTracker> trackers;
  const std::vector<std::vector<PenaltyRange>> pen = golden_penalties(g, trackers);
  GpuRun r;
  check_golden(g, pen, &r);
  // Independent of the reference: each redundant sentence (more than one token) is gone whole in
  // every head.
  std::int64_t redundant_seen = 0;
  const int budget = g.gpu_config().rkv.budget;
  for (std::int64_t b = 0; b < g.B; ++b)
    for (const Sentence& s : trackers[b].sentences()) {
      if (!s.redundant() || s.end <= s.start) continue;
      ++redundant_seen;
      for (std::int64_t h = 0; h < g.H; ++h) {
        const std::int32_t* row = r.plan.row(b, h);
        const std::int32_t* lo = std::lower_bound(row, row + budget, s.start);
        INFO("b=" << b << " h=" << h << " sentence [" << s.start << ", " << s.end << "]");
        CHECK((lo == row + budget || *lo > s.end));
      }
    }
  CHECK(redundant_seen == 3);
}

TEST_CASE("cuda SkipKV equals the CPU SentenceScorer on random caches and penalties",
          "[cuda][skipkv]") {
  SECTION("f32, faithful pads, padding, GQA 2") {
    run_random<float>(3, 2, 2, 300, 32, 8, 128, 37, true, true, 1);
  }
  SECTION("f32, exclude pads, padding, GQA 2") {
    run_random<float>(3, 2, 2, 300, 32, 8, 128, 37, false, true, 2);
  }
  SECTION("bf16, faithful pads, no mask, sound redundancy") {
    run_random<bf16_t>(2, 2, 4, 260, 64, 8, 100, 0, true, false, 3);
  }
  SECTION("bf16, exclude pads, padding") {
    run_random<bf16_t>(2, 2, 4, 260, 64, 8, 100, 50, false, false, 4);
  }
  SECTION("f16, faithful pads, more pads than budget − W in sequence 1") {
    run_random<f16_t>(2, 2, 3, 200, 16, 5, 60, 90, true, true, 5);
  }
  SECTION("f16, exclude pads, fewer real tokens than the budget in sequence 1") {
    run_random<f16_t>(2, 2, 3, 200, 16, 5, 60, 150, false, true, 6);
  }
  SECTION("f32, several tiles and > 256 ranges in one row, both pad modes") {
    run_random<float>(2, 2, 1, 1500, 16, 8, 500, 300, true, false, 7, true);
    run_random<float>(2, 2, 1, 1500, 16, 8, 500, 300, false, false, 8, true);
  }
}

TEST_CASE("cuda SkipKV at or below the budget keeps everything, pads included", "[cuda][skipkv]") {
  for (bool faithful : {true, false})
    for (std::int64_t S : {90, 100}) {
      INFO("S = " << S << (faithful ? " faithful" : " exclude"));
      std::mt19937 rng(11);
      std::vector<std::uint8_t> mask(2 * static_cast<std::size_t>(S), 1);
      for (std::int64_t j = 0; j < 20; ++j) mask[S + j] = 0;
      Case<bf16_t> c(2, 2, 4, S, 16, 8, make_keys(2, 2, S, 16, rng),
                     normal_values(2 * 4 * 8 * 16, rng), mask);
      SentenceScorerConfig cfg;
      cfg.rkv.budget = 100;
      cfg.pad_mode = faithful ? PadMode::faithful : PadMode::exclude;
      const GpuRun r = run_gpu(c, cfg, random_penalties(2, 2, S, 8, rng, false));
      CHECK_FALSE(r.compressed);
      CHECK(r.plan.keeps_everything());
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t h = 0; h < 2; ++h)
          for (std::int64_t i = 0; i < S; ++i) CHECK(r.plan.row(b, h)[i] == i);
    }
}

TEST_CASE("cuda SkipKV rejects bad penalties and calls with messages naming the values",
          "[cuda][skipkv][errors]") {
  std::mt19937 rng(21);
  Case<float> c(2, 2, 4, 64, 8, 8, make_keys(2, 2, 64, 8, rng), normal_values(2 * 4 * 8 * 8, rng),
                {});
  SentenceScorerConfig cfg;
  cfg.rkv.budget = 32;
  const KVCacheView kv = c.dev_kv();
  DeviceBuffer<float> score(2 * 2 * 56);
  DeviceBuffer<std::int32_t> slots(2 * 2 * 32);
  const std::size_t bytes = cuda::skipkv_workspace_bytes(kv, c.dev_q(), cfg);
  DeviceBuffer<char> ws(bytes);
  cuda::RKVScoreOutputs out;
  out.score = score.get();
  std::vector<std::vector<PenaltyRange>> pen(4);

  SECTION("penalty lists for (b, h) the cache does not have") {
    pen.resize(5);
    REQUIRE_THROWS_WITH(
        cuda::build_penalty_csr(pen, 2, 2),
        Catch::Matchers::Contains("penalties has 5 lists, expected 0 or batch * kv_heads = 2 * 2"));
  }
  SECTION("lo > hi") {
    pen[2] = {{1, 4, 0.9f}, {7, 3, 0.96f}};
    REQUIRE_THROWS_WITH(cuda::build_penalty_csr(pen, 2, 2),
                        Catch::Matchers::Contains("range 1 [7, 3] of (b=1, h=0)"));
  }
  SECTION("negative lo") {
    pen[1] = {{-2, 3, 0.96f}};
    REQUIRE_THROWS_WITH(cuda::build_penalty_csr(pen, 2, 2),
                        Catch::Matchers::Contains("range 0 [-2, 3] of (b=0, h=1)"));
  }
  SECTION("NaN and infinite λ") {
    pen[3] = {{1, 5, NAN}};
    REQUIRE_THROWS_WITH(
        cuda::build_penalty_csr(pen, 2, 2),
        Catch::Matchers::Contains("range 0 [1, 5] of (b=1, h=1) has non-finite lambda"));
    pen[3] = {{1, 5, INFINITY}};
    REQUIRE_THROWS_WITH(cuda::build_penalty_csr(pen, 2, 2),
                        Catch::Matchers::Contains("non-finite lambda inf"));
  }
  SECTION("penalties built for another cache shape") {
    std::vector<std::vector<PenaltyRange>> other(2);
    other[0] = {{1, 5, 0.97f}};
    const cuda::SentencePenaltyCsr csr = cuda::build_penalty_csr(other, 1, 2);
    DeviceBuffer<char> pws(cuda::sentence_penalty_workspace_bytes(csr));
    const cuda::SentencePenaltiesDevice d =
        cuda::upload_sentence_penalties(csr, pws.get(), pws.size(), nullptr);
    REQUIRE_THROWS_WITH(
        cuda::skipkv_score(kv, c.dev_q(), cfg, d, out, ws.get(), ws.size(), nullptr),
        Catch::Matchers::Contains(
            "penalties were built for batch=1, kv_heads=2 but the cache has batch=2, kv_heads=2"));
    REQUIRE_THROWS_WITH(cuda::upload_sentence_penalties(csr, pws.get(), 100, nullptr),
                        Catch::Matchers::Contains(
                            "upload_sentence_penalties: workspace of 100 bytes is too small"));
  }
  SECTION("a CSR edited out of shape") {
    pen[0] = {{1, 5, 0.97f}};
    cuda::SentencePenaltyCsr csr = cuda::build_penalty_csr(pen, 2, 2);
    csr.indptr.pop_back();
    REQUIRE_THROWS_WITH(cuda::sentence_penalty_workspace_bytes(csr),
                        Catch::Matchers::Contains("indptr has 4 entries, expected"));
  }
  SECTION("workspace too small") {
    REQUIRE_THROWS_WITH(
        cuda::skipkv_select(kv, c.dev_q(), cfg, {}, slots.get(), nullptr, ws.get(), 1000, nullptr),
        Catch::Matchers::Contains("skipkv_select: workspace of 1000 bytes is too small"));
  }
  SECTION("null outputs, host cache, a sequence no longer than the window, gqa mean") {
    REQUIRE_THROWS_WITH(
        cuda::skipkv_score(kv, c.dev_q(), cfg, {}, {}, ws.get(), ws.size(), nullptr),
        Catch::Matchers::Contains("out.score must be a device pointer"));
    REQUIRE_THROWS_WITH(
        cuda::skipkv_select(kv, c.dev_q(), cfg, {}, nullptr, nullptr, ws.get(), ws.size(), nullptr),
        Catch::Matchers::Contains("slots must be a device pointer"));
    REQUIRE_THROWS_WITH(cuda::skipkv_workspace_bytes(c.host_kv(), c.dev_q(), cfg),
                        Catch::Matchers::Contains("the cache is in host memory"));
    cfg.rkv.gqa = GqaReduce::mean;
    REQUIRE_THROWS_WITH(
        cuda::skipkv_score(kv, c.dev_q(), cfg, {}, out, ws.get(), ws.size(), nullptr),
        Catch::Matchers::Contains("RKVConfig.gqa = mean is not supported by the CUDA backend"));
    cfg.rkv.gqa = GqaReduce::max;
    c.dev_lengths[1] = 8;
    REQUIRE_THROWS_WITH(
        cuda::skipkv_score(c.dev_kv(), c.dev_q(), cfg, {}, out, ws.get(), ws.size(), nullptr),
        Catch::Matchers::Contains("lengths[1] (8) must exceed the window (8)"));
  }
  SECTION("bad config") {
    cfg.rkv.budget = 8;
    REQUIRE_THROWS_WITH(cfg.validate(),
                        Catch::Matchers::Contains("budget (8) must exceed window + sink (8 + 0)"));
  }
}
