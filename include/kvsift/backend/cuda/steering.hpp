// kvsift::cuda::apply_steering: SkipKV's adaptive steering update h[b, last] += α_b · v on a
// device hidden-state tensor (docs/algorithms.md §2.5), bit-exact with SteeringController::apply.
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

#include "kvsift/core/tensor_view.hpp"
#include "kvsift/policy/skipkv/steering.hpp"

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

// The controller's decision for this step, run on the device: when `layer` is the steered one,
// every gated row b gets strength(b) (host alphas, so nothing waits on the device). `vector` is a
// device copy of controller.vector().values. Returns the number of rows steered, as
// SteeringController::apply does.
std::int64_t apply_steering(const SteeringController& controller, int layer,
                            const TensorView& hidden, const float* vector, cudaStream_t stream);

}  // namespace kvsift::cuda
