// The DType <-> StDType mapping (include/kvsift/core/safetensors.hpp) that every reader and writer
// of KV tensors shares: checked against the two enums' own names and element sizes, so a wrong
// pairing (e.g. f16 <-> BF16, both 2 bytes) fails on the name.
#include <cctype>
#include <optional>
#include <string>
#include <string_view>

#include "catch.hpp"
#include "kvsift/core/safetensors.hpp"

using namespace kvsift;

namespace {
std::string upper(std::string_view s) {
  std::string out(s);
  for (char& ch : out) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return out;
}
}  // namespace

TEST_CASE("st_dtype_of pairs every storage dtype with the safetensors type of its name and size") {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    const StDType st = st_dtype_of(t);
    CHECK(std::string(st_dtype_name(st)) == upper(dtype_name(t)));
    CHECK(st_dtype_size(st) == dtype_size(t));
  }
}

TEST_CASE("storage_dtype_of inverts st_dtype_of and refuses the integer types") {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    const std::optional<DType> back = storage_dtype_of(st_dtype_of(t));
    REQUIRE(back.has_value());
    CHECK(*back == t);
  }
  for (StDType st : {StDType::i64, StDType::i32, StDType::u8}) CHECK(!storage_dtype_of(st));
  CHECK(storage_dtype_of(parse_st_dtype("BF16")) == DType::bf16);
}
