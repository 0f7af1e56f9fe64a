// Documented upper bounds on sizes that only ever come from a config or an engine's call, never
// from data: they turn a typo or a hostile value (a layer index of INT_MAX, pool_blocks =
// INT_MAX) into a kvsift::Error naming the value instead of a multi-GB allocation attempt. Each
// is far above any real model (the largest open models have ~128 layers).
#pragma once

#include <cstdint>

namespace kvsift {

// Decoder layers a policy tracks per-layer state for; layer indices lie in [0, kMaxLayers).
inline constexpr std::int64_t kMaxLayers = 1024;
// Blocks in one layer's paged pool (ThinKV's pool_blocks, ThoughtBlockTableConfig::num_blocks):
// 2^20 blocks of up to 256 slots is 2^28 tokens per layer.
inline constexpr std::int64_t kMaxPoolBlocks = std::int64_t{1} << 20;
// Blocks over all layers of one ThinKV instance (num_layers * pool_blocks): each block carries
// bookkeeping even while free, so the product is bounded too.
inline constexpr std::int64_t kMaxTotalPoolBlocks = std::int64_t{1} << 22;

}  // namespace kvsift
