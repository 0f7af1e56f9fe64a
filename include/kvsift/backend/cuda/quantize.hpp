// kvsift::cuda::quantize / dequantize: ThinKV's TBQ group codecs (NVFP4, FP8, ternary;
// docs/algorithms.md §3.2, docs/quantization.md) for a device [tokens, channels] tensor in the KIVI
// layout (kivi_layout.hpp), bit for bit the host reference kvsift::quantize_tensor /
// dequantize_tensor (quant/quantized_tensor.hpp): same codes, same scales, same decoded floats.
//
// The packed layout is QuantizedTensor's: codes [num_groups, code_bytes_per_group(format)] and
// scales [num_groups], groups numbered as KiviGrid numbers them. So a tensor can be quantized on
// the GPU and decoded on the CPU (download()), or the other way round (upload()).
//
// Storage dtypes. quantize() reads f32, f16 or bf16 (math in fp32, the 16-bit value widened
// exactly, as the host reference does after to_float). dequantize() writes any of the three: f32
// is exactly dequantize_tensor's output; f16/bf16 are that float rounded once to nearest even
// (from_float<T>), i.e. from_float<T>(dequantize_tensor(q)[i]) — the engine's cache dtype, with no
// f32 staging buffer. Views may have a row stride (stride[0] >= channels); channels are contiguous.
//
// Validation. The host API throws for non-finite input and for corrupt packed data; on the GPU
// that would need a synchronisation, so instead both calls take an optional device word
// `first_fault` (nullptr: no check). The call sets it to kNoQuantFault, and the kernel lowers it
// (atomicMin) to the smallest group index holding a non-finite input element (quantize) or packed
// data that validate_quantized() rejects (dequantize: NaN or negative E4M3 scale, NaN E8M0 scale,
// NaN FP8 element, the ternary code 0b10). Such groups are still written, with unspecified values.
//
// No workspace is needed; the calls only enqueue on `stream` (no allocation, no synchronisation,
// except download(), which waits for its copies).
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/tensor_view.hpp"
#include "kvsift/quant/format.hpp"
#include "kvsift/quant/kivi_layout.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

namespace kvsift::cuda {

// "No faulty group": the value first_fault holds after a clean call.
inline constexpr unsigned long long kNoQuantFault = ~0ull;

// A packed tensor in device memory (the device twin of QuantizedTensor; memory owned by the
// caller).
struct DeviceQuantizedTensor {
  QuantFormat format = QuantFormat::nvfp4;
  KiviGrid grid;
  float global_factor = 1.0f;      // NVFP4's g; ignored by fp8 and ternary (keep it 1 there)
  std::uint8_t* codes = nullptr;   // device [num_groups, code_bytes_per_group(format)]
  std::uint8_t* scales = nullptr;  // device [num_groups]

  std::int64_t code_bytes() const { return grid.num_groups() * code_bytes_per_group(format); }
  std::int64_t scale_bytes() const { return grid.num_groups(); }

  void validate() const {
    detail::check_tensor_shape(grid.tokens, grid.channels);
    KVSIFT_CHECK(codes != nullptr && scales != nullptr,
                 "DeviceQuantizedTensor: codes and scales must be non-null (codes ",
                 static_cast<const void*>(codes), ", scales ", static_cast<const void*>(scales),
                 ")");
    KVSIFT_CHECK(std::isfinite(global_factor) && global_factor > 0.0f,
                 "DeviceQuantizedTensor: global_factor (", global_factor,
                 ") must be finite and > 0");
  }
};

// Quantizes x into out.codes / out.scales (out.format, out.grid.axis, out.global_factor).
//   x  device [tokens, channels] = [out.grid.tokens, out.grid.channels], f32/f16/bf16,
//      stride[1] == 1, stride[0] >= channels
// Throws kvsift::Error (nothing enqueued) for a host view, a shape or stride mismatch, or an
// invalid `out`.
void quantize(const TensorView& x, const DeviceQuantizedTensor& out,
              unsigned long long* first_fault,  // device [1] or nullptr
              cudaStream_t stream);

// Decodes q into out.
//   out  device [q.grid.tokens, q.grid.channels], f32/f16/bf16, stride[1] == 1,
//        stride[0] >= channels
void dequantize(const DeviceQuantizedTensor& q, const TensorView& out,
                unsigned long long* first_fault,  // device [1] or nullptr
                cudaStream_t stream);

// Copies a host QuantizedTensor into device buffers of matching size (dst.format, dst.grid and
// dst.global_factor are checked against src). Enqueued on `stream`; src must stay alive until the
// copies finish.
void upload(const QuantizedTensor& src, const DeviceQuantizedTensor& dst, cudaStream_t stream);

// Copies a device tensor back to the host (synchronises `stream`).
QuantizedTensor download(const DeviceQuantizedTensor& src, cudaStream_t stream);

}  // namespace kvsift::cuda
