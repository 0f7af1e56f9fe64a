// Safetensors read/write: the format of the golden cases, of `kvsift score` inputs and outputs,
// and of saved steering vectors. Layout: 8-byte little-endian header length, a JSON header
// (`dtype`, `shape`, `data_offsets` per tensor, optional `__metadata__` of string values), then the
// raw little-endian data. Implemented in src/safetensors.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/file_io.hpp"

namespace kvsift {

// The element types kvsift reads and writes ("F32", "F16", "BF16", "I64", "I32", "U8").
enum class StDType : std::uint8_t { f32, f16, bf16, i64, i32, u8 };

std::size_t st_dtype_size(StDType t);
const char* st_dtype_name(StDType t);  // the safetensors spelling, e.g. "BF16"
StDType parse_st_dtype(const std::string& name);

// The one mapping between kvsift's storage dtypes and the safetensors element types that hold them
// (f32 <-> F32, f16 <-> F16, bf16 <-> BF16), for every reader and writer of KV tensors.
StDType st_dtype_of(DType t);
// nullopt for the integer types (I64, I32, U8): no KV cache stores them, and callers name the
// tensor in their own error.
std::optional<DType> storage_dtype_of(StDType t);

struct StTensor {
  StDType dtype = StDType::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> bytes;  // little-endian element data, row-major

  std::int64_t numel() const;
  // Element data converted to the requested type; throws when the stored dtype can't convert
  // losslessly (floats from F32/F16/BF16; integers from I64/I32/U8).
  std::vector<float> to_f32() const;
  std::vector<std::int64_t> to_i64() const;

  // An I32 tensor of `shape` holding `values` (their count must match the shape).
  static StTensor from_i32(std::vector<std::int64_t> shape,
                           const std::vector<std::int32_t>& values);
};

class SafetensorsFile {
 public:
  // Reads and checks a whole file. Throws kvsift::Error naming the file and the fault for a
  // missing or truncated file, bad JSON, unknown dtypes, offsets out of range or overlapping,
  // or a byte count that disagrees with dtype and shape; also for a path that is not a regular
  // file (directory, device, FIFO) or is larger than `max_bytes` (core/file_io.hpp).
  static SafetensorsFile load(const std::string& path,
                              std::uint64_t max_bytes = kDefaultMaxInputBytes);
  // Parses an in-memory image (what load() reads); `what` names it in errors.
  static SafetensorsFile parse(const std::vector<std::uint8_t>& image, const std::string& what);

  // Atomic and safe: write_file_atomically (core/file_io.hpp).
  void save(const std::string& path) const;
  std::vector<std::uint8_t> serialize() const;

  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws kvsift::Error "missing tensor 'name'" when absent.
  const StTensor& get(const std::string& name) const;
  // get() plus a shape check; -1 in `expected` matches any extent.
  const StTensor& get(const std::string& name, const std::vector<std::int64_t>& expected) const;
  std::vector<std::string> names() const;

  void put(const std::string& name, StTensor t);  // checks bytes == numel * element size
  void put_f32(const std::string& name, std::vector<std::int64_t> shape, const float* data);
  void put_i64(const std::string& name, std::vector<std::int64_t> shape, const std::int64_t* data);
  void put_u8(const std::string& name, std::vector<std::int64_t> shape, const std::uint8_t* data);

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::map<std::string, std::string>& metadata() { return metadata_; }

 private:
  std::map<std::string, StTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kvsift
