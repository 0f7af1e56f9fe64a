// The tool's CUDA score runs (`kvsift score --policy rkv|skipkv --device cuda`): upload a host
// cache and its window queries, run kvsift::cuda::rkv_score / rkv_select (or the SkipKV scorer)
// and kvsift::cuda::compact, download every score tensor the CPU path would have written. Plans
// alone need none of this: a policy's select() on device views reaches the CUDA backend itself
// (demo_cuda.hpp); these runs exist for the intermediate scores the golden cases compare. The
// library never allocates; the tool, playing the engine, owns the device buffers here. Performance
// is not the point (one upload per call, synchronous): agreement with the CPU reference is.
//
// Only for builds with the CUDA backend (KVSIFT_WITH_CUDA); include it under that macro.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/cuda/sentence_scoring.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/policy/skipkv/sentence_scorer.hpp"
#include "score_rkv_run.hpp"

namespace kvsift::tool {

// Throws kvsift::Error when no CUDA device can be used, so `--device cuda` fails with one line
// instead of a failed launch later.
inline void require_cuda_device() {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  KVSIFT_CHECK(status == cudaSuccess && devices > 0,
               "--device cuda: no CUDA device present (cudaGetDeviceCount: ",
               status == cudaSuccess ? std::string("0 devices") : cudaGetErrorString(status), ")");
}

// An owning device allocation of `bytes` bytes (at least 1, so an empty tensor still has an
// address the launchers accept).
class DeviceBytes {
 public:
  explicit DeviceBytes(std::size_t bytes) : bytes_(bytes) {
    KVSIFT_CUDA_CHECK(cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes));
  }
  DeviceBytes(const void* host, std::size_t bytes) : DeviceBytes(bytes) {
    if (bytes > 0) KVSIFT_CUDA_CHECK(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
  }
  ~DeviceBytes() { cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  template <class T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t size() const { return bytes_; }
  template <class T>
  std::vector<T> download(std::size_t n) const {
    KVSIFT_CHECK(n * sizeof(T) <= bytes_, "DeviceBytes: download of ", n * sizeof(T),
                 " bytes from a buffer of ", bytes_);
    std::vector<T> host(n);
    if (n > 0)
      KVSIFT_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// The GPU R-KV's scope (rkv_scoring.hpp): queries in the keys' dtype, GQA max, max pooling,
// window mean, no sink tokens (ragged lengths are fine). Throws a kvsift::Error naming what the
// call asks for otherwise; returns the config with the tool's choice of last-match search.
//   kv       host or device [batch, kv_heads, capacity, head_dim]
//   queries  [batch, q_heads, W, head_dim]
inline RKVConfig cuda_rkv_config(const RKVConfig& r, const KVCacheView& kv,
                                 const TensorView& queries, bool fp32_search = false) {
  r.validate();
  KVSIFT_CHECK(r.sink == 0, "--device cuda: R-KV on CUDA keeps no sink tokens, the case asks for ",
               r.sink, " (use --device cpu)");
  const WindowImportanceConfig ic = r.importance_config();
  KVSIFT_CHECK(
      ic.gqa == GqaReduce::max && ic.pooling == Pooling::max && ic.reduction == WindowReduce::mean,
      "--device cuda: R-KV on CUDA supports only GQA max, max pooling and window mean "
      "(use --device cpu)");
  KVSIFT_CHECK(queries.dtype == kv.dtype(),
               "--device cuda: R-KV on CUDA needs queries in the "
               "keys' dtype, got queries ",
               dtype_name(queries.dtype), " and keys ", dtype_name(kv.dtype()),
               " (use --device cpu)");
  RKVConfig c = r;
  c.tensor_core_search = !fp32_search;
  return c;
}

// A host cache and its queries mirrored on the device, with the host lengths the device view uses
// (cuda::compact rewrites them).
struct DeviceRKVInputs {
  DeviceBytes keys, values, queries, mask;
  std::vector<std::int32_t> lengths;
  KVCacheView kv;
  TensorView q;

  //   host_kv       contiguous host [batch, kv_heads, capacity, head_dim]
  //   host_queries  contiguous host [batch, q_heads, W, head_dim]
  DeviceRKVInputs(const KVCacheView& host_kv, const TensorView& host_queries)
      : keys(host_kv.keys.data, bytes_of(host_kv.keys)),
        values(host_kv.values.data, bytes_of(host_kv.values)),
        queries(host_queries.data, bytes_of(host_queries)),
        mask(host_kv.valid_mask,
             host_kv.valid_mask == nullptr ? 0 : host_kv.batch() * host_kv.capacity()),
        lengths(host_kv.lengths, host_kv.lengths + host_kv.batch()) {
    kv = make_kv_cache_view(keys.get(), values.get(), host_kv.dtype(), Device::cuda,
                            host_kv.batch(), host_kv.kv_heads(), host_kv.capacity(),
                            host_kv.head_dim(), lengths.data(),
                            host_kv.valid_mask == nullptr ? nullptr : mask.get<std::uint8_t>());
    q = TensorView::contiguous(queries.get(), host_queries.dtype, Device::cuda,
                               {host_queries.shape[0], host_queries.shape[1], host_queries.shape[2],
                                host_queries.shape[3]});
  }

  static std::size_t bytes_of(const TensorView& t) {
    KVSIFT_CHECK(t.device == Device::cpu && t.is_contiguous(),
                 "--device cuda: the tool uploads contiguous host tensors, got [", t.shape_string(),
                 "]");
    return static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype);
  }
};

// The device buffers both GPU score paths write, sized for `run`'s shape and `budget`:
//   score, importance  [batch, kv_heads, S − W] fp32;  redundancy [batch, kv_heads, S] fp32
//   slots              [batch, kv_heads, budget] int32
struct DeviceScores {
  DeviceBytes score, importance, redundancy, slots;
  DeviceScores(const RKVRun& run, int budget)
      : score(run.batch * run.kv_heads * run.candidates() * sizeof(float)),
        importance(run.batch * run.kv_heads * run.candidates() * sizeof(float)),
        redundancy(run.batch * run.kv_heads * run.seq * sizeof(float)),
        slots(run.batch * run.kv_heads * budget * sizeof(std::int32_t)) {}
  cuda::RKVScoreOutputs outputs() {
    return {score.get<float>(), importance.get<float>(), redundancy.get<float>()};
  }
};

// What both GPU score paths do once the slots are selected: the KeepPlan, cuda::compact on the
// device cache, then every output downloaded into `run` (R with the window sliced off, §1.2
// step 5, as the CPU path reports it).
inline void finish_cuda_run(RKVRun& run, DeviceRKVInputs& dev, DeviceScores& out, int budget,
                            int window, cudaStream_t stream) {
  const std::int64_t rows = run.batch * run.kv_heads, n = run.candidates();
  run.plan =
      cuda::download_keep_plan(dev.kv, out.slots.get<std::int32_t>(), budget, window, stream);
  run.plan.validate();
  DeviceBytes compact_ws(cuda::compact_workspace_bytes(run.plan));
  cuda::compact(dev.kv, run.plan, compact_ws.get(), compact_ws.size(), stream);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  run.importance = out.importance.download<float>(rows * n);
  run.score = out.score.download<float>(rows * n);
  run.redundancy_full = out.redundancy.download<float>(rows * run.seq);
  run.redundancy.resize(static_cast<std::size_t>(rows * n));
  for (std::int64_t r = 0; r < rows; ++r)
    std::copy_n(run.redundancy_full.begin() + r * run.seq, n, run.redundancy.begin() + r * n);
  run.keys = dev.keys.download<std::uint8_t>(dev.keys.size());
  run.values = dev.values.download<std::uint8_t>(dev.values.size());
}

// `kvsift score --policy rkv --device cuda`: the same RKVRun as run_rkv_cpu(), computed on the GPU.
//   kv       contiguous host [batch, kv_heads, S, head_dim], every sequence S tokens
//   queries  contiguous host [batch, q_heads, W, head_dim] in the keys' dtype
inline RKVRun run_rkv_cuda(const KVCacheView& kv, const TensorView& queries, const RKVConfig& cfg,
                           bool fp32_search = false) {
  check_rkv_run_inputs(kv, queries, cfg);
  const RKVConfig c = cuda_rkv_config(cfg, kv, queries, fp32_search);
  require_cuda_device();
  RKVRun run = shaped_run(kv, cfg.window);
  DeviceRKVInputs dev(kv, queries);
  DeviceScores out(run, c.budget);
  DeviceBytes workspace(cuda::rkv_workspace_bytes(dev.kv, dev.q, c));
  cudaStream_t stream = nullptr;  // the legacy default stream: every call below is ordered

  cuda::rkv_score(dev.kv, dev.q, c, out.outputs(), workspace.get(), workspace.size(), stream);
  run.compressed = cuda::rkv_select(dev.kv, dev.q, c, out.slots.get<std::int32_t>(), nullptr,
                                    workspace.get(), workspace.size(), stream);
  finish_cuda_run(run, dev, out, c.budget, c.window, stream);
  return run;
}

// `kvsift score --policy skipkv --device cuda`: SkipKV eq. 6 (docs/algorithms.md §2.4) on the GPU
// (kvsift::cuda::skipkv_score / skipkv_select, sentence_scoring.hpp), then cuda::compact; the same
// tensors as SentenceScorer::scores / select on the CPU. `redundancy` is R with the window sliced.
//   kv         contiguous host [batch, kv_heads, S, head_dim], every sequence S tokens
//   queries    contiguous host [batch, q_heads, W, head_dim] in the keys' dtype
//   penalties  [batch * kv_heads] penalty ranges per (b, h) row, or empty: none
inline RKVRun run_skipkv_cuda(const KVCacheView& kv, const TensorView& queries,
                              const SentenceScorerConfig& sc, const SentencePenalties& penalties,
                              bool fp32_search = false) {
  sc.validate();
  const RKVConfig r = sc.rkv;
  check_rkv_run_inputs(kv, queries, r);
  SentenceScorerConfig c = sc;
  c.rkv.tensor_core_search = cuda_rkv_config(r, kv, queries, fp32_search).tensor_core_search;
  require_cuda_device();
  RKVRun run = shaped_run(kv, sc.rkv.window);
  DeviceRKVInputs dev(kv, queries);
  const cuda::SentencePenaltyCsr csr = cuda::build_penalty_csr(penalties, run.batch, run.kv_heads);
  DeviceBytes penalty_ws(cuda::sentence_penalty_workspace_bytes(csr));
  cudaStream_t stream = nullptr;
  const cuda::SentencePenaltiesDevice dev_penalties =
      cuda::upload_sentence_penalties(csr, penalty_ws.get(), penalty_ws.size(), stream);
  DeviceScores out(run, c.rkv.budget);
  DeviceBytes workspace(cuda::skipkv_workspace_bytes(dev.kv, dev.q, c));

  cuda::skipkv_score(dev.kv, dev.q, c, dev_penalties, out.outputs(), workspace.get(),
                     workspace.size(), stream);
  run.compressed =
      cuda::skipkv_select(dev.kv, dev.q, c, dev_penalties, out.slots.get<std::int32_t>(), nullptr,
                          workspace.get(), workspace.size(), stream);
  finish_cuda_run(run, dev, out, c.rkv.budget, c.rkv.window, stream);
  return run;
}

}  // namespace kvsift::tool
