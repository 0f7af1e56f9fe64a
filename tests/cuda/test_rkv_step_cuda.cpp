// All layers of one compression step in one call (rkv_select_step, compact_device_rows_step)
// against the per-layer calls, which test_rkv_scoring_cuda.cpp and test_compact_cuda.cpp check
// against the CPU reference: the step must give bit-identical scores, slots and compacted caches,
// layer by layer, and refuse layers that do not agree.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/cuda/rkv_step.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

// One layer's device cache [B, H, S, D] and window queries [B, Hq, W, D] of storage type T.
template <class T>
struct Layer {
  DeviceBuffer<T> keys, values, queries;
  Layer(const std::vector<T>& k, const std::vector<T>& v, const std::vector<T>& q)
      : keys(k), values(v), queries(q) {}
};

template <class T>
std::vector<T> random_values(std::size_t n, float shared_every, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<T> out(n);
  // A direction shared by consecutive groups of 64 values (one head_dim row at D = 64) makes
  // some cosines pass the threshold, so the search has matches to find and spare.
  std::vector<float> common(64);
  for (auto& x : common) x = nd(rng);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = from_float<T>(nd(rng) + shared_every * common[i % 64]);
  return out;
}

// Bytes [first, last) of two host copies are identical (bf16_t has no operator==).
template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b, std::size_t first = 0,
                std::size_t last = SIZE_MAX) {
  last = std::min({last, a.size(), b.size()});
  return a.size() == b.size() &&
         std::memcmp(a.data() + first, b.data() + first, (last - first) * sizeof(T)) == 0;
}

struct Shape {
  int L = 3, B = 2, H = 2, G = 4, S = 300, D = 64, W = 8, budget = 128;
};
Shape with_batch(int batch) {
  Shape s;
  s.B = batch;
  return s;
}

template <class T>
struct Step {
  Shape s;
  std::vector<std::unique_ptr<Layer<T>>> layers;
  std::vector<std::int32_t> lengths;
  DeviceBuffer<std::uint8_t> mask;
  bool with_mask;

  Step(const Shape& shape, bool pads, std::uint32_t seed)
      : s(shape), lengths(shape.B, shape.S), mask(std::size_t(shape.B) * shape.S), with_mask(pads) {
    std::mt19937 rng(seed);
    const std::size_t cache = std::size_t(s.B) * s.H * s.S * s.D;
    const std::size_t q = std::size_t(s.B) * s.H * s.G * s.W * s.D;
    for (int l = 0; l < s.L; ++l)
      layers.push_back(std::make_unique<Layer<T>>(random_values<T>(cache, 1.2f, rng),
                                                  random_values<T>(cache, 0.0f, rng),
                                                  random_values<T>(q, 0.0f, rng)));
    std::vector<std::uint8_t> m(std::size_t(s.B) * s.S, 1);
    for (int b = 0; b < s.B; ++b)  // sequence b has 23·b left pads (at most half the cache)
      for (int i = 0; i < std::min(23 * b, s.S / 2); ++i) m[std::size_t(b) * s.S + i] = 0;
    mask.upload(m);
  }
  KVCacheView kv(int l) {
    return make_kv_cache_view(layers[l]->keys.get(), layers[l]->values.get(), dtype_of<T>::value,
                              Device::cuda, s.B, s.H, s.S, s.D, lengths.data(),
                              with_mask ? mask.get() : nullptr);
  }
  TensorView q(int l) {
    return TensorView::contiguous(layers[l]->queries.get(), dtype_of<T>::value, Device::cuda,
                                  {s.B, s.H * s.G, s.W, s.D});
  }
  std::vector<KVCacheView> kvs() {
    std::vector<KVCacheView> v;
    for (int l = 0; l < s.L; ++l) v.push_back(kv(l));
    return v;
  }
  std::vector<TensorView> qs() {
    std::vector<TensorView> v;
    for (int l = 0; l < s.L; ++l) v.push_back(q(l));
    return v;
  }
  std::size_t rows() const { return std::size_t(s.B) * s.H; }
  RKVConfig config() const {
    RKVConfig cfg;
    cfg.budget = s.budget;
    cfg.window = s.W;
    return cfg;
  }
};

template <class T>
void check_select_step(bool pads, bool tensor_core, std::uint32_t seed) {
  Step<T> st(Shape{}, pads, seed);
  const Shape& s = st.s;
  RKVConfig cfg = st.config();
  cfg.tensor_core_search = tensor_core;
  const std::size_t n = s.S - s.W, rows = st.rows();
  std::vector<KVCacheView> kvs = st.kvs();
  std::vector<TensorView> qs = st.qs();

  DeviceBuffer<std::int32_t> step_slots(s.L * rows * s.budget);
  DeviceBuffer<float> step_scores(s.L * rows * n);
  DeviceBuffer<char> ws(cuda::rkv_step_workspace_bytes(kvs.data(), qs.data(), s.L, cfg));
  REQUIRE(cuda::rkv_select_step(kvs.data(), qs.data(), s.L, cfg, step_slots.get(),
                                step_scores.get(), ws.get(), ws.size(), nullptr));
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<std::int32_t> all_slots = step_slots.download();
  const std::vector<float> all_scores = step_scores.download();

  for (int l = 0; l < s.L; ++l) {
    INFO("layer " << l);
    DeviceBuffer<std::int32_t> slots(rows * s.budget);
    DeviceBuffer<float> scores(rows * n);
    DeviceBuffer<char> ws1(cuda::rkv_workspace_bytes(kvs[l], qs[l], cfg));
    REQUIRE(cuda::rkv_select(kvs[l], qs[l], cfg, slots.get(), scores.get(), ws1.get(), ws1.size(),
                             nullptr));
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<std::int32_t> one_slots = slots.download();
    const std::vector<float> one_scores = scores.download();
    CHECK(std::vector<std::int32_t>(all_slots.begin() + l * one_slots.size(),
                                    all_slots.begin() + (l + 1) * one_slots.size()) == one_slots);
    CHECK(std::vector<float>(all_scores.begin() + l * one_scores.size(),
                             all_scores.begin() + (l + 1) * one_scores.size()) == one_scores);
  }
  // The layers really differ: a step that scored layer 0 everywhere would fail the loop above,
  // unless the layers' selections coincide.
  CHECK(std::vector<std::int32_t>(all_slots.begin(), all_slots.begin() + rows * s.budget) !=
        std::vector<std::int32_t>(all_slots.begin() + rows * s.budget,
                                  all_slots.begin() + 2 * rows * s.budget));
}

}  // namespace

TEST_CASE("cuda rkv_select_step equals rkv_select layer by layer", "[cuda][rkv][step]") {
  SECTION("bf16, fp32 search") { check_select_step<bf16_t>(false, false, 1); }
  SECTION("bf16, tensor-core search, left padding") { check_select_step<bf16_t>(true, true, 2); }
  SECTION("f32, left padding") { check_select_step<float>(true, false, 3); }
  SECTION("f16, tensor-core search") { check_select_step<f16_t>(false, true, 4); }
}

TEST_CASE("cuda compact_device_rows_step equals compact_device_rows layer by layer",
          "[cuda][compact][step]") {
  for (bool pads : {false, true}) {
    INFO("pads " << pads);
    Step<bf16_t> a(Shape{}, pads, 7), b(Shape{}, pads, 7);  // two identical copies
    const Shape& s = a.s;
    const RKVConfig cfg = a.config();
    std::vector<KVCacheView> kvs = a.kvs();
    std::vector<TensorView> qs = a.qs();
    const std::size_t row_elems = a.rows() * s.budget;
    DeviceBuffer<std::int32_t> slots(s.L * row_elems);
    DeviceBuffer<char> ws(cuda::rkv_step_workspace_bytes(kvs.data(), qs.data(), s.L, cfg));
    REQUIRE(cuda::rkv_select_step(kvs.data(), qs.data(), s.L, cfg, slots.get(), nullptr, ws.get(),
                                  ws.size(), nullptr));
    // Sequence 1's row of head 1 in layer 2 marked invalid: sequence 1 must stay untouched in
    // every layer, sequence 0 be compacted in every layer.
    const std::int32_t invalid = cuda::kRowInvalid;
    KVSIFT_CUDA_CHECK(cudaMemcpy(slots.get() + 2 * row_elems + (1 * s.H + 1) * s.budget, &invalid,
                                 sizeof(invalid), cudaMemcpyHostToDevice));
    DeviceBuffer<std::int32_t> len_step(s.B), len_one(s.B);
    cuda::compact_device_rows_step(kvs.data(), s.L, slots.get(), s.budget, len_step.get(), nullptr);
    std::vector<KVCacheView> kvs_b = b.kvs();
    for (int l = 0; l < s.L; ++l) {
      // The per-layer call sees the invalid marker only in layer 2; mark it in every layer's copy
      // of the rows so both paths leave sequence 1 alone everywhere.
      DeviceBuffer<std::int32_t> rows(row_elems);
      KVSIFT_CUDA_CHECK(cudaMemcpy(rows.get(), slots.get() + l * row_elems,
                                   row_elems * sizeof(std::int32_t), cudaMemcpyDeviceToDevice));
      KVSIFT_CUDA_CHECK(cudaMemcpy(rows.get() + (1 * s.H + 1) * s.budget, &invalid, sizeof(invalid),
                                   cudaMemcpyHostToDevice));
      // The mask is shared: compact it only with layer 0's call (its rows decide it).
      KVCacheView v = kvs_b[l];
      if (l > 0) v.valid_mask = nullptr;
      cuda::compact_device_rows(v, rows.get(), s.budget, l == 0 ? len_one.get() : nullptr, nullptr);
    }
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    for (int l = 0; l < s.L; ++l) {
      INFO("layer " << l);
      CHECK(same_bytes(a.layers[l]->keys.download(), b.layers[l]->keys.download()));
      CHECK(same_bytes(a.layers[l]->values.download(), b.layers[l]->values.download()));
    }
    CHECK(a.mask.download() == b.mask.download());
    const std::vector<std::int32_t> got = len_step.download();
    CHECK(got == len_one.download());
    CHECK(got[0] == s.budget);  // sequence 0 has no pads: a full budget
    CHECK(got[1] == -1);
    // Sequence 1 untouched: its keys still equal a fresh copy of the original.
    Step<bf16_t> fresh(Shape{}, pads, 7);
    const std::size_t seq = std::size_t(s.H) * s.S * s.D;
    for (int l = 0; l < s.L; ++l) {
      const std::vector<bf16_t> now = a.layers[l]->keys.download();
      const std::vector<bf16_t> orig = fresh.layers[l]->keys.download();
      CHECK(same_bytes(now, orig, seq));
      CHECK_FALSE(same_bytes(now, orig, 0, seq));
    }
  }
}

TEST_CASE("cuda step calls refuse layers that do not agree", "[cuda][rkv][step][errors]") {
  Step<bf16_t> st(Shape{}, true, 9);
  const Shape& s = st.s;
  const RKVConfig cfg = st.config();
  std::vector<KVCacheView> kvs = st.kvs();
  std::vector<TensorView> qs = st.qs();
  DeviceBuffer<std::int32_t> slots(s.L * st.rows() * s.budget);
  using Catch::Matchers::Contains;

  REQUIRE_THROWS_WITH(cuda::rkv_step_workspace_bytes(kvs.data(), qs.data(), 0, cfg),
                      Contains("n_layers (0) must be in [1, 128]"));
  REQUIRE_THROWS_WITH(cuda::rkv_step_workspace_bytes(kvs.data(), qs.data(), 129, cfg),
                      Contains("n_layers (129) must be in [1, 128]"));
  REQUIRE_THROWS_WITH(cuda::rkv_step_workspace_bytes(nullptr, qs.data(), 2, cfg),
                      Contains("got null"));
  {
    std::vector<KVCacheView> bad = kvs;
    bad[1].valid_mask = nullptr;
    REQUIRE_THROWS_WITH(cuda::rkv_select_step(bad.data(), qs.data(), s.L, cfg, slots.get(), nullptr,
                                              nullptr, 0, nullptr),
                        Contains("(layer 1): valid_mask differs from layer 0's"));
    REQUIRE_THROWS_WITH(
        cuda::compact_device_rows_step(bad.data(), s.L, slots.get(), s.budget, nullptr, nullptr),
        Contains("layer 1 valid_mask differs from layer 0's"));
  }
  {
    std::vector<std::int32_t> shorter(s.B, s.S - 1);
    std::vector<KVCacheView> bad = kvs;
    bad[2].lengths = shorter.data();
    REQUIRE_THROWS_WITH(cuda::rkv_step_workspace_bytes(bad.data(), qs.data(), s.L, cfg),
                        Contains("(layer 2): lengths[0] = 299 != layer 0's 300"));
  }
  {
    std::vector<KVCacheView> bad = kvs;
    bad[1].keys.shape[1] = 1;  // one KV head: a different layout
    bad[1].values.shape[1] = 1;
    REQUIRE_THROWS_WITH(cuda::rkv_step_workspace_bytes(bad.data(), qs.data(), s.L, cfg),
                        Contains("layer 1"));
    REQUIRE_THROWS_WITH(
        cuda::compact_device_rows_step(bad.data(), s.L, slots.get(), s.budget, nullptr, nullptr),
        Contains("layer 1 keys [2, 1, 300, 64] bf16 differ from layer 0's [2, 2, 300, 64] bf16"));
  }
  {
    std::vector<TensorView> bad = qs;
    bad[2].stride[1] *= 2;
    REQUIRE_THROWS_WITH(cuda::rkv_step_workspace_bytes(kvs.data(), bad.data(), s.L, cfg),
                        Contains("(layer 2): queries"));
  }
  REQUIRE_THROWS_WITH(cuda::rkv_select_step(kvs.data(), qs.data(), s.L, cfg, slots.get(), nullptr,
                                            nullptr, 0, nullptr),
                      Contains("rkv_select_step: workspace is null"));
}

namespace {

// Runs rkv_compress_step eagerly on one copy of the caches and as a captured CUDA graph on
// another (a non-blocking stream in global capture mode: any host wait, allocation, pageable copy
// or legacy-stream launch inside the step would end the capture with an error), then replays the
// graph on caches restored to the start. Every replay must give the eager bytes and lengths.
void check_graph_step(const Shape& shape, bool pads) {
  Step<bf16_t> eager(shape, pads, 11), graph(shape, pads, 11), fresh(shape, pads, 11);
  const Shape& s = eager.s;
  const RKVConfig cfg = eager.config();
  std::vector<KVCacheView> kvs_e = eager.kvs(), kvs_g = graph.kvs();
  std::vector<TensorView> qs_e = eager.qs(), qs_g = graph.qs();
  const cuda::RKVStepLayout layout =
      cuda::rkv_compress_step_layout(kvs_e.data(), qs_e.data(), s.L, cfg);
  INFO("batch " << s.B << ", layers per chunk " << layout.chunk);
  DeviceBuffer<char> ws_e(layout.total()), ws_g(layout.total());
  DeviceBuffer<std::int32_t> len_e(s.B), len_g(s.B);
  REQUIRE(cuda::rkv_compress_step(kvs_e.data(), qs_e.data(), s.L, cfg, ws_e.get(), ws_e.size(),
                                  len_e.get(), nullptr));
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());

  cudaStream_t stream = nullptr;
  KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t g = nullptr;
  KVSIFT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const bool enqueued = cuda::rkv_compress_step(kvs_g.data(), qs_g.data(), s.L, cfg, ws_g.get(),
                                                ws_g.size(), len_g.get(), stream);
  KVSIFT_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
  REQUIRE(enqueued);
  std::size_t nodes = 0;
  KVSIFT_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &nodes));
  CHECK(nodes > 0);
  cudaGraphExec_t exec = nullptr;
  KVSIFT_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  // Capturing ran nothing: the graph's caches are still the originals.
  CHECK(same_bytes(graph.layers[0]->keys.download(), fresh.layers[0]->keys.download()));

  for (int replay = 0; replay < 2; ++replay) {
    INFO("replay " << replay);
    if (replay > 0) {  // restore the caches and the mask, then replay the same graph
      for (int l = 0; l < s.L; ++l) {
        graph.layers[l]->keys.upload(fresh.layers[l]->keys.download());
        graph.layers[l]->values.upload(fresh.layers[l]->values.download());
      }
      graph.mask.upload(fresh.mask.download());
      KVSIFT_CUDA_CHECK(cudaMemset(len_g.get(), 0x7f, s.B * sizeof(std::int32_t)));
    }
    KVSIFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int l = 0; l < s.L; ++l) {
      INFO("layer " << l);
      CHECK(same_bytes(graph.layers[l]->keys.download(), eager.layers[l]->keys.download()));
      CHECK(same_bytes(graph.layers[l]->values.download(), eager.layers[l]->values.download()));
    }
    CHECK(graph.mask.download() == eager.mask.download());
    CHECK(len_g.download() == len_e.download());
  }
  // The step compacted: a sequence without pads keeps exactly the budget, and layer 0 moved.
  CHECK(len_e.download()[0] == s.budget);
  CHECK_FALSE(same_bytes(eager.layers[0]->keys.download(), fresh.layers[0]->keys.download()));
  KVSIFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KVSIFT_CUDA_CHECK(cudaGraphDestroy(g));
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace

TEST_CASE("cuda rkv_compress_step is one launch sequence a CUDA graph can capture",
          "[cuda][rkv][step][graph]") {
  SECTION("batch 2, left pads, one chunk") { check_graph_step(Shape{}, true); }
  SECTION("batch 100, two chunks of layers") { check_graph_step(with_batch(100), false); }
}

TEST_CASE("cuda rkv_compress_step: nothing over budget, errors", "[cuda][rkv][step][errors]") {
  Step<bf16_t> st(Shape{}, false, 12);
  const Shape& s = st.s;
  RKVConfig cfg = st.config();
  std::vector<KVCacheView> kvs = st.kvs();
  std::vector<TensorView> qs = st.qs();
  DeviceBuffer<std::int32_t> len(s.B);
  using Catch::Matchers::Contains;
  REQUIRE_THROWS_WITH(
      cuda::rkv_compress_step(kvs.data(), qs.data(), s.L, cfg, nullptr, 0, len.get(), nullptr),
      Contains("cuda::rkv_compress_step: workspace of 0 bytes is too small"));
  const cuda::RKVStepLayout layout =
      cuda::rkv_compress_step_layout(kvs.data(), qs.data(), s.L, cfg);
  DeviceBuffer<char> ws(layout.total());
  REQUIRE_THROWS_WITH(cuda::rkv_compress_step(kvs.data(), qs.data(), s.L, cfg, ws.get(), ws.size(),
                                              nullptr, nullptr),
                      Contains("new_lengths is null (device [2] int32 expected)"));
  cfg.budget = s.S;  // every sequence fits: nothing is enqueued, the caches stay as they are
  REQUIRE_FALSE(cuda::rkv_compress_step(kvs.data(), qs.data(), s.L, cfg, ws.get(), ws.size(),
                                        len.get(), nullptr));
}
