// SkipKV eq. 6 on the GPU (docs/algorithms.md §2.4): the R-KV score from rkv_score(), minus the
// sentence penalty, with faithful pads pinned to +100, then the §1.3 selection of select_topk.cu.
// Only the penalty/pad pass is new device code; the CSR of penalty ranges is built and validated
// on the host.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <type_traits>
#include <vector>

#include "batch_runs.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/sentence_scoring.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "rkv_kernels.cuh"

namespace kvsift::cuda {

// The device reads PenaltyRange as the host lays it out (memcpy of SegmentTable's own struct).
static_assert(std::is_trivially_copyable<PenaltyRange>::value &&
                  std::is_standard_layout<PenaltyRange>::value,
              "PenaltyRange must be copyable to the device byte for byte");

namespace detail {
namespace {

constexpr int kPerThread = 4;                      // score elements each thread holds
constexpr int kTile = kBlockThreads * kPerThread;  // score elements per block

// One block per (tile of kTile candidates, h, b). Each chunk of up to kBlockThreads ranges of the
// row is filtered (mapped: lo < hi < S, as add_sentence_penalty() tests it; clipped to the tile
// and to the n candidates before the window) and compacted into shared memory in CSR order, then
// every thread subtracts the surviving λ's from its own elements in that order: one token covered
// by several ranges sees exactly the CPU's sequence of fp32 subtractions. No two threads ever
// write one element, and only ranges that touch the tile cost per-element work.
__global__ void __launch_bounds__(kBlockThreads)
    sentence_penalty_kernel(float* __restrict__ score,  // [batch, kv_heads, pitch], n used
                            const std::int64_t* __restrict__ indptr,    // [rows + 1] or nullptr
                            const PenaltyRange* __restrict__ ranges,    // [indptr[rows]]
                            const std::uint8_t* __restrict__ pad_mask,  // [batch, capacity] or
                                                                        // nullptr: no +100 pass
                            std::int64_t capacity, int kv_heads, int n, int length,
                            std::int64_t pitch) {
  using Scan = cub::BlockScan<int, kBlockThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hit_lo[kBlockThreads];
  __shared__ int hit_stop[kBlockThreads];
  __shared__ float hit_lambda[kBlockThreads];

  const int b = blockIdx.z, h = blockIdx.y;
  const std::int64_t row = static_cast<std::int64_t>(b) * kv_heads + h;
  const int tile_begin = blockIdx.x * kTile;
  const int tile_end = min(n, tile_begin + kTile);
  float* sc = score + row * pitch;

  float v[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int t = tile_begin + k * kBlockThreads + threadIdx.x;
    v[k] = t < tile_end ? sc[t] : 0.0f;
  }

  if (indptr != nullptr) {
    const std::int64_t first = indptr[row], last = indptr[row + 1];
    for (std::int64_t c0 = first; c0 < last; c0 += kBlockThreads) {  // uniform bounds
      const std::int64_t i = c0 + threadIdx.x;
      int lo = 0, stop = 0;
      float lambda = 0.0f;
      if (i < last) {
        const PenaltyRange r = ranges[i];
        if (r.lo >= 0 && r.lo < r.hi && r.hi < length) {
          lo = static_cast<int>(max(static_cast<std::int64_t>(tile_begin), r.lo));
          stop = static_cast<int>(min(static_cast<std::int64_t>(tile_end), r.hi + 1));
          lambda = r.lambda;
        }
      }
      const int hits = lo < stop ? 1 : 0;
      int pos, count;
      Scan(scan_tmp).ExclusiveSum(hits, pos, count);
      if (hits) {
        hit_lo[pos] = lo;
        hit_stop[pos] = stop;
        hit_lambda[pos] = lambda;
      }
      __syncthreads();
      for (int m = 0; m < count; ++m) {
        const int rlo = hit_lo[m], rstop = hit_stop[m];
        const float lam = hit_lambda[m];
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) {
          const int t = tile_begin + k * kBlockThreads + threadIdx.x;
          if (t >= rlo && t < rstop) v[k] -= lam;
        }
      }
      __syncthreads();  // hit_* and scan_tmp are rewritten by the next chunk
    }
  }

  const std::uint8_t* vm = pad_mask != nullptr ? pad_mask + b * capacity : nullptr;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int t = tile_begin + k * kBlockThreads + threadIdx.x;
    if (t >= tile_end) continue;
    // The reference replaces a pad's score (penalty included) by +100.
    sc[t] = (vm != nullptr && vm[t] == 0) ? kSkipKVPadScore : v[k];
  }
}

// The penalty/pad pass over `batch` sequences of `length` tokens whose score rows are `pitch`
// floats apart; `penalties` and `pad_mask` start at the first of them.
void launch_sentence_penalty(float* score, const SentencePenaltiesDevice& penalties,
                             const std::uint8_t* pad_mask, std::int64_t capacity, int batch,
                             int kv_heads, int n, int length, std::int64_t pitch,
                             cudaStream_t stream) {
  const bool any_penalty = penalties.indptr != nullptr && penalties.count > 0;
  if ((!any_penalty && pad_mask == nullptr) || batch == 0 || n == 0) return;
  const dim3 grid(static_cast<unsigned>((n + kTile - 1) / kTile), static_cast<unsigned>(kv_heads),
                  static_cast<unsigned>(batch));
  sentence_penalty_kernel<<<grid, kBlockThreads, 0, stream>>>(
      score, any_penalty ? penalties.indptr : nullptr, penalties.ranges, pad_mask, capacity,
      kv_heads, n, length, pitch);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

struct Shape {
  std::int64_t batch = 0, kv_heads = 0, window = 0;
  std::int64_t length = 0;            // S = max_b S_b: the pitch of the score rows
  std::vector<std::int32_t> lengths;  // [batch] S_b
  RKVConfig rkv;                      // the R-KV part of the score (cfg.rkv)
  std::int64_t rows() const { return batch * kv_heads; }
  std::int64_t n() const { return length > window ? length - window : 0; }
};

// The checks of this layer, before rkv_* repeat theirs (their messages name rkv_*): a config
// the kernels implement, device memory, penalties built for this cache's rows.
Shape check_call(const KVCacheView& kv, const SentenceScorerConfig& cfg,
                 const SentencePenaltiesDevice& penalties, const char* op) {
  cfg.validate();
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cuda, op, ": the cache is in host memory (device ",
               device_name(kv.device()), "); use the CPU SentenceScorer");
  Shape s;
  s.rkv = cfg.rkv;
  check_cuda_rkv_config(s.rkv, op);
  s.batch = kv.batch();
  s.kv_heads = kv.kv_heads();
  s.window = cfg.rkv.window;
  s.lengths.assign(kv.lengths, kv.lengths + kv.batch());
  for (std::int32_t len : s.lengths) s.length = std::max<std::int64_t>(s.length, len);
  if (penalties.indptr != nullptr) {
    KVSIFT_CHECK(penalties.batch == s.batch && penalties.kv_heads == s.kv_heads, op,
                 ": penalties were built for batch=", penalties.batch,
                 ", kv_heads=", penalties.kv_heads, " but the cache has batch=", s.batch,
                 ", kv_heads=", s.kv_heads);
    KVSIFT_CHECK(penalties.count >= 0 && (penalties.count == 0 || penalties.ranges != nullptr), op,
                 ": penalties hold ", penalties.count, " ranges but no range pointer");
  }
  return s;
}

// Layout: [own score buffer | rkv workspace]. The own part is a multiple of kWorkspaceAlign, so
// the R-KV part stays as aligned as the caller's base. Both are sized for the whole batch at
// S = max_b S_b, which bounds what every run of equal lengths needs.
std::size_t own_bytes(const Shape& s) {
  return align_up(static_cast<std::size_t>(s.rows() * s.n()) * sizeof(float));
}

// Checks the whole workspace up front (nothing is enqueued on failure) and returns the pieces.
float* carve(const Shape& s, const KVCacheView& kv, const TensorView& queries, void* workspace,
             std::size_t workspace_bytes, const char* op, void** rkv_ws, std::size_t* rkv_bytes) {
  const std::size_t need = own_bytes(s) + rkv_workspace_bytes(kv, queries, s.rkv);
  KVSIFT_CHECK(workspace != nullptr || need == 0, op, ": workspace is null but ", need,
               " bytes are needed");
  KVSIFT_CHECK(workspace_bytes >= need, op, ": workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  *rkv_ws = static_cast<char*>(workspace) + own_bytes(s);
  *rkv_bytes = workspace_bytes - own_bytes(s);
  return static_cast<float*>(workspace);
}

// The penalties of the run's rows: indptr holds absolute offsets into `ranges`, so shifting it
// is enough.
SentencePenaltiesDevice run_penalties(const SentencePenaltiesDevice& p, const LengthRun& r) {
  SentencePenaltiesDevice q = p;
  q.batch = r.count;
  if (p.indptr != nullptr) q.indptr = p.indptr + r.first * p.kv_heads;
  return q;
}

// The penalty and pad pass of every run over scores laid out with `pitch` floats per row.
void enqueue_penalties(const KVCacheView& kv, const SentenceScorerConfig& cfg,
                       const SentencePenaltiesDevice& penalties, const Shape& s, float* score,
                       std::int64_t pitch, cudaStream_t stream) {
  const bool faithful = cfg.pad_mode == PadMode::faithful;
  for (const LengthRun& r : equal_length_runs(s.lengths.data(), s.batch)) {
    const KVCacheView run_kv = batch_slice(kv, r.first, r.count);
    launch_sentence_penalty(score + r.first * s.kv_heads * pitch, run_penalties(penalties, r),
                            faithful ? run_kv.valid_mask : nullptr, kv.capacity(),
                            static_cast<int>(r.count), static_cast<int>(s.kv_heads),
                            static_cast<int>(r.length - s.window), static_cast<int>(r.length),
                            pitch, stream);
  }
}

}  // namespace
}  // namespace detail

SentencePenaltyCsr build_penalty_csr(const std::vector<std::vector<PenaltyRange>>& penalties,
                                     std::int64_t batch, std::int64_t kv_heads) {
  KVSIFT_CHECK(batch >= 0 && kv_heads >= 1, "build_penalty_csr: batch (", batch,
               ") must be >= 0 and kv_heads (", kv_heads, ") >= 1");
  const std::int64_t rows = batch * kv_heads;
  const std::int64_t lists = static_cast<std::int64_t>(penalties.size());
  KVSIFT_CHECK(lists == 0 || lists == rows, "build_penalty_csr: penalties has ", lists,
               " lists, expected 0 or batch * kv_heads = ", batch, " * ", kv_heads,
               " (one per (b, h) of the cache)");
  SentencePenaltyCsr csr;
  csr.batch = batch;
  csr.kv_heads = kv_heads;
  csr.indptr.assign(static_cast<std::size_t>(rows + 1), 0);
  for (std::int64_t r = 0; r < lists; ++r) {
    const std::int64_t b = r / kv_heads, h = r % kv_heads;
    std::int64_t i = 0;
    for (const PenaltyRange& p : penalties[r]) {
      KVSIFT_CHECK(p.lo >= 0 && p.lo <= p.hi, "build_penalty_csr: range ", i, " [", p.lo, ", ",
                   p.hi, "] of (b=", b, ", h=", h, ") must have 0 <= lo <= hi");
      KVSIFT_CHECK(std::isfinite(p.lambda), "build_penalty_csr: range ", i, " [", p.lo, ", ", p.hi,
                   "] of (b=", b, ", h=", h, ") has non-finite lambda ", p.lambda);
      csr.ranges.push_back(p);
      ++i;
    }
    csr.indptr[r + 1] = static_cast<std::int64_t>(csr.ranges.size());
  }
  for (std::int64_t r = lists; r < rows; ++r) csr.indptr[r + 1] = csr.indptr[r];
  return csr;
}

namespace {
void check_csr(const SentencePenaltyCsr& csr, const char* op) {
  KVSIFT_CHECK(csr.batch >= 0 && csr.kv_heads >= 1, op, ": csr batch (", csr.batch,
               ") must be >= 0 and kv_heads (", csr.kv_heads, ") >= 1");
  const std::int64_t rows = csr.batch * csr.kv_heads;
  KVSIFT_CHECK(static_cast<std::int64_t>(csr.indptr.size()) == rows + 1, op, ": csr indptr has ",
               csr.indptr.size(), " entries, expected batch * kv_heads + 1 = ", rows + 1);
  KVSIFT_CHECK(
      csr.indptr[0] == 0 && csr.indptr[rows] == static_cast<std::int64_t>(csr.ranges.size()), op,
      ": csr indptr runs from ", csr.indptr[0], " to ", csr.indptr[rows], " over ",
      csr.ranges.size(), " ranges");
  for (std::int64_t r = 0; r < rows; ++r)
    KVSIFT_CHECK(csr.indptr[r] <= csr.indptr[r + 1], op, ": csr indptr decreases at row ", r, " (",
                 csr.indptr[r], " > ", csr.indptr[r + 1], ")");
}
}  // namespace

std::size_t sentence_penalty_workspace_bytes(const SentencePenaltyCsr& csr) {
  check_csr(csr, "sentence_penalty_workspace_bytes");
  if (csr.ranges.empty()) return 0;  // uploaded as "no penalties"
  return align_up(csr.indptr.size() * sizeof(std::int64_t)) +
         align_up(csr.ranges.size() * sizeof(PenaltyRange));
}

SentencePenaltiesDevice upload_sentence_penalties(const SentencePenaltyCsr& csr, void* workspace,
                                                  std::size_t workspace_bytes,
                                                  cudaStream_t stream) {
  check_csr(csr, "upload_sentence_penalties");
  SentencePenaltiesDevice d;
  d.batch = csr.batch;
  d.kv_heads = csr.kv_heads;
  if (csr.ranges.empty()) return d;  // indptr == nullptr: nothing to subtract
  WorkspaceCarver carve(workspace, workspace_bytes, "upload_sentence_penalties");
  std::int64_t* indptr = carve.take<std::int64_t>(csr.indptr.size());
  PenaltyRange* ranges = carve.take<PenaltyRange>(csr.ranges.size());
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(indptr, csr.indptr.data(),
                                    csr.indptr.size() * sizeof(std::int64_t),
                                    cudaMemcpyHostToDevice, stream));
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(ranges, csr.ranges.data(),
                                    csr.ranges.size() * sizeof(PenaltyRange),
                                    cudaMemcpyHostToDevice, stream));
  d.count = static_cast<std::int64_t>(csr.ranges.size());
  d.indptr = indptr;
  d.ranges = ranges;
  return d;
}

std::size_t skipkv_workspace_bytes(const KVCacheView& kv, const TensorView& queries,
                                   const SentenceScorerConfig& cfg) {
  const detail::Shape s = detail::check_call(kv, cfg, {}, "skipkv_workspace_bytes");
  return detail::own_bytes(s) + rkv_workspace_bytes(kv, queries, s.rkv);
}

void skipkv_score(const KVCacheView& kv, const TensorView& queries, const SentenceScorerConfig& cfg,
                  const SentencePenaltiesDevice& penalties, const RKVScoreOutputs& out,
                  void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  const detail::Shape s = detail::check_call(kv, cfg, penalties, "skipkv_score");
  KVSIFT_CHECK(out.score != nullptr, "skipkv_score: out.score must be a device pointer, got null");
  if (s.batch == 0) return;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    KVSIFT_CHECK(s.lengths[b] > s.window, "skipkv_score: lengths[", b, "] (", s.lengths[b],
                 ") must exceed the window (", s.window, ")");
  }
  void* rkv_ws = nullptr;
  std::size_t rkv_bytes = 0;
  detail::carve(s, kv, queries, workspace, workspace_bytes, "skipkv_score", &rkv_ws, &rkv_bytes);
  rkv_score(kv, queries, s.rkv, out, rkv_ws, rkv_bytes, stream);  // ragged: pitched rows
  detail::enqueue_penalties(kv, cfg, penalties, s, out.score, s.n(), stream);
}

bool skipkv_select(const KVCacheView& kv, const TensorView& queries,
                   const SentenceScorerConfig& cfg, const SentencePenaltiesDevice& penalties,
                   std::int32_t* slots, float* scores, void* workspace, std::size_t workspace_bytes,
                   cudaStream_t stream) {
  using namespace detail;
  const Shape s = check_call(kv, cfg, penalties, "skipkv_select");
  KVSIFT_CHECK(slots != nullptr, "skipkv_select: slots must be a device pointer, got null");
  if (s.batch == 0) return false;
  const int budget = cfg.rkv.budget, heads = static_cast<int>(s.kv_heads);
  // docs/algorithms.md §1.3: a sequence at or below the budget evicts nothing and is not scored.
  const bool any_over = s.length > budget;
  void* rkv_ws = nullptr;
  std::size_t rkv_bytes = 0;
  float* own_score = nullptr;
  if (any_over) {
    own_score =
        carve(s, kv, queries, workspace, workspace_bytes, "skipkv_select", &rkv_ws, &rkv_bytes);
  }
  const bool faithful = cfg.pad_mode == PadMode::faithful;
  const std::vector<LengthRun> runs = equal_length_runs(s.lengths.data(), s.batch);
  const bool whole = runs.size() == 1;  // the common equal-length batch: scores go straight out
  for (const LengthRun& r : runs) {
    const std::int64_t row0 = r.first * s.kv_heads;
    if (r.length <= budget) {
      launch_keep_all_slots(static_cast<int>(r.count * s.kv_heads), r.length, budget,
                            slots + row0 * budget, stream);
      continue;
    }
    const KVCacheView run_kv = batch_slice(kv, r.first, r.count);
    const TensorView run_q = batch_slice(queries, r.first, r.count);
    const std::int64_t n = r.length - s.window;
    RKVScoreOutputs out;
    out.score = (whole && scores != nullptr) ? scores : own_score;  // packed rows of n
    rkv_score(run_kv, run_q, s.rkv, out, rkv_ws, rkv_bytes, stream);
    launch_sentence_penalty(out.score, run_penalties(penalties, r),
                            faithful ? run_kv.valid_mask : nullptr, kv.capacity(),
                            static_cast<int>(r.count), heads, static_cast<int>(n),
                            static_cast<int>(r.length), n, stream);
    // Faithful pads are ordinary candidates at +100 (kept first, counted); excluded ones are
    // masked.
    launch_select_topk(out.score, faithful ? nullptr : run_kv.valid_mask, static_cast<int>(r.count),
                       static_cast<int>(r.count), heads, kv.capacity(), r.length, budget, s.window,
                       slots + row0 * budget, stream);
    if (!whole && scores != nullptr && n > 0) {
      KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(
          scores + row0 * s.n(), static_cast<std::size_t>(s.n()) * sizeof(float), out.score,
          static_cast<std::size_t>(n) * sizeof(float), static_cast<std::size_t>(n) * sizeof(float),
          static_cast<std::size_t>(r.count * s.kv_heads), cudaMemcpyDeviceToDevice, stream));
    }
  }
  return any_over;
}

}  // namespace kvsift::cuda
