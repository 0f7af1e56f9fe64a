// SegmentEvictor (ThinKV TBE, docs/algorithms.md §3.3): hand-built segment sequences pin segmenting,
// the retention schedule and its floor, Rule 1, Rule 2 (lowest ρ, then oldest), prompt
// protection, termination, and the per-(layer, head) k-means survivors as a KeepPlan and marks.
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/policy/thinkv/segment_evictor.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {
constexpr ThoughtType R = ThoughtType::reasoning;
constexpr ThoughtType E = ThoughtType::execution;
constexpr ThoughtType T = ThoughtType::transition;

// Appends `n` tokens labelled `type`; returns the steps that evicted something.
std::vector<EvictionStep> feed(SegmentEvictor& ev, ThoughtType type, int n) {
  std::vector<EvictionStep> evicting;
  for (int i = 0; i < n; ++i) {
    EvictionStep s = ev.append_token(type);
    REQUIRE(s.cache_after <= s.cache_before);
    if (s.evicted()) evicting.push_back(s);
  }
  return evicting;
}

SegmentEvictorConfig config_with_budget(int budget) {
  SegmentEvictorConfig c;
  c.budget = budget;
  return c;
}

using Event = std::tuple<int, int, int>;  // (segment, kept before, kept after)
std::vector<Event> events(const std::vector<EvictionStep>& steps) {
  std::vector<Event> out;
  for (const auto& s : steps) {
    for (const auto& c : s.changes) out.emplace_back(c.segment, c.kept_before, c.kept_after);
  }
  return out;
}

std::int32_t sum_kept(const SegmentEvictor& ev) {
  std::int32_t n = 0;
  for (const auto& s : ev.segments()) n += s.kept;
  return n;
}
}  // namespace

TEST_CASE("SegmentEvictorConfig rejects bad schedules and sizes", "[evictor][errors]") {
  SegmentEvictorConfig c;
  REQUIRE_NOTHROW(c.validate());
  c.schedule = {};
  REQUIRE_THROWS_WITH(c.validate(), Contains("schedule is empty"));
  c.schedule = {64, 64, 16};
  REQUIRE_THROWS_WITH(c.validate(), Contains("schedule[0] = 64 and schedule[1] = 64"));
  c.schedule = {32, 64};
  REQUIRE_THROWS_WITH(c.validate(), Contains("strictly decrease"));
  c.schedule = {64, 32, 2};
  REQUIRE_THROWS_WITH(c.validate(), Contains("schedule[2] = 2 is below the floor of 4"));
  c.schedule = {-8};
  REQUIRE_THROWS_WITH(c.validate(), Contains("schedule[0] = -8"));
  c = SegmentEvictorConfig{};
  c.budget = 0;
  REQUIRE_THROWS_WITH(c.validate(), Contains("budget must be > 0, got 0"));
  c = SegmentEvictorConfig{};
  c.segment_length = -3;
  REQUIRE_THROWS_WITH(c.validate(), Contains("segment_length must be > 0, got -3"));
  REQUIRE_THROWS_WITH(SegmentEvictor(c, 10), Contains("segment_length"));
  REQUIRE_THROWS_WITH(SegmentEvictor(SegmentEvictorConfig{}, -1), Contains("prompt_length"));
}

TEST_CASE("retention schedule: min(|S|, R[n-1]), never below the floor of 4", "[evictor]") {
  const SegmentEvictor ev(SegmentEvictorConfig{}, 0);
  const std::vector<int> full{128, 64, 32, 16, 8, 4, 4, 4};
  for (int n = 0; n < 8; ++n) CHECK(ev.retained(128, n) == full[n]);
  const std::vector<int> twenty{20, 20, 20, 16, 8, 4, 4};
  for (int n = 0; n < 7; ++n) CHECK(ev.retained(20, n) == twenty[n]);
  CHECK(ev.retained(3, 9) == 3);  // a segment shorter than the floor keeps itself
  SegmentEvictorConfig c;
  c.schedule = {50, 10};
  const SegmentEvictor short_schedule(c, 0);
  CHECK(short_schedule.retained(128, 1) == 50);
  CHECK(short_schedule.retained(128, 2) == 10);
  CHECK(short_schedule.retained(128, 6) == 10);  // past the end: the last entry
}

TEST_CASE("segments: prompt is segment 0, then one per 128 decode tokens typed at opening",
          "[evictor]") {
  SegmentEvictor ev(config_with_budget(1 << 20), 10);
  feed(ev, R, 100);
  feed(ev, E, 28);  // still segment 1: the type is fixed when a segment opens
  feed(ev, E, 130);
  const auto& s = ev.segments();
  REQUIRE(s.size() == 4);
  CHECK(s[0].is_prompt);
  CHECK(s[0].length == 10);
  CHECK(s[1].type == R);
  CHECK(s[1].start == 10);
  CHECK(s[1].length == 128);
  CHECK(s[2].type == E);
  CHECK(s[2].start == 138);
  CHECK(s[3].start == 266);
  CHECK(s[3].length == 2);
  CHECK(ev.cache_length() == 268);
  CHECK(ev.steps() == 258);
}

TEST_CASE("Rule 1: a new T segment demotes every earlier segment once (R, E, R, T)", "[evictor]") {
  SegmentEvictor ev(config_with_budget(1 << 20), 10);
  REQUIRE(feed(ev, R, 128).empty());
  REQUIRE(feed(ev, E, 128).empty());
  REQUIRE(feed(ev, R, 128).empty());
  const EvictionStep t = ev.append_token(T);
  CHECK(t.opened_segment);
  CHECK(t.rule1);
  CHECK(t.rule2_demotions == 0);
  CHECK(t.cache_before == 10 + 3 * 128 + 1);
  CHECK(t.cache_after == 10 + 3 * 64 + 1);
  REQUIRE(t.changes.size() == 3);
  const std::int32_t begins[] = {10, 138, 266};
  for (int i = 0; i < 3; ++i) {
    CHECK(t.changes[i].segment == i + 1);
    CHECK(t.changes[i].cache_begin == begins[i]);
    CHECK(t.changes[i].kept_before == 128);
    CHECK(t.changes[i].kept_after == 64);
  }
  CHECK(ev.segments()[0].kept == 10);  // prompt protected
  CHECK(ev.segments()[0].demotions == 0);

  // Closing the T segment and opening an R one is not a transition: nothing happens.
  REQUIRE(feed(ev, T, 127).empty());
  REQUIRE(feed(ev, R, 128).empty());
  // The next T demotes segments 1-3 a second time (64 -> 32) and the T and R ones once.
  const EvictionStep t2 = ev.append_token(T);
  CHECK(events({t2}) ==
        std::vector<Event>{{1, 64, 32}, {2, 64, 32}, {3, 64, 32}, {4, 128, 64}, {5, 128, 64}});
  CHECK(t2.changes[3].cache_begin == 10 + 3 * 64);
  CHECK(ev.cache_length() == sum_kept(ev));
}

TEST_CASE("Rule 2: over budget demotes E before R, oldest first, down to the floor", "[evictor]") {
  SegmentEvictor ev(config_with_budget(300), 10);
  REQUIRE(feed(ev, R, 128).empty());  // segment 1
  REQUIRE(feed(ev, E, 128).empty());  // segment 2, cache 266
  REQUIRE(feed(ev, R, 34).empty());   // segment 3 (open), cache 300 = budget: nothing yet
  const EvictionStep first = ev.append_token(R);
  CHECK(first.cache_before == 301);
  CHECK(first.rule2_demotions == 1);
  CHECK_FALSE(first.rule1);
  REQUIRE(first.changes.size() == 1);
  CHECK(first.changes[0].segment == 2);
  CHECK(first.changes[0].cache_begin == 138);
  CHECK(first.cache_after == 237);

  const auto later = feed(ev, R, 1000);
  auto ev_list = events(later);
  ev_list.resize(8);
  // E goes all the way down first; then the oldest R (segment 1), although segment 3 (R) closed
  // meanwhile.
  CHECK(ev_list == std::vector<Event>{{2, 64, 32},
                                      {2, 32, 16},
                                      {2, 16, 8},
                                      {2, 8, 4},
                                      {1, 128, 64},
                                      {1, 64, 32},
                                      {1, 32, 16},
                                      {1, 16, 8}});
  for (const auto& s : later) {
    CHECK(s.cache_after <= 300);
    CHECK_FALSE(s.over_budget);
  }
  CHECK(ev.cache_length() == sum_kept(ev));
}

TEST_CASE("Rule 2 takes the oldest of equally important segments, and T before E", "[evictor]") {
  SECTION("two E segments: the older one first") {
    SegmentEvictor ev(config_with_budget(400), 0);
    feed(ev, E, 128);
    feed(ev, E, 128);
    feed(ev, R, 144);  // segment 3 closed at 384, segment 4 open with 16: cache 400
    const EvictionStep s = ev.append_token(R);
    CHECK(events({s}) == std::vector<Event>{{1, 128, 64}});
  }
  SECTION("a T segment (ρ = 0) goes before an E segment (ρ = 1)") {
    SegmentEvictor ev(config_with_budget(330), 0);
    feed(ev, E, 128);
    const EvictionStep rule1 = ev.append_token(T);  // segment 2 is T: segment 1 -> 64
    CHECK(events({rule1}) == std::vector<Event>{{1, 128, 64}});
    feed(ev, T, 127);
    feed(ev, R, 138);  // cache 64 + 128 + 138 = 330
    const EvictionStep s = ev.append_token(R);
    CHECK(events({s}) == std::vector<Event>{{2, 128, 64}});
  }
}

TEST_CASE("Rule 2 stops when every candidate is at the floor and reports over budget",
          "[evictor]") {
  SegmentEvictor ev(config_with_budget(20), 10);
  std::vector<EvictionStep> all;
  for (int i = 0; i < 128 * 6; ++i) all.push_back(ev.append_token(i < 300 ? E : R));
  const EvictionStep& last = all.back();
  CHECK(last.over_budget);
  CHECK(last.cache_after > 20);
  const auto& segs = ev.segments();
  CHECK(segs[0].kept == 10);  // the protected prompt never shrinks
  for (std::size_t i = 1; i + 1 < segs.size(); ++i) CHECK(segs[i].kept == 4);
  CHECK(ev.cache_length() == sum_kept(ev));
  // Segments are demoted one step at a time, never past the floor.
  for (const auto& s : all) {
    for (const auto& c : s.changes) CHECK(c.kept_after >= 4);
  }
}

TEST_CASE("evict_prompt lets Rule 1 and Rule 2 demote the prompt", "[evictor]") {
  SegmentEvictorConfig c = config_with_budget(250);
  c.evict_prompt = true;
  SegmentEvictor ev(c, 200);
  REQUIRE(feed(ev, R, 50).empty());
  const EvictionStep s = ev.append_token(R);  // 251: the prompt is the only closed segment
  CHECK(events({s}) == std::vector<Event>{{0, 200, 64}});

  SegmentEvictorConfig big = config_with_budget(1 << 20);
  big.evict_prompt = true;
  SegmentEvictor ev2(big, 100);
  feed(ev2, R, 128);
  const EvictionStep t = ev2.append_token(T);
  CHECK(events({t}) == std::vector<Event>{{0, 100, 64}, {1, 128, 64}});
}

TEST_CASE("EvictionCounter counts (layer, step) pairs with an eviction", "[evictor]") {
  EvictionCounter counter;
  CHECK(counter.fraction() == 0.0);
  SegmentEvictor ev(config_with_budget(1 << 20), 0);
  for (int i = 0; i < 128; ++i) counter.record_step(ev.append_token(R), 4);
  counter.record_step(ev.append_token(T), 4);  // Rule 1 evicts in all 4 layers
  CHECK(counter.total() == 129 * 4);
  CHECK(counter.evicting() == 4);
  CHECK(std::abs(counter.fraction() - 1.0 / 129) < 1e-12);
  REQUIRE_THROWS_WITH(counter.record_step(EvictionStep{}, 0), Contains("layers must be > 0"));
}

namespace {
// A cache whose segment 1 (slots 4..131) has 64 distinct key locations, each used twice: head 0
// pairs slots (4 + 2i, 5 + 2i), head 1 pairs (4 + i, 68 + i). The k-means survivors are then one
// token per pair, the lower slot (seeding picks the first of equal points; ties go low).
template <class Elem>
std::vector<Elem> paired_keys(std::int64_t capacity, std::int64_t dim) {
  std::vector<Elem> keys(2 * capacity * dim, from_float<Elem>(0.0f));
  auto put = [&](std::int64_t h, std::int64_t slot, int pair) {
    keys[(h * capacity + slot) * dim + 0] = from_float<Elem>(static_cast<float>(pair * 8));
    keys[(h * capacity + slot) * dim + 1] = from_float<Elem>(static_cast<float>((pair % 5) * 16));
  };
  for (int i = 0; i < 64; ++i) {
    put(0, 4 + 2 * i, i);
    put(0, 5 + 2 * i, i);
    put(1, 4 + i, i);
    put(1, 68 + i, i);
  }
  return keys;
}

template <class Elem>
void check_plan_on_paired_cache() {
  const std::int64_t capacity = 140, dim = 2;
  SegmentEvictor ev(config_with_budget(1 << 20), 4);
  feed(ev, R, 128);
  const EvictionStep step = ev.append_token(T);
  REQUIRE(events({step}) == std::vector<Event>{{1, 128, 64}});

  std::vector<Elem> keys = paired_keys<Elem>(capacity, dim);
  std::vector<Elem> values(keys.size());
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = from_float<Elem>(float(i % 97));
  std::int32_t length = step.cache_before;
  const KVCacheView kv = make_kv_cache_view(keys.data(), values.data(), dtype_of<Elem>::value,
                                            Device::cpu, 1, 2, capacity, dim, &length);
  const KeepPlan plan = plan_segment_eviction(kv, {step});
  REQUIRE_NOTHROW(plan.validate());
  REQUIRE(plan.kept_length(0) == 4 + 64 + 1);
  std::vector<std::int32_t> head0{0, 1, 2, 3}, head1{0, 1, 2, 3};
  for (int i = 0; i < 64; ++i) head0.push_back(4 + 2 * i);
  for (int i = 0; i < 64; ++i) head1.push_back(4 + i);
  head0.push_back(132);
  head1.push_back(132);
  CHECK(std::vector<std::int32_t>(plan.row(0, 0), plan.row(0, 0) + 69) == head0);
  CHECK(std::vector<std::int32_t>(plan.row(0, 1), plan.row(0, 1) + 69) == head1);

  const auto marks = segment_eviction_marks(kv, {step});
  REQUIRE(marks.size() == 2);
  std::vector<std::int32_t> evicted0, evicted1;
  for (int i = 0; i < 64; ++i) evicted0.push_back(5 + 2 * i);
  for (int i = 0; i < 64; ++i) evicted1.push_back(68 + i);
  CHECK(marks[0] == evicted0);
  CHECK(marks[1] == evicted1);

  compact(kv, plan);
  CHECK(length == step.cache_after);
}
}  // namespace

TEST_CASE("plan_segment_eviction keeps k-means survivors per KV head", "[evictor][plan]") {
  check_plan_on_paired_cache<float>();
  check_plan_on_paired_cache<f16_t>();
  check_plan_on_paired_cache<bf16_t>();
}

TEST_CASE("plan_segment_eviction rejects a step made for another cache", "[evictor][errors]") {
  SegmentEvictor ev(config_with_budget(1 << 20), 4);
  feed(ev, R, 128);
  const EvictionStep step = ev.append_token(T);
  std::vector<float> keys(1 * 1 * 200 * 2), values(keys.size());
  std::int32_t length = 120;
  const KVCacheView kv = make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, 1,
                                            1, 200, 2, &length);
  REQUIRE_THROWS_WITH(plan_segment_eviction(kv, {step}),
                      Contains("holds 120 tokens") && Contains("made for 133"));
  REQUIRE_THROWS_WITH(plan_segment_eviction(kv, {}), Contains("0 eviction steps for a batch of 1"));
  length = 133;
  std::vector<std::uint8_t> mask(200, 1);
  mask[10] = 0;  // a pad inside the demoted segment
  KVCacheView padded = kv;
  padded.valid_mask = mask.data();
  REQUIRE_THROWS_WITH(plan_segment_eviction(padded, {step}), Contains("slot 10 is a pad"));
}

TEST_CASE("segment_eviction_marks for one paged segment returns evicted positions",
          "[evictor][marks]") {
  // 1-D keys 0, 1, 2, 10, 11, 20 at positions 500..505; keep 4 -> seeds 0 (500), 20 (505),
  // 10 (503), then 2 (502)... Lloyd: clusters {0,1}, {2}, {10,11}, {20}: survivors 500 (tie
  // 0/1 -> lower), 502, 503 (tie 10/11 -> lower), 505; evicted 501, 504.
  const std::vector<float> keys{0, 1, 2, 10, 11, 20};
  const std::vector<std::int32_t> pos{500, 501, 502, 503, 504, 505};
  CHECK(segment_eviction_marks(keys.data(), pos.data(), 6, 1, 4) ==
        std::vector<std::int32_t>{501, 504});
  REQUIRE_THROWS_WITH(segment_eviction_marks(keys.data(), pos.data(), 6, 1, 3),
                      Contains("below the floor"));
}

TEST_CASE("Rule 2 waits for the step after Rule 1 (\"otherwise\", §3.3)", "[evictor]") {
  // Budget 10 with a 4-token prompt: the open 16-token R segment cannot be demoted, so the cache
  // is over budget when a T segment opens. That step applies Rule 1 only (R: 16 -> 12); Rule 2
  // trims R to the floor on the next step.
  SegmentEvictorConfig c;
  c.segment_length = 16;
  c.schedule = {12, 8, 4};
  c.budget = 10;
  SegmentEvictor ev(c, 4);
  feed(ev, R, 16);
  const EvictionStep t = ev.append_token(T);
  CHECK(t.opened_segment);
  CHECK(t.rule1);
  CHECK(t.rule2_demotions == 0);
  CHECK(t.cache_after == 4 + 12 + 1);
  const EvictionStep next = ev.append_token(T);
  CHECK_FALSE(next.rule1);
  CHECK(next.rule2_demotions == 2);  // 12 -> 8 -> 4: the floor
  CHECK(next.cache_after == 4 + 4 + 2);
  CHECK(ev.segments()[1].kept == 4);
}
