// Safetensors I/O: round trips of every dtype, the real golden file, and damaged images that must
// each fail with a message naming the fault.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/safetensors.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

// Little-endian bytes of a list of unsigned values of `width` bytes each, built byte by byte
// (independently of the library's own encoder).
std::vector<std::uint8_t> le_bytes(const std::vector<std::uint64_t>& values, int width) {
  std::vector<std::uint8_t> out;
  for (std::uint64_t v : values) {
    for (int i = 0; i < width; ++i) out.push_back(static_cast<std::uint8_t>((v >> (8 * i)) & 0xff));
  }
  return out;
}

StTensor make(StDType dtype, std::vector<std::int64_t> shape, std::vector<std::uint8_t> bytes) {
  StTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes = std::move(bytes);
  return t;
}

// A hand-made image: 8-byte length, the JSON text as given, then `data`.
std::vector<std::uint8_t> image_of(const std::string& header,
                                   const std::vector<std::uint8_t>& data) {
  std::vector<std::uint8_t> img = le_bytes({header.size()}, 8);
  img.insert(img.end(), header.begin(), header.end());
  img.insert(img.end(), data.begin(), data.end());
  return img;
}

// A valid two-tensor image to damage: "a" F32 [2] at [0, 8), "b" I64 [1] at [8, 16).
const std::string kGoodHeader = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}})";
const std::vector<std::uint8_t> kGoodData(16, 0);

std::string parse_error(const std::vector<std::uint8_t>& img) {
  try {
    SafetensorsFile::parse(img, "case.st");
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST_CASE("dtype names and sizes", "[safetensors]") {
  REQUIRE(parse_st_dtype("BF16") == StDType::bf16);
  REQUIRE(std::string(st_dtype_name(StDType::i32)) == "I32");
  REQUIRE(st_dtype_size(StDType::i64) == 8);
  REQUIRE(st_dtype_size(StDType::u8) == 1);
  REQUIRE_THROWS_WITH(parse_st_dtype("F64"), Contains("unknown dtype 'F64'"));
}

TEST_CASE("round trip of every dtype with metadata", "[safetensors]") {
  SafetensorsFile f;
  const std::vector<float> f32 = {1.5f, -0.25f, 3e38f, 0.0f, -7.0f, 1e-40f};  // 1e-40: subnormal
  f.put_f32("w_f32", {2, 3}, f32.data());
  // Known bit patterns: f16 1.0 = 0x3c00, -2.0 = 0xc000, 0.5 = 0x3800, 65504 = 0x7bff;
  // bf16 1.0 = 0x3f80, -2.0 = 0xc000, 3.0 = 0x4040, 0.15625 = 0x3e20.
  f.put("w_f16", make(StDType::f16, {4}, le_bytes({0x3c00, 0xc000, 0x3800, 0x7bff}, 2)));
  f.put("w_bf16", make(StDType::bf16, {2, 2}, le_bytes({0x3f80, 0xc000, 0x4040, 0x3e20}, 2)));
  const std::vector<std::int64_t> i64 = {0, -1, 1LL << 40, -(1LL << 62)};
  f.put_i64("idx_i64", {4}, i64.data());
  f.put("idx_i32", make(StDType::i32, {3}, le_bytes({7, 0xffffffffu, 0x80000000u}, 4)));
  const std::vector<std::uint8_t> u8 = {0, 1, 254, 255, 9};
  f.put_u8("mask_u8", {5}, u8.data());
  f.put("empty", make(StDType::f32, {0, 3}, {}));
  f.put("scalar", make(StDType::i32, {}, le_bytes({42}, 4)));
  f.metadata()["config"] = R"({"budget": 64})";
  f.metadata()["note"] = "hello";

  const std::vector<std::uint8_t> img = f.serialize();

  SECTION("the header is padded to 8 bytes and lists tensors sorted, data packed in that order") {
    std::uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= std::uint64_t(img[i]) << (8 * i);
    REQUIRE(n % 8 == 0);
    REQUIRE(8 + n <= img.size());
    const std::string text(img.begin() + 8, img.begin() + 8 + n);
    const auto header = nlohmann::json::parse(text);
    std::uint64_t expect_begin = 0;
    for (const std::string name :
         {"empty", "idx_i32", "idx_i64", "mask_u8", "scalar", "w_bf16", "w_f16", "w_f32"}) {
      const auto offs = header.at(name).at("data_offsets");
      REQUIRE(offs[0].get<std::uint64_t>() == expect_begin);
      expect_begin = offs[1].get<std::uint64_t>();
    }
    REQUIRE(8 + n + expect_begin == img.size());
    REQUIRE(header.at("__metadata__").at("note") == "hello");
    REQUIRE(header.at("w_bf16").at("dtype") == "BF16");
  }

  SECTION("parse(serialize()) returns the same tensors and metadata") {
    const SafetensorsFile g = SafetensorsFile::parse(img, "memory");
    REQUIRE(g.names() == f.names());
    REQUIRE(g.metadata() == f.metadata());
    for (const std::string& name : f.names()) {
      REQUIRE(g.get(name).dtype == f.get(name).dtype);
      REQUIRE(g.get(name).shape == f.get(name).shape);
      REQUIRE(g.get(name).bytes == f.get(name).bytes);
    }
    REQUIRE(g.get("w_f32", {2, 3}).to_f32() == f32);
    REQUIRE(g.get("w_f16").to_f32() == std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f});
    REQUIRE(g.get("w_bf16").to_f32() == std::vector<float>{1.0f, -2.0f, 3.0f, 0.15625f});
    REQUIRE(g.get("idx_i64").to_i64() == i64);
    REQUIRE(g.get("idx_i32").to_i64() == std::vector<std::int64_t>{7, -1, -2147483648LL});
    REQUIRE(g.get("mask_u8").to_i64() == std::vector<std::int64_t>{0, 1, 254, 255, 9});
    REQUIRE(g.get("empty").numel() == 0);
    REQUIRE(g.get("scalar").to_i64() == std::vector<std::int64_t>{42});
  }

  SECTION("save then load through a file") {
    const std::string path = "test_safetensors_roundtrip.safetensors";
    f.save(path);
    const SafetensorsFile g = SafetensorsFile::load(path);
    std::remove(path.c_str());
    REQUIRE(g.serialize() == img);
  }
}

TEST_CASE("conversions reject the other kind of dtype", "[safetensors]") {
  const StTensor ints = make(StDType::i32, {1}, le_bytes({1}, 4));
  const StTensor floats = make(StDType::bf16, {1}, le_bytes({0x3f80}, 2));
  REQUIRE_THROWS_WITH(ints.to_f32(), Contains("integer dtype I32"));
  REQUIRE_THROWS_WITH(floats.to_i64(), Contains("floating-point dtype BF16"));
  // A hand-built tensor whose bytes disagree with its shape is refused, not over-read.
  const StTensor short_bytes = make(StDType::f32, {4}, le_bytes({0}, 4));
  REQUIRE_THROWS_WITH(short_bytes.to_f32(), Contains("holds 4 bytes"));
}

TEST_CASE("get, shape checks and put checks", "[safetensors]") {
  SafetensorsFile f;
  const std::vector<float> x(6, 1.0f);
  f.put_f32("x", {1, 2, 3}, x.data());
  REQUIRE(f.has("x"));
  REQUIRE_FALSE(f.has("y"));
  REQUIRE(f.get("x", {-1, 2, -1}).shape == std::vector<std::int64_t>{1, 2, 3});
  REQUIRE_THROWS_WITH(f.get("y"), Contains("missing tensor 'y'"));
  REQUIRE_THROWS_WITH(f.get("x", {1, 3, 3}),
                      Contains("'x'") && Contains("[1, 2, 3]") && Contains("[1, 3, 3]"));
  REQUIRE_THROWS_WITH(f.get("x", {1, 2}), Contains("[1, 2, 3]") && Contains("expected [1, 2]"));
  REQUIRE_THROWS_WITH(f.put("z", make(StDType::f16, {3}, le_bytes({0, 0}, 2))),
                      Contains("holds 4 bytes") && Contains("need 6"));
  REQUIRE_THROWS_WITH(f.put("z", make(StDType::u8, {-1}, {})), Contains("negative dimension"));
  REQUIRE_THROWS_WITH(f.put("__metadata__", make(StDType::u8, {0}, {})), Contains("reserved"));
}

TEST_CASE("the R-KV MHA golden file reads with its names, shapes and config", "[safetensors]") {
  const SafetensorsFile f = SafetensorsFile::load(KVSIFT_GOLDEN_DIR "/rkv_mha.safetensors");
  REQUIRE(f.names() == std::vector<std::string>{"compacted_keys", "compacted_values", "importance",
                                                "keep_sorted", "keep_topk", "keys", "queries",
                                                "redundancy_full", "score", "values"});
  f.get("queries", {1, 8, 8, 64});
  f.get("values", {1, 8, 256, 64});
  f.get("compacted_keys", {1, 8, 128, 64});
  f.get("importance", {1, 8, 248});
  f.get("redundancy_full", {1, 8, 256});
  REQUIRE(f.get("keep_topk").dtype == StDType::i64);

  // Values read with Python's struct module from the same file.
  const std::vector<float> keys = f.get("keys", {1, 8, 256, 64}).to_f32();
  REQUIRE(keys[0] == -1.1651591062545776f);
  REQUIRE(keys[1000] == 0.6123631000518799f);
  const std::vector<std::int64_t> keep = f.get("keep_sorted", {1, 8, 120}).to_i64();
  REQUIRE(keep[0] == 0);
  REQUIRE(keep[119] == 247);
  REQUIRE(keep[120] == 4);
  for (std::size_t row = 0; row < 8; ++row) {  // each head's kept slots: sorted, below S - W
    for (std::size_t i = 0; i < 120; ++i) {
      REQUIRE(keep[row * 120 + i] >= 0);
      REQUIRE(keep[row * 120 + i] < 248);
      if (i) REQUIRE(keep[row * 120 + i] > keep[row * 120 + i - 1]);
    }
  }

  const auto config = nlohmann::json::parse(f.metadata().at("config"));
  REQUIRE(config.at("budget") == 128);
  REQUIRE(config.at("window") == 8);
}

TEST_CASE("a missing file is named", "[safetensors]") {
  REQUIRE_THROWS_WITH(SafetensorsFile::load("no/such/dir/x.safetensors"),
                      Contains("'no/such/dir/x.safetensors'") && Contains("cannot open"));
  SafetensorsFile f;
  REQUIRE_THROWS_WITH(f.save("no/such/dir/y.safetensors"),
                      Contains("no/such/dir/y.safetensors") && Contains("cannot create a temporary"));
}

TEST_CASE("damaged images fail with a message naming the fault", "[safetensors]") {
  REQUIRE(parse_error(image_of(kGoodHeader, kGoodData)) == "<no error>");

  SECTION("shorter than the length prefix") {
    REQUIRE_THROWS_WITH(SafetensorsFile::parse({1, 2, 3}, "tiny.st"),
                        Contains("'tiny.st'") && Contains("shorter than the 8-byte"));
  }
  SECTION("truncated header") {
    std::vector<std::uint8_t> img = image_of(kGoodHeader, {});
    img.resize(20);
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(img, "cut.st"),
                        Contains("'cut.st'") && Contains("truncated header"));
  }
  SECTION("truncated data") {
    std::vector<std::uint8_t> data = kGoodData;
    data.resize(12);
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of(kGoodHeader, data), "cut.st"),
                        Contains("'cut.st'") && Contains("tensor 'b'") &&
                            Contains("run past the end of the data block (12 bytes)"));
  }
  SECTION("garbage JSON") {
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of("{\"a\": [1, 2", kGoodData), "bad.st"),
                        Contains("'bad.st'") && Contains("bad JSON header"));
  }
  SECTION("JSON that is not an object") {
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of("[1, 2]", {}), "arr.st"),
                        Contains("not an object (it is a array)"));
  }
  SECTION("offsets past the end") {
    const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})";
    REQUIRE(parse_error(image_of(h, kGoodData)) ==
            "safetensors 'case.st': tensor 'a' data_offsets [16, 24] run past the end of the data "
            "block (16 bytes): out of range or truncated data");
  }
  SECTION("end before begin") {
    const std::string h = R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})";
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of(h, kGoodData), "x"),
                        Contains("tensor 'a' data_offsets end (4) < begin (8)"));
  }
  SECTION("overlapping tensors") {
    const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of(h, kGoodData), "x"),
                        Contains("tensors 'a' [0, 8) and 'b' [4, 12) overlap"));
  }
  SECTION("byte count disagrees with dtype and shape") {
    const std::string h = R"({"a":{"dtype":"F16","shape":[3],"data_offsets":[0,8]}})";
    REQUIRE_THROWS_WITH(
        SafetensorsFile::parse(image_of(h, kGoodData), "x"),
        Contains("tensor 'a' byte count 8 != numel * element size (6 for F16 [3])"));
  }
  SECTION("unknown dtype") {
    const std::string h = R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})";
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of(h, kGoodData), "x"),
                        Contains("tensor 'a'") && Contains("unknown dtype 'F64'"));
  }
  SECTION("negative shape") {
    const std::string h = R"({"a":{"dtype":"U8","shape":[-2],"data_offsets":[0,0]}})";
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of(h, kGoodData), "x"),
                        Contains("tensor 'a' has a negative dimension 0 (-2)"));
  }
  SECTION("entry missing a field") {
    const std::string h = R"({"a":{"dtype":"U8","shape":[2]}})";
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of(h, kGoodData), "x"),
                        Contains("tensor 'a' is missing 'data_offsets'"));
  }
  SECTION("metadata value that is not a string") {
    const std::string h = R"({"__metadata__":{"budget":128}})";
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of(h, {}), "x"),
                        Contains("metadata value of 'budget' is not a string"));
  }
  SECTION("a shape too large for int64 is a byte-count fault, not an overflow") {
    const std::string h =
        R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})";
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(image_of(h, kGoodData), "x"),
                        Contains("byte count 8") && Contains("overflow"));
  }
}
