// ThinKV through the engine-facing interface on the device: make_cache_owning_policy("thinkv")
// placed on the device (CacheOwningPolicy::place_on_device → DeviceBackend::make_thinkv →
// cuda::DeviceThinKV) in lockstep with the same policy on the host, fed the same K/V (bf16 on the
// device, the same numbers in f32 on the host) and queries. Every step: the same end_step
// answer; every few steps: attention within 1e-4 of the host's, the same resident positions in
// every (layer, sequence, KV head), the same resident bytes; at the end the same eviction counts.
// Also the errors a wrong call gets, with the state left usable.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/paged/block_bytes.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/policy/thinkv/thinkv_policy.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;
using test::DeviceBuffer;

namespace {

constexpr int kLayers = 3, kKV = 2, kQ = 8, kD = 128;

std::string config_json(int batch) {
  return "{\"batch\": " + std::to_string(batch) +
         R"(, "num_layers": 3, "kv_heads": 2, "q_heads": 8, "head_dim": 128, "budget": 120,
             "refresh": 32, "theta1": 0.3, "theta2": 0.7, "calibrated_layers": [0, 2],
             "schedule": [16, 8, 4], "pool_blocks": 48})";
}

// Values rounded to bf16, so the host's f32 copy and the device's bf16 one are the same numbers.
std::vector<float> bf16_normal(std::mt19937& rng, std::size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = to_float(from_float<bf16_t>(d(rng)));
  return v;
}

std::vector<bf16_t> to_bf16(const std::vector<float>& v) {
  std::vector<bf16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = from_float<bf16_t>(v[i]);
  return out;
}

// Query scales per refresh interval: flat (E), peaked (T) and in between (R) attention.
float query_scale(std::int64_t step, int seq) {
  static const float scales[] = {0.05f, 1.8f, 4.0f, 4.0f, 1.8f};
  return scales[(step / 32 + seq) % 5];
}

struct Placed {
  std::unique_ptr<CacheOwningPolicy> policy;
  DeviceBuffer<std::uint8_t> memory;
  explicit Placed(int batch)
      : policy(make_cache_owning_policy("thinkv", config_json(batch))),
        memory(policy->device_memory_bytes()) {
    policy->place_on_device(ExecContext{memory.get(), memory.size(), nullptr});
  }
};

}  // namespace

TEST_CASE("ThinKV placed on the device follows the host policy step by step",
          "[thinkv][policy][cuda]") {
  const int B = 3;
  const std::int64_t prompt = 40, steps = 160;
  auto host = make_cache_owning_policy("thinkv", config_json(B));
  Placed dev(B);
  REQUIRE(dev.policy->on_device());
  REQUIRE_FALSE(host->on_device());
  std::mt19937 rng(99);

  {  // the prompt: [batch, kv_heads, n, head_dim]
    const std::size_t n = static_cast<std::size_t>(B * kKV * prompt * kD);
    DeviceBuffer<bf16_t> dk(n), dv(n);
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> k = bf16_normal(rng, n), v = bf16_normal(rng, n);
      host->prefill(
          l, TensorView::contiguous(k.data(), DType::f32, Device::cpu, {B, kKV, prompt, kD}),
          TensorView::contiguous(v.data(), DType::f32, Device::cpu, {B, kKV, prompt, kD}));
      dk.upload(to_bf16(k));
      dv.upload(to_bf16(v));
      dev.policy->prefill(
          l, TensorView::contiguous(dk.get(), DType::bf16, Device::cuda, {B, kKV, prompt, kD}),
          TensorView::contiguous(dv.get(), DType::bf16, Device::cuda, {B, kKV, prompt, kD}));
    }
  }

  const std::size_t kv_n = static_cast<std::size_t>(B * kKV * kD), q_n = B * kQ * kD;
  DeviceBuffer<bf16_t> dk(kv_n), dv(kv_n);
  DeviceBuffer<float> dq(q_n), dout(q_n);
  std::vector<float> host_out(q_n);
  int evicting_steps = 0;
  for (std::int64_t step = 0; step < steps; ++step) {
    const bool check = step % 8 == 5 || step + 1 == steps;
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> k = bf16_normal(rng, kv_n), v = bf16_normal(rng, kv_n);
      host->append(l, TensorView::contiguous(k.data(), DType::f32, Device::cpu, {B, kKV, 1, kD}),
                   TensorView::contiguous(v.data(), DType::f32, Device::cpu, {B, kKV, 1, kD}));
      dk.upload(to_bf16(k));
      dv.upload(to_bf16(v));
      dev.policy->append(
          l, TensorView::contiguous(dk.get(), DType::bf16, Device::cuda, {B, kKV, 1, kD}),
          TensorView::contiguous(dv.get(), DType::bf16, Device::cuda, {B, kKV, 1, kD}));
      std::vector<float> q;
      for (int b = 0; b < B; ++b) {
        std::normal_distribution<float> d(0.0f, query_scale(step, b));
        for (int i = 0; i < kQ * kD; ++i) q.push_back(d(rng));
      }
      dq.upload(q);
      Observation ho, dobs;
      ho.layer = dobs.layer = l;
      ho.queries = TensorView::contiguous(q.data(), DType::f32, Device::cpu, {B, kQ, 1, kD});
      dobs.queries = TensorView::contiguous(dq.get(), DType::f32, Device::cuda, {B, kQ, 1, kD});
      host->observe(ho);
      dev.policy->observe(dobs);
      if (!check) continue;
      host->attention(
          l, ho.queries,
          TensorView::contiguous(host_out.data(), DType::f32, Device::cpu, {B, kQ, 1, kD}));
      DeviceBuffer<std::uint8_t> ws(dev.policy->attention_workspace_bytes(l));
      dev.policy->attention_with_workspace(
          l, dobs.queries,
          TensorView::contiguous(dout.get(), DType::f32, Device::cuda, {B, kQ, 1, kD}),
          ExecContext{ws.get(), ws.size(), nullptr});
      const std::vector<float> got = dout.download();
      for (std::size_t i = 0; i < q_n; ++i) {
        INFO("step " << step << " layer " << l << " element " << i);
        REQUIRE(std::fabs(got[i] - host_out[i]) <= 1e-4f * std::max(1.0f, std::fabs(host_out[i])));
      }
    }
    const bool host_evicted = host->end_step();
    REQUIRE(dev.policy->end_step() == host_evicted);
    evicting_steps += host_evicted;
    if (!check) continue;
    for (int l = 0; l < kLayers; ++l)
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < kKV; ++h) {
          INFO("step " << step << " layer " << l << " sequence " << b << " head " << h);
          REQUIRE(dev.policy->resident_positions(l, b, h) == host->resident_positions(l, b, h));
        }
    // The host keeps one table per (sequence, layer), each with its own copy of the layer's
    // NVFP4 global factors (every sequence holds an NVFP4 block: the prompt is R); the device
    // keeps one table per layer, shared by the batch, and so one copy. Everything else is equal.
    const std::int64_t shared = (B - 1) * global_factor_bytes(kKV);
    for (int l = 0; l < kLayers; ++l)
      REQUIRE(dev.policy->resident_bytes(l) == host->resident_bytes(l) - shared);
    REQUIRE(dev.policy->resident_bytes() == host->resident_bytes() - kLayers * shared);
    REQUIRE(dev.policy->fullkv_fp16_bytes() == host->fullkv_fp16_bytes());
  }
  REQUIRE(evicting_steps >= 3);  // Rule 1 and Rule 2 demotions happened
  const auto& h = dynamic_cast<const ThinKVPolicy&>(*host);
  const auto& d = dynamic_cast<const ThinKVPolicy&>(*dev.policy);
  REQUIRE(d.evicting_layer_steps() == h.evicting_layer_steps());
  REQUIRE(d.total_layer_steps() == h.total_layer_steps());
}

TEST_CASE("ThinKV on the device refuses wrong calls and stays usable", "[thinkv][policy][cuda]") {
  Placed dev(1);
  std::vector<float> host_kv(kKV * kD, 0.5f);
  DeviceBuffer<float> dk(kKV * kD), dq(kQ * kD), dout(kQ * kD);
  const TensorView hk =
      TensorView::contiguous(host_kv.data(), DType::f32, Device::cpu, {1, kKV, 1, kD});
  const TensorView k = TensorView::contiguous(dk.get(), DType::f32, Device::cuda, {1, kKV, 1, kD});
  const TensorView q = TensorView::contiguous(dq.get(), DType::f32, Device::cuda, {1, kQ, 1, kD});
  const TensorView o = TensorView::contiguous(dout.get(), DType::f32, Device::cuda, {1, kQ, 1, kD});
  KVSIFT_CUDA_CHECK(cudaMemset(dk.get(), 0, dk.size() * 4));
  KVSIFT_CUDA_CHECK(cudaMemset(dq.get(), 0, dq.size() * 4));
  REQUIRE_THROWS_WITH(dev.policy->append(0, hk, hk), Contains("contiguous device f32/bf16"));
  TensorView other = k;
  other.dtype = DType::bf16;
  REQUIRE_THROWS_WITH(dev.policy->append(0, k, other), Contains("differ"));
  REQUIRE_THROWS_WITH(
      dev.policy->place_on_device(ExecContext{dev.memory.get(), dev.memory.size(), nullptr}),
      Contains("already on the device"));
  REQUIRE_THROWS_WITH(dev.policy->attention(0, q, o), Contains("attention_with_workspace"));
  // The failed calls changed nothing: a whole step still goes through.
  for (int l = 0; l < kLayers; ++l) {
    dev.policy->append(l, k, k);
    Observation obs;
    obs.layer = l;
    obs.queries = q;
    dev.policy->observe(obs);
  }
  REQUIRE_FALSE(dev.policy->end_step());
  REQUIRE(dev.policy->resident_positions(0, 0, 1) == std::vector<std::int32_t>{0});

  // A host policy refuses device tensors, and placement after the prompt.
  auto host = make_cache_owning_policy("thinkv", config_json(1));
  REQUIRE_THROWS_WITH(host->append(0, k, k), Contains("place_on_device() first"));
  host->append(0, hk, hk);
  DeviceBuffer<std::uint8_t> memory(host->device_memory_bytes());
  REQUIRE_THROWS_WITH(host->place_on_device(ExecContext{memory.get(), memory.size(), nullptr}),
                      Contains("before the prompt"));
  REQUIRE_FALSE(host->on_device());
  // Methods without a device path.
  auto kivi = make_cache_owning_policy(
      "kivi", R"({"num_layers": 1, "kv_heads": 1, "q_heads": 1, "head_dim": 16,
                  "group_size": 16, "residual_length": 32})");
  REQUIRE(kivi->device_memory_bytes() == 0);
  REQUIRE_THROWS_WITH(kivi->place_on_device(ExecContext{memory.get(), memory.size(), nullptr}),
                      Contains("host only"));
}
