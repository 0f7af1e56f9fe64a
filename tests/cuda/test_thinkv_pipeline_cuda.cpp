// The device ThinKV pipeline (kvsift::cuda::DeviceThinKV) in lockstep with the CPU pipeline (one
// kvsift::ThinKV per sequence) on the same random prompt, tokens and queries. Query scales change
// from one refresh interval to the next so that the classifier labels E, R and T segments, Rule 1
// (a new T segment) and Rule 2 (over budget) both demote. After every step:
//   - the same TBE step per sequence (segment, kept before/after) and the same label; at each step
//     closing a refresh interval (where the device reads the interval's sparsities) the same step
//     and interval sparsity, bit for bit (the device computes them over the resident keys as
//     stored);
//   - every layer's device blocks equal the CPU table's block_storage() bit for bit (codes sealed
//     on the device with fresh scales), masks, slot positions and staged rows equal;
//   - the resident tokens (addresses, positions, segments) of every (layer, KV head) are the CPU's:
//     the k-means survivors chosen on the device are the CPU's;
//   - resident bytes equal the sum of the CPU pipelines';
// and every few steps the gather-free attention equals the CPU's paged attention (1e-4).
// Also the errors: memory too small, unsupported configs, a step closed without its L*
// observation (nothing changes; the step can be completed afterwards).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/thinkv_pipeline.hpp"
#include "kvsift/policy/thinkv/thinkv.hpp"
#include "paged_mirror.hpp"
#include "thought_table_checks.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;
using test::DeviceBuffer;

namespace {

ThinKVConfig small_config() {
  ThinKVConfig c;
  c.num_layers = 3;
  c.kv_heads = 2;
  c.q_heads = 8;
  c.head_dim = 128;
  c.budget = 120;
  c.refresh = 32;
  c.theta1 = 0.3f;
  c.theta2 = 0.7f;
  c.calibrated_layers = {0, 2};
  c.schedule = {16, 8, 4};
  c.block_size = 32;
  c.pool_blocks = 48;
  return c;
}

// Per refresh interval: a small query scale gives flat attention (low sparsity: E), a large one
// peaked attention (high sparsity: T), one in between R.
float query_scale(std::int64_t step, std::int32_t seq) {
  static const float scales[] = {0.05f, 1.8f, 4.0f, 4.0f, 1.8f};
  return scales[(step / 32 + seq) % 5];
}

std::vector<float> normal(std::mt19937& rng, std::size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void run_lockstep(const ThinKVConfig& config, std::int32_t batch, std::int64_t prompt,
                  std::int64_t steps, DType input_dtype, int placement_threads = 0) {
  const std::int64_t H = config.kv_heads, D = config.head_dim, Q = config.q_heads;
  const std::int64_t L = config.num_layers;
  std::mt19937 rng(1234);
  std::vector<ThinKV> cpu;
  cpu.reserve(static_cast<std::size_t>(batch));
  for (std::int32_t b = 0; b < batch; ++b) cpu.emplace_back(config);
  DeviceBuffer<std::uint8_t> memory(cuda::DeviceThinKV::memory_bytes(config, batch));
  cuda::DeviceThinKV dev(config, batch, memory.get(), memory.size(), nullptr);
  dev.set_placement_threads(placement_threads);

  // Inputs rounded to bf16 when the device takes bf16, so both sides see the same numbers.
  auto as_input = [&](std::vector<float> v) {
    if (input_dtype == DType::bf16)
      for (float& x : v) x = to_float(from_float<bf16_t>(x));
    return v;
  };
  auto upload = [&](const std::vector<float>& v, DeviceBuffer<std::uint8_t>& buf) {
    if (input_dtype == DType::f32) {
      KVSIFT_CUDA_CHECK(cudaMemcpy(buf.get(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    } else {
      std::vector<bf16_t> h(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) h[i] = from_float<bf16_t>(v[i]);
      KVSIFT_CUDA_CHECK(cudaMemcpy(buf.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    }
  };

  // Prompt: CPU [n, H, D] per sequence, device [batch, H, n, D].
  {
    const std::size_t row = static_cast<std::size_t>(H * D);
    DeviceBuffer<std::uint8_t> dk(batch * prompt * row * 4), dv(dk.size());
    for (std::int64_t l = 0; l < L; ++l) {
      std::vector<float> K(batch * prompt * row), V(K.size());  // device layout
      for (std::int32_t b = 0; b < batch; ++b) {
        const std::vector<float> k = as_input(normal(rng, prompt * row));
        const std::vector<float> v = as_input(normal(rng, prompt * row));
        cpu[b].prefill(static_cast<int>(l), k.data(), v.data(), prompt);
        for (std::int64_t i = 0; i < prompt; ++i)
          for (std::int64_t h = 0; h < H; ++h)
            for (std::int64_t d = 0; d < D; ++d) {
              const std::size_t dst = ((b * H + h) * prompt + i) * D + d;
              K[dst] = k[(i * H + h) * D + d];
              V[dst] = v[(i * H + h) * D + d];
            }
      }
      upload(K, dk);
      upload(V, dv);
      dev.prefill(static_cast<int>(l), dk.get(), dv.get(), input_dtype, prompt);
    }
  }

  DeviceBuffer<std::uint8_t> dk(batch * H * D * 4), dv(dk.size());
  DeviceBuffer<float> dq(batch * Q * D), dout(batch * Q * D);
  std::int64_t demotions = 0;
  bool saw_transition = false;
  for (std::int64_t step = 0; step < steps; ++step) {
    const bool check_attention = step % 8 == 7;
    for (std::int64_t l = 0; l < L; ++l) {
      std::vector<float> K, V;
      for (std::int32_t b = 0; b < batch; ++b) {
        const std::vector<float> k = as_input(normal(rng, H * D));
        const std::vector<float> v = as_input(normal(rng, H * D));
        cpu[b].append(static_cast<int>(l), k.data(), v.data());
        K.insert(K.end(), k.begin(), k.end());
        V.insert(V.end(), v.begin(), v.end());
      }
      upload(K, dk);
      upload(V, dv);
      dev.append(static_cast<int>(l), dk.get(), dv.get(), input_dtype);
      std::vector<float> queries;
      for (std::int32_t b = 0; b < batch; ++b) {
        const std::vector<float> q = normal(rng, Q * D, query_scale(step, b));
        queries.insert(queries.end(), q.begin(), q.end());
        if (cpu[b].needs_sparsity(static_cast<int>(l)))
          cpu[b].observe_query(static_cast<int>(l), q.data());
      }
      dq.upload(queries);
      REQUIRE(dev.observe_query(static_cast<int>(l), dq.get()) ==
              cpu[0].needs_sparsity(static_cast<int>(l)));
      if (check_attention) {
        DeviceBuffer<std::uint8_t> ws(dev.attention_workspace_bytes(static_cast<int>(l)));
        dev.attention(static_cast<int>(l), dq.get(), dout.get(), ws.get(), ws.size());
        const std::vector<float> got = dout.download();
        std::vector<float> want(static_cast<std::size_t>(Q * D));
        for (std::int32_t b = 0; b < batch; ++b) {
          cpu[b].attention(static_cast<int>(l), &queries[b * Q * D], want.data());
          for (std::int64_t i = 0; i < Q * D; ++i) {
            INFO("step " << step << " layer " << l << " sequence " << b << " element " << i);
            REQUIRE(std::fabs(got[b * Q * D + i] - want[i]) <=
                    1e-4f * std::max(1.0f, std::fabs(want[i])));
          }
        }
      }
    }
    const std::vector<EvictionStep> got = dev.end_step();
    REQUIRE(got.size() == static_cast<std::size_t>(batch));
    for (std::int32_t b = 0; b < batch; ++b) {
      const EvictionStep want = cpu[b].end_step();
      INFO("step " << step << " sequence " << b);
      // The device reports an interval's sparsities at the step that closes it (end_step waits
      // only there): then its last step's and the interval's means are the CPU's bit for bit.
      if ((step + 1) % dev.config().refresh == 0) {
        REQUIRE(dev.schedule(b).classifier().pending_steps() == 0);
        REQUIRE(dev.schedule(b).classifier().last_step_sparsity() ==
                cpu[b].classifier().last_step_sparsity());
        REQUIRE(dev.schedule(b).classifier().last_interval_sparsity() ==
                cpu[b].classifier().last_interval_sparsity());
      } else {
        REQUIRE(dev.schedule(b).classifier().pending_steps() == (step + 1) % dev.config().refresh);
      }
      REQUIRE(dev.schedule(b).label() == cpu[b].label());
      REQUIRE(got[b].changes.size() == want.changes.size());
      for (std::size_t c = 0; c < want.changes.size(); ++c) {
        REQUIRE(got[b].changes[c].segment == want.changes[c].segment);
        REQUIRE(got[b].changes[c].kept_before == want.changes[c].kept_before);
        REQUIRE(got[b].changes[c].kept_after == want.changes[c].kept_after);
      }
      demotions += static_cast<std::int64_t>(want.changes.size());
      saw_transition = saw_transition || cpu[b].label() == ThoughtType::transition;
    }
    if (step % 4 == 3 || step + 1 == steps) {
      for (std::int64_t l = 0; l < L; ++l) {
        const cuda::DevicePagedTable& table = dev.device_table(static_cast<int>(l));
        const test::DeviceTableSnapshot snap = test::snapshot(table);
        for (std::int32_t b = 0; b < batch; ++b) {
          INFO("step " << step << " layer " << l << " sequence " << b);
          test::require_same_sequence(cpu[b].table(static_cast<int>(l)), 0, table, snap, b, false);
          test::require_same_resident_tokens(cpu[b].table(static_cast<int>(l)), 0,
                                             dev.table(static_cast<int>(l)), b);
        }
      }
      TableBytes want;
      for (const ThinKV& c : cpu) want += c.resident_bytes();
      const TableBytes have = dev.resident_bytes();
      REQUIRE(have.codes == want.codes);
      REQUIRE(have.scales == want.scales);
      REQUIRE(have.staging == want.staging);
    }
  }
  // The run exercised what it claims to: demotions (k-means survivors), T segments, and under
  // refill = regroup pinned runs re-quantized on the device.
  std::int64_t regroups = 0;
  for (const ThinKV& c : cpu)
    for (std::int64_t l = 0; l < L; ++l)
      regroups += c.table(static_cast<int>(l)).refill_stats().regroups;
  INFO("demotions " << demotions << ", regroups " << regroups);
  REQUIRE(demotions >= 4);
  REQUIRE(saw_transition);
  REQUIRE((regroups > 0) == (config.refill == RefillRule::regroup));
}

}  // namespace

TEST_CASE("DeviceThinKV follows the CPU pipeline step by step", "[thinkv][cuda]") {
  SECTION("R4 E4 T2, f32 inputs, batch 3") { run_lockstep(small_config(), 3, 40, 200, DType::f32); }
  SECTION("R4 E4 T2, batch 3, each layer placed on its own host thread") {
    run_lockstep(small_config(), 3, 40, 200, DType::f32, 3);
  }
  SECTION("refill = regroup (f >= 4), batch 2") {
    ThinKVConfig c = small_config();
    c.refill = RefillRule::regroup;
    c.regroup_min_free = 4;
    run_lockstep(c, 2, 40, 200, DType::f32);
  }
  SECTION("batch 12, an 8-token prompt: more demotion problems than a segment's start position") {
    // The step's problem list outgrows the demoted segments' positions (12 sequences × 2 heads
    // against segments starting at 8 + 32k), so a scan bounded by a problem count instead of
    // the segments' positions would miss tokens.
    run_lockstep(small_config(), 12, 8, 160, DType::f32, 2);
  }
  SECTION("bf16 inputs, FP8 execution blocks (tiled attention), batch 2") {
    ThinKVConfig c = small_config();
    c.execution = BlockFormat::fp8;
    run_lockstep(c, 2, 17, 130, DType::bf16);
  }
}

TEST_CASE("DeviceThinKV refuses what it cannot do", "[thinkv][cuda]") {
  ThinKVConfig c = small_config();
  SECTION("memory too small") {
    const std::size_t need = cuda::DeviceThinKV::memory_bytes(c, 2);
    DeviceBuffer<std::uint8_t> memory(need);
    REQUIRE_THROWS_WITH(cuda::DeviceThinKV(c, 2, memory.get(), need - 1, nullptr),
                        Contains("is too small"));
  }
  SECTION("configs outside the device k-means") {
    c.evict_prompt = true;
    REQUIRE_THROWS_WITH(cuda::DeviceThinKV::memory_bytes(c, 1), Contains("evict_prompt"));
    c = small_config();
    c.refresh = 256;
    REQUIRE_THROWS_WITH(cuda::DeviceThinKV::memory_bytes(c, 1), Contains("refresh (256)"));
  }
  SECTION("a step without its L* observation changes nothing") {
    DeviceBuffer<std::uint8_t> memory(cuda::DeviceThinKV::memory_bytes(c, 1));
    cuda::DeviceThinKV dev(c, 1, memory.get(), memory.size(), nullptr);
    std::mt19937 rng(7);
    DeviceBuffer<float> k(normal(rng, c.kv_heads * c.head_dim));
    DeviceBuffer<float> v(normal(rng, c.kv_heads * c.head_dim));
    DeviceBuffer<float> q(normal(rng, c.q_heads * c.head_dim));
    for (int l = 0; l < c.num_layers; ++l) dev.append(l, k.get(), v.get(), DType::f32);
    dev.observe_query(0, q.get());
    REQUIRE_THROWS_WITH(dev.end_step(), Contains("calibrated layer 2 was not observed"));
    REQUIRE(dev.steps() == 0);
    REQUIRE_THROWS_WITH(dev.append(0, k.get(), v.get(), DType::f32),
                        Contains("layer 0 already has its token for step 0"));
    dev.observe_query(2, q.get());
    REQUIRE(dev.end_step().size() == 1);
    REQUIRE(dev.steps() == 1);
    REQUIRE_THROWS_WITH(dev.append(0, k.get(), v.get(), DType::f16), Contains("f32 or bf16"));
  }
  SECTION("a step that may exhaust a layer's pool is refused before any layer changes") {
    // f32 blocks: every token takes a slot, a block of 32 slots per 32 tokens, 3 blocks per
    // sequence.
    c.reasoning = c.execution = c.transition = BlockFormat::f32;
    c.pool_blocks = 3;
    DeviceBuffer<std::uint8_t> memory(cuda::DeviceThinKV::memory_bytes(c, 1));
    cuda::DeviceThinKV dev(c, 1, memory.get(), memory.size(), nullptr);
    dev.set_placement_threads(2);
    REQUIRE_THROWS_WITH(dev.set_placement_threads(-1), Contains("threads (-1) outside [0, 64]"));
    std::mt19937 rng(11);
    DeviceBuffer<float> k(normal(rng, c.kv_heads * c.head_dim));
    DeviceBuffer<float> v(normal(rng, c.kv_heads * c.head_dim));
    DeviceBuffer<float> q(normal(rng, c.q_heads * c.head_dim));
    std::int64_t refused_at = -1;
    for (std::int64_t step = 0; step < 100 && refused_at < 0; ++step) {
      try {
        dev.append(0, k.get(), v.get(), DType::f32);
      } catch (const Error& e) {
        REQUIRE_THAT(e.what(),
                     Contains("layer 0 has 0 free blocks") && Contains("raise pool_blocks"));
        refused_at = step;
        break;
      }
      for (int l = 1; l < c.num_layers; ++l) dev.append(l, k.get(), v.get(), DType::f32);
      for (int l : c.calibrated_layers) dev.observe_query(l, q.get());
      dev.end_step();
    }
    // Tokens 0, 32 and 64 took the three blocks; step 65 finds no free block (a step is refused
    // unless each sequence could take one, whether or not its token needs it).
    REQUIRE(refused_at == 65);
    for (int l = 0; l < c.num_layers; ++l) {
      REQUIRE(dev.table(l).length(0) == 65);
      REQUIRE(dev.device_table(l).pending_tokens() == 0);
    }
  }
  SECTION("a NaN sparsity is reported at the step closing its interval, naming its step") {
    DeviceBuffer<std::uint8_t> memory(cuda::DeviceThinKV::memory_bytes(c, 1));
    cuda::DeviceThinKV dev(c, 1, memory.get(), memory.size(), nullptr);
    std::mt19937 rng(9);
    DeviceBuffer<float> k(normal(rng, c.kv_heads * c.head_dim));
    DeviceBuffer<float> v(normal(rng, c.kv_heads * c.head_dim));
    DeviceBuffer<float> q(normal(rng, c.q_heads * c.head_dim));
    std::vector<float> bad = normal(rng, c.q_heads * c.head_dim);
    bad[5] = std::numeric_limits<float>::quiet_NaN();
    DeviceBuffer<float> qnan(bad);
    for (int step = 0; step < c.refresh; ++step) {
      for (int l = 0; l < c.num_layers; ++l) {
        dev.append(l, k.get(), v.get(), DType::f32);
        dev.observe_query(l, (step == 3 && l == 2 ? qnan : q).get());
      }
      if (step + 1 < c.refresh) {
        REQUIRE(dev.end_step().size() == 1);  // deferred: nothing waits, nothing is checked yet
      } else {
        REQUIRE_THROWS_WITH(dev.end_step(), Contains("step 3 layer 2 sequence 0"));
      }
    }
  }
}
