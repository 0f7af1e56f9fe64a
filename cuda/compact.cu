// In-place compaction of a device KV cache.
//
// Why in place is safe without a copy of the cache: a row's kept slots are sorted and unique, so
// slot[i] >= i. One block walks the rows of one (sequence, head, column slice) in tiles; a tile's
// source rows are read into registers before a barrier and its destination rows written after it.
// Later tiles read only rows >= their own start, which no earlier tile writes; earlier tiles have
// finished reading before this tile writes. So the reads of tile k + 1 may overlap the writes of
// tile k (compact_rows_kernel does so, one barrier per tile). Column slices are disjoint bytes,
// so blocks never race.
#include <algorithm>
#include <cstdint>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "rkv_kernels.cuh"

namespace kvsift::cuda {

static_assert(kRowEnd == kUnusedSlot && kRowInvalid == kNanScoreSlot,
              "compact_device_rows reads the rows rkv_select writes");

namespace {

using detail::StepBases;
using detail::StepView;

constexpr int kThreads = 512;

// A sequence whose rows hold a kRowInvalid marker in any layer is left untouched by
// compact_device_rows(_step) in every layer: its layers and its mask stay consistent. The whole
// block decides, each thread testing its share of the n_layers · kv_heads rows, so the loads are
// independent: one thread's loop with an early exit waited on each load in turn, 256 of them at
// 32 layers and 8 KV heads (~100 µs before a block could start, bench/RESULTS.md run 100). Every
// thread of the block must call it (it ends in a barrier); the result is the same in all.
//   slots [n_layers, batch, kv_heads, row_stride]
__device__ __forceinline__ bool sequence_invalid(const std::int32_t* slots, int b, int batch,
                                                 int n_layers, int kv_heads, int row_stride) {
  bool invalid = false;
  for (int i = threadIdx.x; i < n_layers * kv_heads; i += blockDim.x) {
    const int l = i / kv_heads, h = i % kv_heads;
    const std::int64_t row = (std::int64_t{l} * batch + b) * kv_heads + h;
    invalid |= slots[row * row_stride] == kRowInvalid;
  }
  return __syncthreads_or(invalid) != 0;
}
// Rows per thread and tile. Two tiles are in registers at once (below), so 4 keeps the 16-byte
// buffers at 32 registers, as 8 rows of one tile did.
constexpr int kRowsPerThread = 4;

// The moves of one tile: which source row each of the thread's rows reads, and its bytes.
template <class Unit>
struct TileRegs {
  Unit buf[kRowsPerThread];
  std::int32_t src[kRowsPerThread];  // -1: nothing to move
};

// Grid (rows = n_layers · batch · kv_heads, column slices), kThreads threads: block (row, slice)
// moves `slice_units` access units of every kept slot of that row.
//
// Software pipeline, one barrier per tile: iteration k loads tile k + 1 and stores tile k, then
// synchronises. Safe in place because slot[i] >= i (sorted, unique kept slots):
//   - tile k + 1 reads rows >= its first index, above every row tile k writes, so the two may
//     overlap;
//   - tile k's own reads were issued before the previous barrier, its writes after it;
//   - an earlier tile m < k, which may read a row tile k writes, loaded before barrier m <= k − 1.
// __launch_bounds__(kThreads, 2): at most 64 registers, two blocks (1024 threads) per SM; the
// unbounded kernel took 68 and ran one block per SM, alternating between loading and storing.
template <class Unit>
__global__ void __launch_bounds__(kThreads, 2)
    compact_rows_kernel(StepBases bases,        // K or V of every layer
                        std::int64_t stride_h,  // bytes between heads
                        std::int64_t stride_s,  // bytes between slots
                        int units_per_row, int slice_units, int n_layers, int kv_heads,
                        const std::int64_t* __restrict__ indptr,  // [B*H + 1] or null
                        const std::int32_t* __restrict__ slots,   // [nnz]
                        int row_stride, std::int64_t capacity) {
  const int row = blockIdx.x;  // (layer, b, h) flattened
  const int z = row / kv_heads, h = row % kv_heads;
  if (indptr == nullptr &&
      sequence_invalid(slots, z % bases.batch, bases.batch, n_layers, kv_heads, row_stride))
    return;  // the whole block: the decision depends on blockIdx only
  const int unit = blockIdx.y * slice_units + threadIdx.x % slice_units;
  const int rows_per_pass = kThreads / slice_units;
  const int lane_row = threadIdx.x / slice_units;
  const bool active = unit < units_per_row && lane_row < rows_per_pass;
  const std::int64_t begin = indptr != nullptr ? indptr[row] : std::int64_t{row} * row_stride;
  // Slots are int32 and a row's are unique, so it keeps fewer than 2^31 of them: int indices
  // suffice and leave registers for the data.
  const int n = static_cast<int>(indptr != nullptr ? indptr[row + 1] - begin : row_stride);
  const std::int32_t* row_slots = slots + begin;
  char* head_base = bases.seq<char>(z) + h * stride_h;
  const int tile = rows_per_pass * kRowsPerThread;
  // Tile rows start at t0 < n (so t0 fits in int); offsets are compared against n − t0, so no
  // index overflows even for n near 2^31.
  auto load = [&](std::int64_t t0, TileRegs<Unit>& t) {
    const int base = static_cast<int>(t0 < n ? t0 : n), left = n - base;
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int off = k * rows_per_pass + lane_row;
      std::int32_t src = (active && off < left) ? row_slots[base + off] : -1;
      // Out of bounds (device rows are not host-checked), or already in place: nothing to move.
      if (src >= capacity || (src >= 0 && src - base == off)) src = -1;
      t.src[k] = src;
      if (src >= 0) t.buf[k] = reinterpret_cast<const Unit*>(head_base + src * stride_s)[unit];
    }
  };
  auto store = [&](std::int64_t t0, const TileRegs<Unit>& t) {
    const int base = static_cast<int>(t0 < n ? t0 : n);
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      if (t.src[k] < 0) continue;
      const int i = base + k * rows_per_pass + lane_row;  // src >= 0: i < n
      reinterpret_cast<Unit*>(head_base + i * stride_s)[unit] = t.buf[k];
    }
  };
  // Two named register sets, alternated by unrolling the loop twice (an array indexed by the
  // iteration's parity would live in local memory). `n` is uniform over the block, so every
  // thread takes the same branches and meets every barrier.
  TileRegs<Unit> a, b;
  load(0, a);
  __syncthreads();
  for (std::int64_t t0 = 0; t0 < n; t0 += 2 * tile) {
    load(t0 + tile, b);
    store(t0, a);
    __syncthreads();
    if (t0 + tile >= n) break;
    load(t0 + 2 * tile, a);
    store(t0 + tile, b);
    __syncthreads();
  }
}

// The mask follows head 0's row of each sequence in layer 0: one block per sequence, same tiling.
// With device rows (indptr null) the block also writes the sequence's new length.
__global__ void compact_mask_kernel(std::uint8_t* __restrict__ mask,  // [batch, capacity] or null
                                    std::int64_t capacity, int n_layers, int kv_heads,
                                    const std::int64_t* __restrict__ indptr,  // [B*H + 1] or null
                                    const std::int32_t* __restrict__ slots, int row_stride,
                                    std::int32_t* __restrict__ new_lengths) {  // [batch] or null
  const int b = blockIdx.x;
  const bool device_rows = indptr == nullptr;
  if (device_rows && sequence_invalid(slots, b, gridDim.x, n_layers, kv_heads, row_stride)) {
    if (threadIdx.x == 0 && new_lengths != nullptr) new_lengths[b] = -1;
    return;
  }
  const std::int64_t begin =
      device_rows ? std::int64_t{b} * kv_heads * row_stride : indptr[b * kv_heads];
  const std::int64_t n = device_rows ? row_stride : indptr[b * kv_heads + 1] - begin;
  std::uint8_t* m = mask != nullptr ? mask + b * capacity : nullptr;
  int kept = 0;
  for (std::int64_t t0 = 0; t0 < n; t0 += kThreads) {
    const std::int64_t i = t0 + threadIdx.x;
    const std::int32_t src = i < n ? slots[begin + i] : -1;
    const bool live = src >= 0 && src < capacity;
    kept += live ? 1 : 0;
    const std::uint8_t v = (live && m != nullptr) ? m[src] : 0;
    __syncthreads();
    if (live && m != nullptr) m[i] = v;
    __syncthreads();
  }
  if (new_lengths != nullptr) {
    // Rows are a live prefix then kRowEnd, so the count of live slots is the new length.
    __shared__ int total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    atomicAdd(&total, kept);
    __syncthreads();
    if (threadIdx.x == 0) new_lengths[b] = total;
  }
}

// One tensor (K or V) of every layer of the step; `t` is layer 0's view, `bases` all layers'.
template <class Unit>
void launch_rows(const TensorView& t, const StepBases& bases, int n_layers,
                 const std::int64_t* indptr, const std::int32_t* slots, int row_stride,
                 cudaStream_t stream) {
  const std::int64_t esz = static_cast<std::int64_t>(dtype_size(t.dtype));
  const int units = static_cast<int>(t.shape[3] * esz / static_cast<std::int64_t>(sizeof(Unit)));
  const int slice = std::min(units, 32);
  const std::int64_t rows = n_layers * t.shape[0] * t.shape[1];
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((units + slice - 1) / slice));
  compact_rows_kernel<Unit><<<grid, kThreads, 0, stream>>>(
      bases, t.stride[1] * esz, t.stride[2] * esz, units, slice, n_layers,
      static_cast<int>(t.shape[1]), indptr, slots, row_stride, t.shape[2]);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

// Widest access unit that divides the row, every stride and every layer's base address: 16-byte
// accesses when possible.
void launch_tensor(const TensorView& t, const StepBases& bases, int n_layers,
                   const std::int64_t* indptr, const std::int32_t* slots, int row_stride,
                   cudaStream_t stream) {
  const std::int64_t esz = static_cast<std::int64_t>(dtype_size(t.dtype));
  auto fits = [&](std::int64_t w) {
    bool ok = (t.shape[3] * esz) % w == 0 && (t.stride[0] * esz) % w == 0 &&
              (t.stride[1] * esz) % w == 0 && (t.stride[2] * esz) % w == 0;
    for (int l = 0; l < n_layers; ++l)
      ok = ok && reinterpret_cast<std::uintptr_t>(bases.base[l]) % w == 0;
    return ok;
  };
  if (fits(16)) return launch_rows<uint4>(t, bases, n_layers, indptr, slots, row_stride, stream);
  if (fits(4)) {
    return launch_rows<std::uint32_t>(t, bases, n_layers, indptr, slots, row_stride, stream);
  }
  launch_rows<std::uint16_t>(t, bases, n_layers, indptr, slots, row_stride, stream);
}

// Keys and values of every layer from device rows, then layer 0's head-0 rows into the mask and
// the new lengths.
void launch_device_rows(const StepView& step, const std::int32_t* slots, int row_stride,
                        std::int32_t* new_lengths, cudaStream_t stream) {
  const KVCacheView& kv = step.first();
  launch_tensor(kv.keys, detail::key_bases(step), step.n_layers, nullptr, slots, row_stride,
                stream);
  launch_tensor(kv.values, detail::value_bases(step), step.n_layers, nullptr, slots, row_stride,
                stream);
  if (kv.valid_mask != nullptr || new_lengths != nullptr) {
    compact_mask_kernel<<<static_cast<unsigned>(kv.batch()), kThreads, 0, stream>>>(
        kv.valid_mask, kv.capacity(), step.n_layers, static_cast<int>(kv.kv_heads()), nullptr,
        slots, row_stride, new_lengths);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

std::size_t compact_workspace_bytes(const KeepPlan& plan) {
  return align_up(plan.indptr().size() * sizeof(std::int64_t)) +
         align_up(std::max<std::size_t>(plan.slots().size(), 1) * sizeof(std::int32_t));
}

void compact(const KVCacheView& kv, const KeepPlan& plan, void* workspace,
             std::size_t workspace_bytes, cudaStream_t stream) {
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cuda,
               "cuda::compact: the cache is in host memory; use kvsift::compact");
  kv.check_separate_buffers("cuda::compact");
  plan.validate();
  plan.check_matches(kv);
  WorkspaceCarver carve(workspace, workspace_bytes, "cuda::compact");
  auto* d_indptr = carve.take<std::int64_t>(plan.indptr().size());
  auto* d_slots = carve.take<std::int32_t>(std::max<std::size_t>(plan.slots().size(), 1));
  if (plan.keeps_everything() || plan.batch() == 0) return;
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_indptr, plan.indptr().data(),
                                    plan.indptr().size() * sizeof(std::int64_t),
                                    cudaMemcpyHostToDevice, stream));
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_slots, plan.slots().data(),
                                    plan.slots().size() * sizeof(std::int32_t),
                                    cudaMemcpyHostToDevice, stream));
  const StepView one{&kv, nullptr, 1};
  launch_tensor(kv.keys, detail::key_bases(one), 1, d_indptr, d_slots, 0, stream);
  launch_tensor(kv.values, detail::value_bases(one), 1, d_indptr, d_slots, 0, stream);
  if (kv.valid_mask != nullptr) {
    compact_mask_kernel<<<static_cast<unsigned>(plan.batch()), kThreads, 0, stream>>>(
        kv.valid_mask, kv.capacity(), 1, static_cast<int>(plan.kv_heads()), d_indptr, d_slots, 0,
        nullptr);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
  for (std::int64_t b = 0; b < plan.batch(); ++b) kv.lengths[b] = plan.kept_length(b);
}

void compact_device_rows_step(const KVCacheView* layers, int n_layers, const std::int32_t* slots,
                              int row_stride, std::int32_t* new_lengths, cudaStream_t stream) {
  const char* op = "cuda::compact_device_rows_step";
  KVSIFT_CHECK(n_layers >= 1 && n_layers <= detail::kMaxStepLayers, op, ": n_layers (", n_layers,
               ") must be in [1, ", detail::kMaxStepLayers, "]");
  KVSIFT_CHECK(layers != nullptr, op, ": layers is null");
  KVSIFT_CHECK(slots != nullptr, op, ": slots is null");
  const KVCacheView& kv0 = layers[0];
  for (int l = 0; l < n_layers; ++l) {
    const KVCacheView& kv = layers[l];
    kv.validate();
    KVSIFT_CHECK(kv.device() == Device::cuda, op, ": layer ", l,
                 " is in host memory; use kvsift::compact");
    kv.check_separate_buffers(op);
    KVSIFT_CHECK(kv.keys.shape == kv0.keys.shape && kv.dtype() == kv0.dtype(), op, ": layer ", l,
                 " keys ", kv.keys.shape_string(), " ", dtype_name(kv.dtype()),
                 " differ from layer 0's ", kv0.keys.shape_string(), " ", dtype_name(kv0.dtype()));
    KVSIFT_CHECK(kv.keys.stride == kv0.keys.stride && kv.values.stride == kv0.values.stride, op,
                 ": layer ", l, " key/value strides differ from layer 0's");
    KVSIFT_CHECK(
        kv.valid_mask == kv0.valid_mask, op, ": layer ", l,
        " valid_mask differs from layer 0's (the mask is per sequence: one for all layers)");
  }
  KVSIFT_CHECK(row_stride > 0 && row_stride <= kv0.capacity(), op, ": row_stride (", row_stride,
               ") must be in [1, capacity = ", kv0.capacity(), "]");
  if (kv0.batch() == 0) return;
  launch_device_rows(StepView{layers, nullptr, n_layers}, slots, row_stride, new_lengths, stream);
}

void compact_device_rows(const KVCacheView& kv, const std::int32_t* slots, int row_stride,
                         std::int32_t* new_lengths, cudaStream_t stream) {
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cuda,
               "cuda::compact_device_rows: the cache is in host memory; use kvsift::compact");
  kv.check_separate_buffers("cuda::compact_device_rows");
  KVSIFT_CHECK(slots != nullptr, "cuda::compact_device_rows: slots is null");
  KVSIFT_CHECK(row_stride > 0 && row_stride <= kv.capacity(),
               "cuda::compact_device_rows: row_stride (", row_stride,
               ") must be in [1, capacity = ", kv.capacity(), "]");
  if (kv.batch() == 0) return;
  launch_device_rows(StepView{&kv, nullptr, 1}, slots, row_stride, new_lengths, stream);
}

}  // namespace kvsift::cuda
