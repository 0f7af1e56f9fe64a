// SentenceTracker (docs/algorithms.md §2.1-2.2): segmentation and check labels on hand streams and on
// the real MATH-500 token file, embeddings against a two-pass oracle, redundancy marks on
// hand-placed embeddings, the golden sentence-penalty case, and the error paths.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/policy/skipkv/sentence_tracker.hpp"

using namespace kvsift;

namespace {
// A small vocabulary for hand streams: 1 and 2 end sentences, 7 is a keyword.
SentenceTrackerConfig toy_config(std::int64_t hidden = 0, float tau = 0.95f) {
  SentenceTrackerConfig c;
  c.tokens = SentenceTokens{{1, 2}, {7}};
  c.hidden_size = hidden;
  c.tau = tau;
  return c;
}

// Independent count: split the stream into runs ending at a delimiter (std::find_first_of) and
// test each run for a keyword.
void scan_count(const std::vector<std::int32_t>& ids, const SentenceTokens& tok, long& sentences,
                long& checks) {
  sentences = checks = 0;
  auto it = ids.begin();
  while (true) {
    auto d = std::find_first_of(it, ids.end(), tok.delimiters.begin(), tok.delimiters.end());
    if (d == ids.end()) break;
    ++sentences;
    if (std::find_first_of(it, d, tok.keywords.begin(), tok.keywords.end()) != d) ++checks;
    it = d + 1;
  }
}

std::vector<std::int32_t> parse_ids(const std::string& text) {
  std::istringstream is(text);
  std::vector<std::int32_t> out;
  long v;
  while (is >> v) out.push_back(static_cast<std::int32_t>(v));
  REQUIRE(is.eof());  // the whole field was numbers
  return out;
}
}  // namespace

TEST_CASE("sentences close at delimiters, count pads, and carry check labels", "[sentences]") {
  SentenceTracker t(toy_config());
  t.add_padding(3);
  // positions: 3 4 5 | 6 7 8 9 | 10 11 | 12 (open)
  t.observe({5, 6, 1, 7, 4, 4, 2, 9, 2, 8});
  REQUIRE(t.position() == 13);
  REQUIRE(t.padding() == 3);
  REQUIRE(t.num_sentences() == 3);
  const auto& s = t.sentences();
  CHECK(s[0].start == 3);
  CHECK(s[0].end == 5);
  CHECK_FALSE(s[0].check);
  CHECK(s[1].start == 6);
  CHECK(s[1].end == 9);
  CHECK(s[1].check);
  CHECK(s[2].start == 10);
  CHECK(s[2].end == 11);
  CHECK_FALSE(s[2].check);
  CHECK(t.check_count() == 1);
  CHECK(t.open_start() == 12);
  CHECK_FALSE(s[0].redundant());
  // The open sentence continues across observe() calls (prompt, then decode steps).
  t.observe({7});
  t.observe({1});
  REQUIRE(t.num_sentences() == 4);
  CHECK(t.sentences()[3].start == 12);
  CHECK(t.sentences()[3].end == 14);
  CHECK(t.sentences()[3].check);
  CHECK(t.check_count() == 2);
  // A delimiter right after a delimiter is a one-token sentence.
  t.observe({2});
  CHECK(t.sentences()[4].start == 15);
  CHECK(t.sentences()[4].end == 15);
}

TEST_CASE("the R1 presets hold the ids of the data README", "[sentences]") {
  const auto q = SentenceTokens::r1_qwen();
  CHECK(q.delimiters == std::vector<std::int32_t>{198, 624, 340, 271, 382, 692, 1939});
  CHECK(q.keywords == std::vector<std::int32_t>{92014, 14190, 32771});
  const auto l = SentenceTokens::r1_llama();
  CHECK(l.delimiters == std::vector<std::int32_t>{198, 627, 340, 271, 382, 696, 1980});
  CHECK(l.keywords == std::vector<std::int32_t>{93114, 14524, 33871});
  q.validate();
  l.validate();
}

TEST_CASE("real MATH-500 token streams segment like a direct scan", "[sentences][data]") {
  std::ifstream in(std::string(KVSIFT_DATA_DIR) + "/math500_r1qwen_tokens.tsv");
  REQUIRE(in.good());
  const SentenceTokens tok = SentenceTokens::r1_qwen();
  std::string line;
  long lines = 0, total_sentences = 0, total_tokens = 0;
  while (std::getline(in, line)) {
    const auto tab = line.find('\t');
    REQUIRE(tab != std::string::npos);
    const auto prompt = parse_ids(line.substr(0, tab));
    const auto solution = parse_ids(line.substr(tab + 1));
    REQUIRE(!prompt.empty());
    REQUIRE(!solution.empty());
    SentenceTracker t(SentenceTrackerConfig{tok, 0, 0.95f});
    t.observe(prompt);  // prompt sentences count (§2.1)
    t.observe(solution);
    std::vector<std::int32_t> all = prompt;
    all.insert(all.end(), solution.begin(), solution.end());
    long sentences = 0, checks = 0;
    scan_count(all, tok, sentences, checks);
    INFO("problem " << lines);
    REQUIRE(t.num_sentences() == sentences);
    REQUIRE(t.check_count() == checks);
    REQUIRE(t.position() == static_cast<std::int64_t>(all.size()));
    // Spans tile the stream up to the open sentence.
    std::int64_t next = 0;
    for (const Sentence& s : t.sentences()) {
      REQUIRE(s.start == next);
      REQUIRE(s.end >= s.start);
      next = s.end + 1;
    }
    REQUIRE(t.open_start() == next);
    total_sentences += t.num_sentences();
    total_tokens += t.position();
    ++lines;
  }
  CHECK(lines == 500);
  // Counted independently (a Python scan of the file with the same delimiter set).
  CHECK(total_sentences == 2273);
  // The first problems, also from that scan: prompt + solution sentences.
  std::ifstream again(std::string(KVSIFT_DATA_DIR) + "/math500_r1qwen_tokens.tsv");
  const long expected_first[3] = {4, 6, 3};
  for (long expected : expected_first) {
    std::getline(again, line);
    const auto tab = line.find('\t');
    SentenceTracker t(SentenceTrackerConfig{tok, 0, 0.95f});
    t.observe(parse_ids(line.substr(0, tab)));
    t.observe(parse_ids(line.substr(tab + 1)));
    CHECK(t.num_sentences() == expected);
  }
}

TEST_CASE("sentence embeddings are the normalized mean hidden state, any dtype or stride",
          "[sentences][embedding]") {
  const int H = 5;
  const std::vector<std::int32_t> tokens = {3, 4, 1, 5, 2};  // sentences [0,2] and [3,4]
  std::vector<float> hidden(tokens.size() * H);
  for (std::size_t i = 0; i < hidden.size(); ++i) {
    hidden[i] = std::sin(0.7f * static_cast<float>(i)) * (1.0f + static_cast<float>(i % 3));
  }
  // Oracle: two-pass mean, then divide by the norm plus 1e-8.
  auto oracle = [&](int first, int last, std::vector<double>& out) {
    out.assign(H, 0.0);
    for (int t = first; t <= last; ++t)
      for (int k = 0; k < H; ++k) out[k] += hidden[t * H + k];
    double n2 = 0;
    for (int k = 0; k < H; ++k) {
      out[k] /= (last - first + 1);
      n2 += out[k] * out[k];
    }
    for (int k = 0; k < H; ++k) out[k] /= std::sqrt(n2) + 1e-8;
  };
  std::vector<double> e0, e1;
  oracle(0, 2, e0);
  oracle(3, 4, e1);

  SentenceTracker f32(toy_config(H));
  f32.observe(tokens.data(), 5, hidden.data(), DType::f32);
  REQUIRE(f32.num_sentences() == 2);
  for (int k = 0; k < H; ++k) {
    CHECK(std::fabs(f32.embedding(0)[k] - (e0[k])) <= 1e-6);
    CHECK(std::fabs(f32.embedding(1)[k] - (e1[k])) <= 1e-6);
  }

  // The same states as bf16 in a transposed ([hidden, tokens] storage) strided view, fed one
  // token at a time: equal to the f32 result within bf16 rounding.
  std::vector<bf16_t> tr(tokens.size() * H);
  for (std::size_t t = 0; t < tokens.size(); ++t)
    for (int k = 0; k < H; ++k) tr[k * tokens.size() + t] = from_float<bf16_t>(hidden[t * H + k]);
  SentenceTracker bf(toy_config(H));
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    TensorView v;
    v.data = tr.data() + t;
    v.dtype = DType::bf16;
    v.rank = 2;
    v.shape = {1, H, 0, 0};
    v.stride = {1, static_cast<std::int64_t>(tokens.size()), 0, 0};
    bf.observe(&tokens[t], 1, v);
  }
  for (int k = 0; k < H; ++k) {
    CHECK(std::fabs(bf.embedding(0)[k] - (e0[k])) <= 1e-2);
    CHECK(std::fabs(bf.embedding(1)[k] - (e1[k])) <= 1e-2);
  }

  // batch_row picks sequence 1 of a [2, 5, H] batch.
  std::vector<float> batch(2 * tokens.size() * H, 100.0f);
  std::copy(hidden.begin(), hidden.end(), batch.begin() + tokens.size() * H);
  auto bv = TensorView::contiguous(batch.data(), DType::f32, Device::cpu,
                                   {2, static_cast<std::int64_t>(tokens.size()), H});
  SentenceTracker row(toy_config(H));
  row.observe(tokens.data(), 5, batch_row(bv, 1));
  for (int k = 0; k < H; ++k) CHECK(std::fabs(row.embedding(1)[k] - (e1[k])) <= 1e-6);
}

namespace {
// Feeds one sentence of `len` tokens whose mean hidden state is `dir` (2-D, padded to H = 4)
// times 3: the tokens get dir*3 ± a perturbation that cancels in the mean.
void feed_sentence(SentenceTracker& t, double x, double y, int len = 3, bool check = false) {
  const int H = 4;
  std::vector<float> h(len * H);
  std::vector<std::int32_t> ids(len, 5);
  if (check) ids[0] = 7;
  ids[len - 1] = 1;
  for (int i = 0; i < len; ++i) {
    const float pert = (len % 2 == 1 && i == len - 1) ? 0.0f : (i % 2 == 0 ? 0.5f : -0.5f);
    h[i * H + 0] = static_cast<float>(3 * x) + pert;
    h[i * H + 1] = static_cast<float>(3 * y) - pert;
    h[i * H + 2] = pert;
    h[i * H + 3] = -pert;
  }
  t.observe(ids.data(), len, h.data(), DType::f32);
}
}  // namespace

TEST_CASE("triggers mark the earlier sentence; the last comparison written wins", "[redundancy]") {
  // A = e1, B = e2, C at cos 0.99 to A, D at cos 0.97 to A on the other side; C·D ≈ 0.926.
  const double a = std::acos(0.99), d = std::acos(0.97);
  SECTION("one trigger over four new sentences") {
    SentenceTracker t(toy_config(4));
    feed_sentence(t, 1, 0);
    feed_sentence(t, 0, 1);
    feed_sentence(t, std::cos(a), std::sin(a));
    feed_sentence(t, std::cos(d), -std::sin(d), 2);
    REQUIRE(t.pending_count() == 4);
    const auto marks = t.mark_redundant();
    REQUIRE(marks.size() == 2);
    CHECK(marks[0].earlier == 0);
    CHECK(marks[0].later == 2);
    CHECK(std::fabs(marks[0].pss - (0.99)) <= 1e-5);
    CHECK(marks[1].earlier == 0);
    CHECK(marks[1].later == 3);
    CHECK(std::fabs(t.sentences()[0].lambda - (0.97)) <= 1e-5);  // j = 3 written last
    CHECK_FALSE(t.sentences()[1].redundant());
    CHECK_FALSE(t.sentences()[2].redundant());  // C·D ≈ 0.926 < τ
    CHECK_FALSE(t.sentences()[3].redundant());  // the latest sentence is always kept
    CHECK(t.redundant_count() == 1);
    CHECK(t.pending_count() == 0);
    CHECK(t.mark_redundant().empty());  // nothing new: nothing compared again
  }
  SECTION("marks accumulate across triggers") {
    SentenceTracker t(toy_config(4));
    feed_sentence(t, 1, 0);
    feed_sentence(t, 0, 1);
    REQUIRE(t.mark_redundant().empty());
    feed_sentence(t, std::cos(a), std::sin(a));
    REQUIRE(t.mark_redundant().size() == 1);
    CHECK(std::fabs(t.sentences()[0].lambda - (0.99)) <= 1e-5);
    feed_sentence(t, 0.6, 0.8);  // matches nothing: earlier marks stay
    REQUIRE(t.mark_redundant().empty());
    CHECK(std::fabs(t.sentences()[0].lambda - (0.99)) <= 1e-5);
    feed_sentence(t, std::sin(0.01), std::cos(0.01));  // repeats B
    const auto m = t.mark_redundant();
    REQUIRE(m.size() == 1);  // cos(B, new) = cos 0.01; cos(0.6/0.8, new) ≈ 0.81
    CHECK(m[0].earlier == 1);
    CHECK(std::fabs(t.sentences()[1].lambda - (std::cos(0.01))) <= 1e-5);
    CHECK(t.redundant_count() == 2);
  }
  SECTION("a threshold of 0.98 keeps the 0.97 match unmarked") {
    SentenceTracker t(toy_config(4, 0.98f));
    feed_sentence(t, 1, 0);
    feed_sentence(t, std::cos(a), std::sin(a));
    feed_sentence(t, std::cos(d), -std::sin(d));
    t.mark_redundant();
    CHECK(std::fabs(t.sentences()[0].lambda - (0.99)) <= 1e-5);
  }
  SECTION("segmentation-only trackers find no redundancy") {
    SentenceTracker t(toy_config(0));
    t.observe({5, 1, 5, 1});
    CHECK(t.mark_redundant().empty());
    CHECK(t.pending_count() == 0);
  }
}

TEST_CASE("external marks: set, cleared with -1, unknown spans rejected", "[redundancy]") {
  SentenceTracker t(toy_config());
  t.observe({5, 5, 1, 5, 2, 5});  // [0,2] [3,4], open from 5
  t.set_mark(3, 4, 0.96f);
  CHECK(t.sentences()[1].lambda == 0.96f);
  t.set_mark(3, 4, -1.0f);
  CHECK_FALSE(t.sentences()[1].redundant());
  REQUIRE_THROWS_WITH(t.set_mark(3, 5, 0.9f),
                      Catch::Matchers::Contains("no closed sentence spans [3, 5]"));
  REQUIRE_THROWS_WITH(t.set_mark(5, 5, 0.9f),
                      Catch::Matchers::Contains("no closed sentence spans [5, 5]"));
  REQUIRE_THROWS_WITH(t.set_mark(0, 2, -0.5f), Catch::Matchers::Contains("lambda (-0.5)"));
  REQUIRE_THROWS_WITH(t.set_mark(0, 2, NAN), Catch::Matchers::Contains("lambda (nan)"));
  std::vector<SentenceTracker> batch(1, t);
  const float bad_batch[4] = {1, 0, 2, 0.97f};
  REQUIRE_THROWS_WITH(apply_sentence_marks(batch, bad_batch, 1),
                      Catch::Matchers::Contains("names sequence 1, there are 1"));
  const float ok[8] = {0, 0, 2, 0.97f, 0, 3, 4, -1};
  apply_sentence_marks(batch, ok, 2);
  CHECK(batch[0].sentences()[0].lambda == 0.97f);
  const float inf_row[4] = {0, 0, INFINITY, 0.97f};
  REQUIRE_THROWS_WITH(apply_sentence_marks(batch, inf_row, 1),
                      Catch::Matchers::Contains("has end inf"));
}

TEST_CASE("bad token sets, hidden sizes and padding order raise clear errors", "[errors]") {
  SentenceTrackerConfig c = toy_config();
  c.tokens.delimiters.clear();
  REQUIRE_THROWS_WITH(SentenceTracker(c), Catch::Matchers::Contains("delimiters is empty"));
  c = toy_config();
  c.tokens.keywords = {7, 2};
  REQUIRE_THROWS_WITH(SentenceTracker(c),
                      Catch::Matchers::Contains("token id 2 is both a delimiter and a keyword"));
  c = toy_config();
  c.tau = 1.5f;
  REQUIRE_THROWS_WITH(SentenceTracker(c), Catch::Matchers::Contains("tau (1.5)"));
  c = toy_config();
  c.hidden_size = -3;
  REQUIRE_THROWS_WITH(SentenceTracker(c), Catch::Matchers::Contains("hidden_size (-3)"));

  SentenceTracker t(toy_config(8));
  std::vector<float> h(2 * 6);
  const std::int32_t ids[2] = {5, 1};
  auto wrong = TensorView::contiguous(h.data(), DType::f32, Device::cpu, {2, 6});
  REQUIRE_THROWS_WITH(t.observe(ids, 2, wrong),
                      Catch::Matchers::Contains("hidden is [2, 6], expected [2, 8]"));
  REQUIRE_THROWS_WITH(t.observe(ids, 2), Catch::Matchers::Contains("hidden_size = 8"));
  REQUIRE(t.position() == 0);  // rejected input changed nothing
  SentenceTracker plain(toy_config(0));
  REQUIRE_THROWS_WITH(plain.observe(ids, 2, wrong),
                      Catch::Matchers::Contains("built with hidden_size = 0"));
  plain.observe(ids, 2);
  REQUIRE_THROWS_WITH(plain.add_padding(4), Catch::Matchers::Contains("2 tokens were already"));
  REQUIRE_THROWS_WITH(plain.embedding(0), Catch::Matchers::Contains("hidden_size = 0"));
  REQUIRE_THROWS_WITH(t.embedding(0), Catch::Matchers::Contains("sentence 0 outside [0, 0)"));
}

TEST_CASE("golden skipkv_sentences: marks + range map reproduce the reference penalty",
          "[golden]") {
  const auto f =
      SafetensorsFile::load(std::string(KVSIFT_GOLDEN_DIR) + "/skipkv_sentences.safetensors");
  const auto rows = f.get("sentences", {-1, 4}).to_f32();
  const auto importance = f.get("importance").to_f32();  // [B, Hkv, S - W]
  const auto redundancy = f.get("redundancy").to_f32();  // [B, Hkv, S - W]
  const auto score = f.get("score").to_f32();            // [B, Hkv, S - W]
  const auto valid = f.get("valid_mask").to_i64();       // [B, S]
  const std::int64_t B = 2, H = 2, S = 192, N = f.get("score").shape[2];
  REQUIRE(f.get("score").shape == std::vector<std::int64_t>{B, H, N});

  // Rebuild each sequence's stream: left pads from the mask, a delimiter at every golden end.
  std::vector<SentenceTracker> trackers;
  for (std::int64_t b = 0; b < B; ++b) {
    SentenceTracker t(toy_config());
    std::int64_t pads = 0;
    while (valid[b * S + pads] == 0) ++pads;
    t.add_padding(pads);
    std::vector<std::int32_t> ids(S - pads, 5);
    for (std::size_t r = 0; r < rows.size() / 4; ++r)
      if (rows[4 * r] == b) ids[static_cast<std::size_t>(rows[4 * r + 2]) - pads] = 1;
    t.observe(ids);
    trackers.push_back(t);
  }
  apply_sentence_marks(trackers, rows.data(), static_cast<std::int64_t>(rows.size() / 4));

  SegmentTable table(1, B, H);
  for (std::int64_t b = 0; b < B; ++b) {
    table.append_closed(0, b, trackers[b].sentences(), trackers[b].position(), S);
  }
  const float mix = 0.1f;  // config mix_lambda
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t base = (b * H + h) * N;
      std::vector<float> row(N);
      for (std::int64_t t = 0; t < N; ++t)
        row[t] = mix * importance[base + t] - (1 - mix) * redundancy[base + t];
      add_sentence_penalty(row.data(), N, S,
                           table.penalty_ranges(0, b, h, trackers[b].sentences()));
      for (std::int64_t t = 0; t < N; ++t) {
        if (valid[b * S + t] == 0) continue;  // pads: +100 in faithful mode, the scorer's job
        const float ref = score[base + t];
        INFO("b=" << b << " h=" << h << " t=" << t);
        REQUIRE(std::fabs(row[t] - ref) <= 1e-6f + 1e-4f * std::fabs(ref));
      }
    }
  }
}
