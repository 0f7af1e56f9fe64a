// kvsift::cuda::DeviceThinKV: the whole ThinKV pipeline (docs/algorithms.md §3) for a batch of
// sequences whose K/V never leave the device — append into the paged tables with 16-bit staging
// and groups quantized on the device with fresh scales (§3.2, §3.4), the step's attention
// sparsity over the resident keys as stored (§3.1), Rule 1 / Rule 2 demotions with k-means
// survivors chosen on the device (§3.3), and gather-free decode attention (§3.4).
//
// Division of labour (docs/thinkv.md §9): the host keeps what is metadata — per sequence a
// ThinKVSchedule (classifier, TBE), per layer a metadata-only ThoughtBlockTable that places every
// token — and the device keeps every K/V byte (one DevicePagedTable per layer, all sequences
// sharing its pools). The host downloads only the L* layers' sparsities (their means over query
// heads, [batch] floats per layer and step, collected asynchronously and read once per refresh
// interval) and, when TBE demotes a segment, the k-means survivors' indices. The
// decisions are those of the CPU pipeline (ThinKV) by construction — the same schedule, the same
// placement rule, keys decoded with the CPU's codec, sparsities and k-means computed bit for bit
// as on the CPU — and tests/cuda/test_thinkv_pipeline_cuda.cpp checks it: block codes
// bit-identical, the same survivors, attention within the golden tolerance.
//
// Memory (the kvsift::cuda convention: the engine allocates, kvsift carves): memory_bytes()
// says how much device memory the pipeline needs for `batch` sequences — every layer's table
// (each with `pool_blocks · batch` blocks per format pool: the per-sequence capacity of the CPU
// pipeline, shared) plus a bounded scratch — and the constructor takes that one buffer.
// attention() takes its own workspace (attention_workspace_bytes), as the other decode kernels.
//
// All calls enqueue on the stream given at construction; end_step() waits for it only at a step
// closing a refresh interval and when TBE demotes. The first append of a decode step starts the
// host-side placement of the step's token in every layer (place_step: the host tables, the
// device mirror's recording and its append plan packed in pinned memory), on background threads
// at large batches, so the engine's own host work between the layers hides it and each layer's
// append() is one copy and its launches.
// Limits (kvsift::Error at construction): refresh <= 128 tokens per segment, head_dim <= 256 and
// retention targets <= 64 (the device k-means' limits), no prompt eviction (a prompt may exceed
// 128 tokens), staging in bf16 (cuda::PagedStaging). Either refill rule (run, regroup).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/config/thinkv_config.hpp"
#include "kvsift/paged/thought_block_table.hpp"
#include "kvsift/policy/thinkv/thinkv_schedule.hpp"

namespace kvsift::cuda {

class DeviceThinKV {
 public:
  // Device bytes the pipeline needs for `batch` sequences under `config` (validated).
  static std::size_t memory_bytes(const ThinKVConfig& config, std::int32_t batch);

  // memory: device, memory_bytes(config, batch) bytes, 256-byte aligned. Initialises the tables
  // on `stream` (no wait).
  DeviceThinKV(const ThinKVConfig& config, std::int32_t batch, void* memory,
               std::size_t memory_bytes, cudaStream_t stream);
  ~DeviceThinKV();                             // awaits a step's background placement
  DeviceThinKV(const DeviceThinKV&) = delete;  // the placers hold `this`
  DeviceThinKV& operator=(const DeviceThinKV&) = delete;

  const ThinKVConfig& config() const { return config_; }
  std::int32_t batch() const { return batch_; }
  cudaStream_t stream() const { return stream_; }

  // --- prompt ----------------------------------------------------------------------------------
  // n prompt tokens of every sequence for one layer (segment 0, protected), before decoding.
  //   keys, values  device [batch, kv_heads, n, head_dim], f32 or bf16, contiguous
  void prefill(int layer, const void* keys, const void* values, DType dtype, std::int64_t n);

  // --- one decode step -------------------------------------------------------------------------
  // The step's token of every sequence for one layer, typed by each sequence's label.
  //   keys, values  device [batch, kv_heads, head_dim] (or [batch, kv_heads, 1, head_dim]),
  //                 f32 or bf16, contiguous
  void append(int layer, const void* keys, const void* values, DType dtype);
  // Whether `layer` is in L*.
  bool needs_sparsity(int layer) const;
  // The step's sparsity of an L* layer from its queries against the resident keys as stored
  // (ThinKV::observe_query); call it after append(). Returns false, doing nothing, outside L*.
  //   queries device [batch, q_heads, head_dim] f32 post-RoPE
  bool observe_query(int layer, const float* queries);
  // Closes the step for every sequence (every layer appended, every L* layer observed): labels,
  // TBE, and each demotion applied to every (layer, KV head) as eviction bits on the host table
  // and the device table. The step's sparsities are copied to the host asynchronously; only the
  // step that closes a refresh interval waits for them and reports the interval's steps to the
  // classifiers (a step's label is its interval's, §3.1), throwing if one of them was NaN (no
  // resident key, non-finite queries), naming that step. It waits again for the survivors when
  // TBE acts. Returns TBE's step of each sequence, [batch].
  std::vector<EvictionStep> end_step();

  // --- attention -------------------------------------------------------------------------------
  // Both bring the layer's device page tables up to date first (page_tables()).
  std::size_t attention_workspace_bytes(int layer) const;
  // Gather-free paged decode attention (cuda::paged_decode_attention_batch), softmax scale
  // 1/sqrt(head_dim). queries, out: device [batch, q_heads, head_dim] f32
  void attention(int layer, const float* queries, float* out, void* workspace,
                 std::size_t workspace_bytes) const;

  // Host threads that place a decode step's tokens in the background (place_step): 0 places them
  // on the calling thread at the step's first append; by default none below 4,096
  // sequence-layers per step, else up to 4 (and the machine's cores).
  void set_placement_threads(int threads);

  // --- state -----------------------------------------------------------------------------------
  const ThinKVSchedule& schedule(std::int32_t seq) const;
  std::int64_t steps() const { return schedules_[0].steps(); }
  std::int32_t length() const;  // tokens appended per sequence (prompt + decode)
  // The layer's placement (metadata only) and its device mirror (the data).
  const ThoughtBlockTable& table(int layer) const;
  const DevicePagedTable& device_table(int layer) const;
  // The layer's page tables of all sequences in the pipeline's own device memory, uploaded (on
  // the stream) only when a block was taken or freed since the last upload
  // (DevicePagedTable::page_version): the attention and the sparsity read them, so a step
  // without block changes walks no page table. Requires the layer's append to be written.
  const PagedBatch& page_tables(int layer) const;
  // Memory as ThinKV reports it, summed over layers (block_bytes.hpp): the device tables' bytes,
  // and an fp16 FullKV of every sequence's tokens.
  TableBytes resident_bytes() const;
  std::int64_t fullkv_fp16_bytes() const;

 private:
  struct Problem;         // one demoted segment of one (sequence, layer, KV head)
  struct LayerDemotions;  // one layer's demotions through end_step's stages
  void check_layer(int layer, const char* fn) const;
  // Throws, naming the layer, unless its pool can take tokens_per_sequence tokens of every
  // sequence whatever their blocks' room.
  void check_pool(int layer, std::int64_t tokens_per_sequence, const char* fn) const;
  void record_tokens(int layer, std::int64_t tokens_per_sequence, const char* fn);
  // The step's placement of every layer not placed yet — segment openings and one token per
  // sequence in the layer's metadata table and device mirror; no K/V needed — started at the
  // step's first append for all layers: on the calling thread, or on placement_threads()
  // background threads while the engine runs its layers (each layer's table is its own, so the
  // result is the serial one). Every call that reads a layer's table awaits its placement.
  void place_step(const char* fn);
  void place_layer(int layer, const char* fn);
  // The layer's page tables walked and packed for page_tables() to copy, when a block was taken
  // or freed since they were last packed (DevicePagedTable::page_version).
  void pack_page_tables(int layer) const;
  int placement_threads() const;
  void await_layer(int layer) const;  // rethrows the layer's placement error
  void finish_placement() const;      // awaits every layer and joins the threads
  // end_step's demotions, per layer (docs/thinkv.md §9): the problems listed, their survivors
  // selected on the device (enqueued, copied to pinned memory), the evictions derived from them,
  // then applied to both tables' host bookkeeping and enqueued on the device.
  void demote(const std::vector<EvictionStep>& steps);
  void layer_problems(int layer, const std::vector<EvictionStep>& steps, LayerDemotions& d) const;
  void select_survivors(int layer);
  void layer_evictions(int layer);

  ThinKVConfig config_;
  std::int32_t batch_;
  cudaStream_t stream_;
  std::vector<ThinKVSchedule> schedules_;  // [batch]
  std::vector<ThoughtBlockTable> tables_;  // [num_layers] metadata only
  std::vector<DevicePagedTable> devices_;  // [num_layers]
  float* sparsity_ = nullptr;              // device [L*, batch, q_heads] this step's sparsities
  float* means_ = nullptr;                 // device [L*, batch] their means over query heads
  float* logits_ = nullptr;                // device [batch, q_heads, logit_slots_] scratch
  std::int64_t logit_slots_ = 0;
  std::vector<int> observed_;                       // L* layers observed this step, in order
  std::vector<char> placed_;                        // [num_layers] this step's placement started
  std::vector<char> step_opens_;                    // [num_layers, batch] the step opens a segment
  std::vector<ThoughtType> step_labels_;            // [batch] the step's label
  mutable std::vector<std::future<void>> placing_;  // [num_layers] valid: placed in background
  mutable std::vector<std::thread> placers_;
  int placement_threads_ = -1;  // set_placement_threads; -1 chooses
  struct FreeHost {
    void operator()(float* p) const { cudaFreeHost(p); }
  };
  // Pinned host [refresh, L*, batch]: the means of the interval's steps, slot k = its k-th step.
  std::unique_ptr<float[], FreeHost> host_means_;
  std::int64_t means_per_step_ = 0;               // L* · batch
  std::vector<std::vector<int>> pending_layers_;  // the interval's steps so far: layers observed
  std::uint8_t* scratch_ = nullptr;               // device, scratch_bytes_
  std::size_t scratch_bytes_ = 0;
  std::vector<LayerDemotions> demotions_;  // [num_layers]
  PinnedUpload chunk_uploads_[2];          // k-means chunks' sources and descriptors, alternating
  std::size_t next_upload_ = 0;            // which of them the next chunk fills
  struct PageTables {  // one layer's page tables
    PagedBatch view;
    std::uint64_t version = 0;
    bool current = false;
    std::uint8_t* memory = nullptr;   // device, page_bytes_
    std::vector<std::uint8_t> image;  // paged_batch_image's bytes
    PinnedUpload upload;              // ... packed for the copy to `memory`
    std::size_t copy_bytes = 0;       // > 0: packed and not copied yet
  };
  mutable std::vector<PageTables> pages_;  // [num_layers]
  std::size_t page_bytes_ = 0;
};

}  // namespace kvsift::cuda
