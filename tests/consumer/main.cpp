// Uses the installed headers and library: plan with a policy chosen by name, compact, check.
#include <cstdio>
#include <vector>

#include "kvsift/kvsift.hpp"

int main() {
  const int B = 1, H = 2, C = 64, D = 16, Hq = 4, W = 8;
  std::vector<float> k(B * H * C * D), v(k.size()), q(B * Hq * W * D);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = v[i] = float((i * 7919) % 101) / 101.0f;
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = float((i * 104729) % 97) / 97.0f;
  std::vector<std::int32_t> lengths = {C};
  kvsift::StepInputs in;
  in.kv = kvsift::make_kv_cache_view(k.data(), v.data(), kvsift::DType::f32, kvsift::Device::cpu, B,
                                     H, C, D, lengths.data());
  in.window_queries = kvsift::TensorView::contiguous(q.data(), kvsift::DType::f32,
                                                     kvsift::Device::cpu, {B, Hq, W, D});
  auto policy = kvsift::make_policy("rkv", R"({"budget": 32, "window": 8})");  // window: W
  const kvsift::KeepPlan plan = policy->select(in);
  kvsift::compact(in.kv, plan);
  if (lengths[0] != 32) {
    std::fprintf(stderr, "consumer: expected 32 resident tokens, got %d\n", lengths[0]);
    return 1;
  }
  std::printf("consumer: kvsift %s found and linked; rkv kept %d of %d tokens\n",
              kvsift::version_string().c_str(), lengths[0], C);
  return 0;
}
