// kvsift::cuda::apply_steering: SkipKV's adaptive steering update h[b, last] += α_b · v on a
// device hidden-state tensor (docs/algorithms.md §2.5), bit-exact with SteeringController::apply.
// It takes plain data (strengths, gates, a device vector), not the policy-level controller, so
// this backend layer never includes policy/; the caller asks its controller for the decision.
//
// The arithmetic is the CPU reference's: the stored value widened to fp32, α_b · v[k] rounded to
// fp32, the sum rounded to fp32 (no fused multiply-add, which would round once and differ), then
// narrowed back to the storage dtype with round-to-nearest-even. A NaN already in `hidden` keeps
// its payload (quieted) as on the host; the only bits that can differ are those of a NaN the add
// itself creates (inf + −inf), which each side fills with its hardware's default NaN. It needs no
// workspace.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/config/steering_config.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift::cuda {

// Where the per-sequence strengths live: a host array is passed to the kernel by value (in
// launches of up to kSteeringRowsPerLaunch gated rows, so the caller may reuse it at once); a
// device array is read by the kernel when the stream reaches it.
enum class AlphaLocation : std::uint8_t { host, device };

inline constexpr int kSteeringRowsPerLaunch = 256;

// Adds alpha[b] · v to hidden[b, seq − 1, :] for every b with alpha[b] != 0. A row whose alpha is
// exactly 0 (+0 or −0) is ungated and left untouched, bit for bit (so −0.0 stays −0.0).
//   hidden  device [batch, seq, hidden_size], f32/f16/bf16, any strides (int64 offsets)
//   alpha   [batch] fp32, in host or device memory as `alpha_location` says
//   vector  device [hidden_size] fp32, the steering vector v
// Validates on the host (shapes, device, nulls) and enqueues on `stream`; with host alphas no
// kernel is launched when no row is gated. Throws kvsift::Error naming the bad argument.
void apply_steering(const TensorView& hidden, const float* alpha, AlphaLocation alpha_location,
                    const float* vector, cudaStream_t stream);

// One step's decision, made on the host (e.g. by SteeringController: gated(b), strength(b)):
// when `layer` is cfg.layer, every row b with gated[b] != 0 gets hidden[b, last] += alpha[b] · v,
// even at strength 0 (as SteeringController::apply does); other layers are left alone. Host
// arrays, so nothing waits on the device.
//   hidden       device [batch, seq, hidden_size], f32/f16/bf16, any strides
//   gated        host [batch], 1 = this row is at a thought boundary inside <think>
//   alpha        host [batch] fp32 strengths α_b
//   vector       device [vector_size] fp32, the steering vector v; vector_size == hidden_size
// Returns the number of rows steered. Throws kvsift::Error naming the bad argument.
std::int64_t apply_steering(const SteeringConfig& cfg, int layer, const TensorView& hidden,
                            const std::uint8_t* gated, const float* alpha, const float* vector,
                            std::int64_t vector_size, cudaStream_t stream);

}  // namespace kvsift::cuda
