// Device memory of one cuda::DevicePagedTable for the GPU tests, poisoned so that anything the
// kernels fail to write (or read without writing) shows up, plus the checks that compare the
// mirror with the CPU ThoughtBlockTable it follows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/paged/thought_block_table.hpp"

namespace kvsift::test {

// Softmax attention in double of the G query heads of one KV head over its rows K, V (each
// [D]), written to out[(h·G + g)·D + d] for g < G: the oracle both paged GPU tests compare with.
//   query  [q_heads, D]
inline void dense_attention_double(const float* query, std::int64_t h, std::int64_t G,
                                   std::int64_t D, float scale,
                                   const std::vector<std::vector<float>>& K,
                                   const std::vector<std::vector<float>>& V,
                                   std::vector<float>& out) {
  for (std::int64_t g = 0; g < G; ++g) {
    const float* q = query + (h * G + g) * D;
    std::vector<double> w(K.size());
    double mx = -1e300, sum = 0;
    for (std::size_t j = 0; j < K.size(); ++j) {
      double dot = 0;
      for (std::int64_t d = 0; d < D; ++d) dot += double(q[d]) * K[j][d];
      w[j] = dot * scale;
      mx = std::max(mx, w[j]);
    }
    for (double& x : w) sum += (x = std::exp(x - mx));
    for (std::int64_t d = 0; d < D; ++d) {
      double acc = 0;
      for (std::size_t j = 0; j < K.size(); ++j) acc += w[j] * V[j][d];
      out[static_cast<std::size_t>((h * G + g) * D + d)] = static_cast<float>(acc / sum);
    }
  }
}

struct PagedMirror {
  cuda::PagedTableSizes sizes;
  DeviceBuffer<std::uint8_t> storage;
  DeviceBuffer<std::uint64_t> masks;
  DeviceBuffer<std::uint8_t> positions;
  DeviceBuffer<std::int64_t> offsets;
  DeviceBuffer<cuda::PagedStaging> staged_keys, staged_values;
  DeviceBuffer<std::uint32_t> staged_masks;
  DeviceBuffer<float> factors;
  cuda::DevicePagedTable table;

  PagedMirror(const ThoughtBlockTableConfig& cfg, std::int32_t max_sequences,
              const cuda::PagedPoolFrames& pools = {})
      : sizes(cuda::paged_table_sizes(cfg, max_sequences, pools)),
        storage(static_cast<std::size_t>(sizes.storage_bytes)),
        masks(static_cast<std::size_t>(sizes.mask_bytes / 8)),
        positions(static_cast<std::size_t>(sizes.position_bytes)),
        offsets(static_cast<std::size_t>(sizes.frame_offset_bytes / 8)),
        staged_keys(static_cast<std::size_t>(sizes.staging_bytes) / sizeof(cuda::PagedStaging)),
        staged_values(staged_keys.size()),
        staged_masks(static_cast<std::size_t>(sizes.staged_mask_bytes / 4)),
        factors(static_cast<std::size_t>(cfg.kv_heads)),
        table(cfg, max_sequences,
              cuda::PagedTableMemory{storage.get(), masks.get(), positions.get(), offsets.get(),
                                     staged_keys.get(), staged_values.get(), staged_masks.get(),
                                     factors.get()},
              pools) {
    // Poison: 0xab bytes hold the invalid ternary code 10 and finite FP8 garbage; the fresh-frame
    // initialisation must zero every byte the CPU table zeroes.
    KVSIFT_CUDA_CHECK(cudaMemset(storage.get(), 0xab, storage.size()));
    table.initialize(nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

// What a device table holds, downloaded.
struct DeviceTableSnapshot {
  std::vector<std::uint8_t> pool;
  std::vector<std::uint64_t> masks;
  std::vector<std::uint8_t> positions;  // 3 B per slot (slot_positions.hpp)
  std::vector<cuda::PagedStaging> staged_keys, staged_values;
  std::vector<std::uint32_t> staged_masks;
};

template <class T>
std::vector<T> download_array(const T* device, std::int64_t bytes) {
  std::vector<T> out(static_cast<std::size_t>(bytes) / sizeof(T));
  KVSIFT_CUDA_CHECK(cudaMemcpy(out.data(), device, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

inline DeviceTableSnapshot snapshot(const cuda::DevicePagedTable& table) {
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const cuda::PagedTableMemory& m = table.memory();
  const cuda::PagedTableSizes& s = table.sizes();
  return DeviceTableSnapshot{download_array(m.storage, s.storage_bytes),
                             download_array(m.free_masks, s.mask_bytes),
                             download_array(m.positions, s.position_bytes),
                             download_array(m.staged_keys, s.staging_bytes),
                             download_array(m.staged_values, s.staging_bytes),
                             download_array(m.staged_masks, s.staged_mask_bytes)};
}

// Sequence `cpu_seq` of the CPU table against sequence `dev_seq` of the device table: every
// block's device bytes == block_storage(), device masks == free_mask(), device slot positions ==
// the CPU's for every live slot; the staged rows (keys and values, 16-bit) of every head equal
// the CPU's staged_rows() as a multiset (device rows are unordered). `same_frames`: the device
// table follows this very CPU table (frame ids equal), not another table with the same history.
inline void require_same_sequence(const ThoughtBlockTable& cpu, std::int32_t cpu_seq,
                                  const cuda::DevicePagedTable& table,
                                  const DeviceTableSnapshot& dev, std::int32_t dev_seq,
                                  bool same_frames) {
  const std::vector<std::uint8_t>& pool = dev.pool;
  const std::vector<std::uint64_t>& masks = dev.masks;
  const std::vector<std::uint8_t>& positions = dev.positions;
  const std::int32_t seq = cpu_seq;
  REQUIRE(table.num_blocks(dev_seq) == cpu.num_blocks(seq));
  const std::int32_t H = cpu.config().kv_heads, W = cpu.mask_words(), S = cpu.config().block_size;
  const std::int64_t D = cpu.config().head_dim;
  const cuda::PagedTableSizes& sizes = table.sizes();
  for (std::int32_t b = 0; b < cpu.num_blocks(seq); ++b) {
    const BlockInfo info = cpu.block_info(seq, b);
    const std::int32_t frame = table.frame_of(dev_seq, b);
    if (same_frames) REQUIRE(frame == info.frame);
    REQUIRE(table.format_of_block(dev_seq, b) == info.format);
    REQUIRE(table.type_of_block(dev_seq, b) == info.type);
    const std::vector<std::uint8_t>& want = cpu.block_storage(seq, b);
    const std::int64_t offset = table.block_offset(dev_seq, b);
    const int f = static_cast<int>(info.format);
    // The frame lies inside its format's pool, which is sized by block_bytes.hpp.
    REQUIRE(offset >= sizes.pool_offset[f]);
    REQUIRE(offset + static_cast<std::int64_t>(want.size()) <=
            sizes.pool_offset[f] + sizes.pool_frames[f] * sizes.frame_bytes[f]);
    const std::uint8_t* got = pool.data() + offset;
    std::size_t first_diff = want.size();
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (got[i] != want[i]) {
        first_diff = i;
        break;
      }
    }
    INFO("block " << b << " frame " << info.frame << " format " << block_format_name(info.format)
                  << " bytes " << want.size() << " first differing byte " << first_diff
                  << (first_diff < want.size()
                          ? " (got " + std::to_string(got[first_diff]) + " want " +
                                std::to_string(want[first_diff]) + ")"
                          : std::string()));
    REQUIRE(first_diff == want.size());
    for (std::int32_t h = 0; h < H; ++h) {
      const std::uint64_t* cm = cpu.free_mask(seq, b, h);
      for (std::int32_t w = 0; w < W; ++w) {
        INFO("head " << h << " mask word " << w);
        REQUIRE(masks[(static_cast<std::size_t>(frame) * H + h) * W + w] == cm[w]);
      }
    }
  }
  const std::vector<cuda::PagedStaging>& sk = dev.staged_keys;
  const std::vector<cuda::PagedStaging>& sv = dev.staged_values;
  const std::vector<std::uint32_t>& sm = dev.staged_masks;
  for (std::int32_t h = 0; h < H; ++h) {
    for (const ResidentToken& t : cpu.resident_tokens(seq, h)) {
      if (t.address.block < 0) continue;
      const std::int32_t frame = table.frame_of(dev_seq, t.address.block);
      INFO("head " << h << " block " << t.address.block << " slot " << t.address.slot);
      REQUIRE(load_slot_position(positions.data(),
                                 (std::int64_t{frame} * H + h) * S + t.address.slot) == t.position);
    }
    // Staged rows as (key bits, value bits) strings, sorted.
    std::vector<float> ck, cv;
    cpu.staged_rows(seq, h, ck, cv);
    std::vector<std::vector<float>> want, got;
    for (std::size_t i = 0; i * D < ck.size(); ++i) {
      std::vector<float> row(ck.begin() + i * D, ck.begin() + (i + 1) * D);
      row.insert(row.end(), cv.begin() + i * D, cv.begin() + (i + 1) * D);
      want.push_back(row);
    }
    for (int type = 0; type < cuda::kPagedThoughtTypes; ++type) {
      const std::size_t stream =
          (static_cast<std::size_t>(dev_seq) * cuda::kPagedThoughtTypes + type) * H + h;
      REQUIRE(table.staged_count(dev_seq, static_cast<ThoughtType>(type), h) ==
              __builtin_popcount(sm[stream]));
      for (int r = 0; r < 16; ++r) {
        if (!((sm[stream] >> r) & 1u)) continue;
        std::vector<float> row;
        for (std::int64_t d = 0; d < D; ++d) row.push_back(to_float(sk[(stream * 16 + r) * D + d]));
        for (std::int64_t d = 0; d < D; ++d) row.push_back(to_float(sv[(stream * 16 + r) * D + d]));
        got.push_back(row);
      }
    }
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    INFO("head " << h << ": " << got.size() << " staged rows on the device, " << want.size()
                 << " on the CPU");
    REQUIRE(got == want);
  }
}

// The mirror against the CPU table it follows (same sequence id, same frames).
inline void require_same_table(const ThoughtBlockTable& cpu, PagedMirror& dev, std::int32_t seq) {
  require_same_sequence(cpu, seq, dev.table, snapshot(dev.table), seq, true);
}

// The device table's resident bytes equal the CPU table's, field by field.
inline void require_same_bytes(const ThoughtBlockTable& cpu, const PagedMirror& dev) {
  const TableBytes want = cpu.resident_bytes();
  const TableBytes got = dev.table.resident_bytes(cpu);
  INFO("codes " << got.codes << "/" << want.codes << " scales " << got.scales << "/" << want.scales
                << " metadata " << got.metadata << "/" << want.metadata << " staging "
                << got.staging << "/" << want.staging << " (device/CPU)");
  REQUIRE(got.codes == want.codes);
  REQUIRE(got.scales == want.scales);
  REQUIRE(got.metadata == want.metadata);
  REQUIRE(got.staging == want.staging);
}

// Evicts `addresses` (all live now, in one head) from both tables: the CPU by positions (bits
// first, then empty blocks released, so the addresses stay valid for the mirror's call).
inline void evict_both(ThoughtBlockTable& cpu, PagedMirror& dev, std::int32_t seq,
                       std::int32_t head, const std::vector<SlotAddress>& addresses) {
  std::vector<std::int32_t> positions;
  for (const ResidentToken& t : cpu.resident_tokens(seq, head)) {
    for (const SlotAddress& a : addresses) {
      if (a.block == t.address.block && a.slot == t.address.slot) positions.push_back(t.position);
    }
  }
  REQUIRE(positions.size() == addresses.size());
  cpu.evict_positions(seq, head, positions);
  DeviceBuffer<std::uint8_t> ws(dev.table.evict_workspace_bytes(addresses.size()));
  dev.table.evict(seq, head, addresses, ws.get(), ws.size(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
}

// A table config with the given shape and thought formats (R, E, T), the other fields default.
inline ThoughtBlockTableConfig table_config(int kv_heads, int head_dim, int block_size,
                                            BlockFormat r, BlockFormat e, BlockFormat t,
                                            int num_blocks) {
  ThoughtBlockTableConfig c;
  c.kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.reasoning = r;
  c.execution = e;
  c.transition = t;
  return c;
}

// Appends `lengths[i]` random tokens to sequence i of both tables (segments of 80 tokens of
// random thought types, or of `types` in turn when given, so every type leaves staged tokens),
// then evicts about 40 % of each head's tokens at random (staged ones included), and every token
// of blocks [0, 8) of head 0 of sequence 0. Returns the sequence ids.
inline std::vector<std::int32_t> fill_random(ThoughtBlockTable& cpu, PagedMirror& dev,
                                             const std::vector<int>& lengths, std::mt19937& rng,
                                             const std::vector<int>& types = {}) {
  const std::int32_t H = cpu.config().kv_heads, D = cpu.config().head_dim;
  std::normal_distribution<float> normal;
  std::vector<std::int32_t> seqs;
  std::vector<float> k(static_cast<std::size_t>(H) * D), v(k.size()), bk, bv;
  std::vector<SlotAddress> where(static_cast<std::size_t>(H));
  auto flush = [&] {
    if (dev.table.pending_tokens() == 0) return;
    DeviceBuffer<float> dk(bk), dv(bv);
    DeviceBuffer<std::uint8_t> ws(dev.table.append_workspace_bytes());
    dev.table.append(dk.get(), dv.get(), DType::f32, ws.get(), ws.size(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    bk.clear();
    bv.clear();
  };
  for (int len : lengths) {
    const std::int32_t seq = cpu.create_sequence();
    seqs.push_back(seq);
    for (int t = 0; t < len; ++t) {
      if (t % 80 == 0) {
        const int type = types.empty() ? static_cast<int>(rng() % 3)
                                       : types[static_cast<std::size_t>(t / 80) % types.size()];
        cpu.open_segment(seq, static_cast<ThoughtType>(type));
      }
      for (float& x : k) x = 1.5f * normal(rng);
      for (float& x : v) x = normal(rng);
      cpu.append(seq, k.data(), v.data(), H, D, where.data());
      dev.table.record_append(cpu, seq, where.data());
      bk.insert(bk.end(), k.begin(), k.end());
      bv.insert(bv.end(), v.begin(), v.end());
      if (dev.table.pending_tokens() == 64) flush();
    }
    flush();
  }
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    for (std::int32_t h = 0; h < H; ++h) {
      std::vector<SlotAddress> victims;
      for (const ResidentToken& t : cpu.resident_tokens(seqs[i], h)) {
        const bool masked_run = i == 0 && h == 0 && t.address.block >= 0 && t.address.block < 8;
        if (masked_run || rng() % 5 < 2) victims.push_back(t.address);
      }
      evict_both(cpu, dev, seqs[i], h, victims);
    }
  }
  for (std::int32_t s : seqs) require_same_table(cpu, dev, s);
  require_same_bytes(cpu, dev);
  return seqs;
}

}  // namespace kvsift::test
