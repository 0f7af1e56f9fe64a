// The host half of cuda::DevicePagedTable::append — record_append and take_append_plan — against
// the CPU ThoughtBlockTable whose decisions it mirrors: every f32 token's row write, every staged
// token's op in its stream's task (each task's ops contiguous, in recording order), every sealed
// group's frame, first slot and positions, every fresh frame, and the staged rows left behind.
// Neither call touches device memory, so host buffers stand in for it and this runs without a GPU
// (an ordinary CI test, like cuda_backend_registered).
#include <algorithm>
#include <bitset>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "catch.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/paged/thought_block_table.hpp"

using namespace kvsift;

namespace {

constexpr std::int32_t kHeads = 2, kDim = 16, kSeqs = 3;

ThoughtBlockTableConfig config() {
  ThoughtBlockTableConfig c;
  c.kv_heads = kHeads;
  c.head_dim = kDim;
  c.block_size = 32;
  c.num_blocks = 64;
  c.reasoning = BlockFormat::nvfp4;
  c.execution = BlockFormat::f32;
  c.transition = BlockFormat::ternary;
  c.holds_data = false;
  return c;
}

// Never read or written by recording or planning; the constructor wants non-null, aligned memory.
struct StandIn {
  std::uint64_t* p = static_cast<std::uint64_t*>(std::aligned_alloc(64, 64));
  ~StandIn() { std::free(p); }
  cuda::PagedTableMemory memory() const {
    return cuda::PagedTableMemory{
        reinterpret_cast<std::uint8_t*>(p),       p,
        reinterpret_cast<std::uint8_t*>(p),       reinterpret_cast<std::int64_t*>(p),
        reinterpret_cast<cuda::PagedStaging*>(p), reinterpret_cast<cuda::PagedStaging*>(p),
        reinterpret_cast<std::uint32_t*>(p),      reinterpret_cast<float*>(p)};
  }
};

struct Recorded {  // one recorded token: what the CPU table decided
  std::int32_t seq, position;
  ThoughtType type;
  std::vector<SlotAddress> where;  // [kHeads]
};

int staged_on_cpu(const ThoughtBlockTable& t, std::int32_t seq, ThoughtType type, std::int32_t h) {
  int n = 0;
  for (const ResidentToken& r : t.resident_tokens(seq, h))
    n += r.address.block == kStagedBlock && t.segment_type(seq, r.segment) == type;
  return n;
}

// Checks a plan against the tokens recorded since the last one (`recorded`) and the frames the
// CPU table took meanwhile (`fresh`).
void check_plan(const cuda::detail::PagedAppendPlan& plan, const std::vector<Recorded>& recorded,
                const std::vector<std::int32_t>& fresh, const ThoughtBlockTable& cpu,
                const cuda::DevicePagedTable& mirror) {
  const ThoughtBlockTableConfig& c = cpu.config();
  std::vector<cuda::detail::PagedRowWrite> rows;
  std::vector<std::vector<std::pair<std::int32_t, SlotAddress>>> ops_of(
      static_cast<std::size_t>(kSeqs * 3 * kHeads));  // per stream: (token, address) in order
  for (std::size_t t = 0; t < recorded.size(); ++t) {
    const Recorded& r = recorded[t];
    for (std::int32_t h = 0; h < kHeads; ++h) {
      const SlotAddress a = r.where[static_cast<std::size_t>(h)];
      if (c.format_of(r.type) == BlockFormat::f32) {
        cuda::detail::PagedRowWrite w{};
        w.token = static_cast<std::int32_t>(t);
        w.head = h;
        w.frame = cpu.block_info(r.seq, a.block).frame;
        w.slot = a.slot;
        w.position = r.position;
        rows.push_back(w);
      } else {
        ops_of[static_cast<std::size_t>((r.seq * 3 + static_cast<int>(r.type)) * kHeads + h)]
            .emplace_back(static_cast<std::int32_t>(t), a);
      }
    }
  }
  // f32 tokens: one row write per (token, KV head), in recording order.
  REQUIRE(plan.rows.size() == rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    INFO("row " << i);
    REQUIRE(plan.rows[i].token == rows[i].token);
    REQUIRE(plan.rows[i].head == rows[i].head);
    REQUIRE(plan.rows[i].frame == rows[i].frame);
    REQUIRE(plan.rows[i].slot == rows[i].slot);
    REQUIRE(plan.rows[i].position == rows[i].position);
  }
  // Staged tokens: one task per stream with ops, its ops contiguous and in recording order.
  std::size_t streams_with_ops = 0, next_first = 0;
  for (const auto& v : ops_of) streams_with_ops += !v.empty();
  REQUIRE(plan.tasks.size() == streams_with_ops);
  std::size_t seals = 0;
  for (const cuda::detail::PagedStreamTask& task : plan.tasks) {
    INFO("stream " << task.stream);
    const auto& want = ops_of[static_cast<std::size_t>(task.stream)];
    REQUIRE(task.head == task.stream % kHeads);
    REQUIRE(static_cast<std::size_t>(task.first) == next_first);
    REQUIRE(static_cast<std::size_t>(task.count) == want.size());
    next_first += static_cast<std::size_t>(task.count);
    const std::int32_t seq = static_cast<std::int32_t>(task.stream / (3 * kHeads));
    const auto type = static_cast<ThoughtType>((task.stream / kHeads) % 3);
    REQUIRE(static_cast<int>(std::bitset<32>(task.final_mask).count()) ==
            staged_on_cpu(cpu, seq, type, task.head));
    for (std::size_t k = 0; k < want.size(); ++k) {
      const cuda::detail::PagedStreamOp& op = plan.ops[static_cast<std::size_t>(task.first) + k];
      REQUIRE(op.token == want[k].first);
      const SlotAddress a = want[k].second;
      REQUIRE((op.seal >= 0) == (a.block != kStagedBlock));
      if (op.seal < 0) continue;
      ++seals;
      // The sealed group: the CPU's 16 slots of that run, positions ascending.
      const cuda::detail::PagedSeal& s = plan.seals[static_cast<std::size_t>(op.seal)];
      REQUIRE(s.frame == cpu.block_info(seq, a.block).frame);
      REQUIRE(s.first_slot == a.slot - 15);
      REQUIRE(s.format == static_cast<int>(c.format_of(type)));
      std::vector<std::int32_t> positions;
      for (const ResidentToken& r : cpu.resident_tokens(seq, task.head)) {
        if (r.address.block == a.block && r.address.slot >= s.first_slot &&
            r.address.slot <= a.slot)
          positions.push_back(r.position);
      }
      std::sort(positions.begin(), positions.end());
      REQUIRE(positions.size() == 16);
      for (int i = 0; i < 16; ++i)
        REQUIRE(s.positions[i] == positions[static_cast<std::size_t>(i)]);
    }
  }
  REQUIRE(next_first == plan.ops.size());
  REQUIRE(plan.seals.size() == seals);
  // Every frame the CPU table took, in the order it took them.
  REQUIRE(plan.fresh.size() == fresh.size());
  for (std::size_t i = 0; i < fresh.size(); ++i) REQUIRE(plan.fresh[i].frame == fresh[i]);
  REQUIRE(mirror.pending_tokens() == 0);
  // What stays staged, stream by stream.
  for (std::int32_t seq = 0; seq < kSeqs; ++seq)
    for (int type = 0; type < 3; ++type)
      for (std::int32_t h = 0; h < kHeads; ++h)
        REQUIRE(mirror.staged_count(seq, static_cast<ThoughtType>(type), h) ==
                staged_on_cpu(cpu, seq, static_cast<ThoughtType>(type), h));
}

}  // namespace

TEST_CASE("DevicePagedTable's append plan follows the CPU table's decisions", "[cuda][paged]") {
  const ThoughtBlockTableConfig cfg = config();
  ThoughtBlockTable cpu(cfg);
  StandIn memory;
  cuda::DevicePagedTable mirror(cfg, kSeqs, memory.memory());
  for (std::int32_t s = 0; s < kSeqs; ++s) cpu.create_sequence();
  // Per sequence, its segments (type, tokens) in order: R (NVFP4), E (f32), T (ternary) mixed so
  // that groups seal, partial groups wait across segments, and f32 tokens fill blocks.
  const std::vector<std::vector<std::pair<ThoughtType, int>>> plans = {
      {{ThoughtType::reasoning, 40}, {ThoughtType::execution, 10}, {ThoughtType::reasoning, 9}},
      {{ThoughtType::transition, 20}, {ThoughtType::reasoning, 20}},
      {{ThoughtType::execution, 35}, {ThoughtType::transition, 18}}};
  std::vector<std::size_t> segment(kSeqs, 0);
  std::vector<int> left(kSeqs, 0);
  // Two batches (two plans): the second starts from the staged rows the first left.
  for (int batch = 0; batch < 2; ++batch) {
    std::vector<Recorded> recorded;
    std::vector<std::int32_t> fresh;
    for (int round = 0; round < 35; ++round) {
      for (std::int32_t s = 0; s < kSeqs; ++s) {
        if (left[s] == 0) {
          if (segment[s] == plans[s].size()) continue;
          cpu.open_segment(s, plans[s][segment[s]].first);
          left[s] = plans[s][segment[s]++].second;
        }
        const std::int32_t blocks = cpu.num_blocks(s);
        Recorded r{s, cpu.length(s), cpu.segment_type(s, cpu.num_segments(s) - 1),
                   std::vector<SlotAddress>(kHeads)};
        cpu.append(s, nullptr, nullptr, kHeads, kDim, r.where.data());
        mirror.record_append(cpu, s, r.where.data());
        if (cpu.num_blocks(s) > blocks) fresh.push_back(cpu.block_info(s, blocks).frame);
        recorded.push_back(r);
        --left[s];
      }
    }
    INFO("batch " << batch);
    REQUIRE(mirror.pending_tokens() == static_cast<std::int32_t>(recorded.size()));
    check_plan(mirror.take_append_plan(), recorded, fresh, cpu, mirror);
  }
  // Nothing recorded: an empty plan.
  const cuda::detail::PagedAppendPlan& empty = mirror.take_append_plan();
  REQUIRE(empty.rows.empty());
  REQUIRE(empty.ops.empty());
  REQUIRE(empty.tasks.empty());
  REQUIRE(empty.seals.empty());
  REQUIRE(empty.fresh.empty());
}

TEST_CASE("DevicePagedTable refuses a regroup it cannot follow", "[cuda][paged][regroup]") {
  ThoughtBlockTableConfig cfg = config();
  cfg.refill = RefillRule::regroup;
  StandIn memory;
  cuda::DevicePagedTable mirror(cfg, kSeqs, memory.memory());
  std::vector<SlotAddress> where(kHeads);
  {  // Another regroup threshold is another rule.
    ThoughtBlockTableConfig other = cfg;
    other.regroup_min_free = 4;
    ThoughtBlockTable cpu(other);
    const std::int32_t s = cpu.create_sequence();
    cpu.open_segment(s, ThoughtType::reasoning);
    cpu.append(s, nullptr, nullptr, kHeads, kDim, where.data());
    REQUIRE_THROWS_WITH(mirror.record_append(cpu, s, where.data()),
                        Catch::Matchers::Contains("refill rule and its regroup_min_free"));
  }
  // The CPU table evicts behind the mirror's back (positions 0-9 of both heads), so it regroups a
  // pinned run the mirror cannot see: refused, naming the head, nothing recorded.
  ThoughtBlockTable cpu(cfg);
  const std::int32_t s = cpu.create_sequence();
  cpu.open_segment(s, ThoughtType::reasoning);
  for (int t = 0; t < 32; ++t) {  // two sealed groups: block 0 full
    cpu.append(s, nullptr, nullptr, kHeads, kDim, where.data());
    mirror.record_append(cpu, s, where.data());
  }
  mirror.take_append_plan();
  for (std::int32_t h = 0; h < kHeads; ++h)
    cpu.evict_positions(s, h, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  for (int t = 0; t < 15; ++t) {
    cpu.append(s, nullptr, nullptr, kHeads, kDim, where.data());
    mirror.record_append(cpu, s, where.data());
  }
  cpu.append(s, nullptr, nullptr, kHeads, kDim, where.data());
  REQUIRE(cpu.refill_stats().regroups == kHeads);
  REQUIRE(where[0].block == kStagedBlock);
  REQUIRE_THROWS_WITH(mirror.record_append(cpu, s, where.data()),
                      Catch::Matchers::Contains("kv head 0 of sequence 0 completes a group of R "
                                                "tokens at position 47 but the CPU table kept it "
                                                "staged"));
  REQUIRE(mirror.pending_tokens() == 15);
}
