// The layout of the tensor-core search's fp16 unit keys (cuda/tc_unit_images.cuh) against its
// definition, on the host: the three properties the search's copies rely on.
//   1. Every (row, 16-byte chunk) of a head's region, rows up to tc_padded_length, has its own
//      chunk slot, and the slots fill the region exactly (nothing overlaps, nothing is left out,
//      so zeroing rows past `length` and writing the rest covers every byte a copy reads).
//   2. Column tile jt is one contiguous run of tc_tile_elements, in which row r's chunk c sits at
//      (half · 64 + r) · 64 elements plus chunk (c mod 8) XOR (r mod 8): the 128-byte swizzle of
//      the hardware (PTX ISA, wgmma "128B swizzling": in each 8-row, 1024-byte atom, chunk c of row
//      r at chunk c ^ (r mod 8)), which is how the search's shared memory holds a tile. So one bulk
//      copy of the run puts the tile where wgmma and ldmatrix read it.
//   3. Sixteen rows from a multiple of 16 are one contiguous 2,048-byte run per half: the pieces
//      the block's rows are copied in.
// Host only: runs in CI.
#include <cstdint>
#include <set>
#include <vector>

#include "catch.hpp"
#include "tc_unit_images.cuh"

namespace ki = kvsift::cuda::detail;

namespace {

// The swizzled element offset of chunk c of row r inside one 64-row × 64-channel image.
std::int64_t swizzled(int r, int c) { return r * 64 + ((c ^ (r % 8)) * 8); }

}  // namespace

TEST_CASE("tile images: padded lengths and region sizes", "[cuda][tc][layout]") {
  CHECK(ki::tc_padded_length(1) == 256);
  CHECK(ki::tc_padded_length(256) == 256);
  CHECK(ki::tc_padded_length(257) == 512);
  CHECK(ki::tc_padded_length(1152) == 1280);
  CHECK(ki::tc_image_halves(64) == 1);
  CHECK(ki::tc_image_halves(68) == 2);
  CHECK(ki::tc_image_halves(128) == 2);
  CHECK(ki::tc_head_elements(1152, 128) == 1280 * 128);
  CHECK(ki::tc_head_elements(290, 64) == 512 * 64);
  CHECK(ki::tc_tile_elements(100) == 64 * 128);
}

TEST_CASE("tile images: every chunk has its own slot, and the slots fill the region",
          "[cuda][tc][layout]") {
  for (int head_dim : {8, 64, 100, 128})
    for (int length : {1, 63, 290, 1152}) {
      INFO("head_dim " << head_dim << " length " << length);
      const int halves = ki::tc_image_halves(head_dim), rows = ki::tc_padded_length(length);
      const std::int64_t elements = ki::tc_head_elements(length, head_dim);
      std::vector<int> hits(static_cast<std::size_t>(elements / 8), 0);
      bool aligned = true;
      for (int i = 0; i < rows; ++i)
        for (int c = 0; c < 8 * halves; ++c) {
          const std::int64_t at = ki::tc_chunk_offset(i, c, halves);
          aligned = aligned && at % 8 == 0 && at >= 0 && at < elements;
          if (at >= 0 && at < elements) ++hits[static_cast<std::size_t>(at / 8)];
        }
      CHECK(aligned);
      std::set<int> counts(hits.begin(), hits.end());
      CHECK(counts == std::set<int>{1});
    }
}

TEST_CASE("tile images: a column tile is one contiguous, swizzled run", "[cuda][tc][layout]") {
  for (int head_dim : {64, 128}) {
    const int halves = ki::tc_image_halves(head_dim);
    const std::int64_t tile = ki::tc_tile_elements(head_dim);
    for (int jt : {0, 1, 7})
      for (int r = 0; r < 64; ++r)
        for (int c = 0; c < 8 * halves; ++c) {
          const std::int64_t at = ki::tc_chunk_offset(jt * 64 + r, c, halves);
          const std::int64_t want = jt * tile + (c / 8) * 64 * 64 + swizzled(r, c % 8);
          if (at != want) FAIL("tile " << jt << " row " << r << " chunk " << c << ": " << at);
        }
  }
  SUCCEED();
}

TEST_CASE("tile images: 16 rows from a multiple of 16 are one 2,048-byte run per half",
          "[cuda][tc][layout]") {
  for (int halves : {1, 2})
    for (int first = 0; first < 512; first += 16)
      for (int h = 0; h < halves; ++h) {
        const std::int64_t base = ki::tc_row_offset(first, h, halves);
        for (int k = 0; k < 16; ++k) {
          const std::int64_t row = ki::tc_row_offset(first + k, h, halves);
          if (row != base + k * 64) FAIL("rows " << first << " + " << k << ", half " << h);
          for (int c = 0; c < 8; ++c)  // every chunk of the row inside its 128 bytes
            if (ki::tc_chunk_offset(first + k, 8 * h + c, halves) / 64 != row / 64)
              FAIL("row " << first + k << " chunk " << c);
        }
      }
  SUCCEED();
}
