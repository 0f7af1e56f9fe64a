// Safetensors reader and writer (the format of huggingface/safetensors): an 8-byte little-endian
// header length N, N bytes of JSON, then the data block that every `data_offsets` pair indexes.
// Everything read from a file is checked before it is trusted, so a damaged or hostile image is a
// kvsift::Error naming the file and the fault, never an out-of-bounds read.
#include "kvsift/core/safetensors.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "kvsift/core/checked_math.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/file_io.hpp"

namespace kvsift {

namespace {

using json = nlohmann::json;

constexpr const char* kMetadataKey = "__metadata__";
constexpr std::size_t kHeaderLengthBytes = 8;
// The reference writer pads the JSON with spaces so the data block starts 8-byte aligned.
constexpr std::size_t kHeaderAlignment = 8;

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t k = 0; k < shape.size(); ++k) s += (k ? ", " : "") + std::to_string(shape[k]);
  return s + "]";
}

// Element count of `shape`, or -1 when an extent is negative or the count overflows int64 (such a
// shape can never match a real byte count, and the caller reports it as a byte-count mismatch).
// The arithmetic is core/checked_math.hpp's, the one home of size checks.
std::int64_t checked_numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape)
    if (!try_mul(n, d, &n)) return -1;
  return n;
}

// Byte count of `numel` elements of `t`, or -1 on overflow.
std::int64_t checked_bytes(std::int64_t numel, StDType t) {
  std::int64_t bytes = 0;
  return try_mul(numel, static_cast<std::int64_t>(st_dtype_size(t)), &bytes) ? bytes : -1;
}

// Little-endian decoding and encoding by bytes, so the file layout does not depend on the host.
std::uint64_t load_le(const std::uint8_t* p, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

void store_le(std::uint64_t v, std::size_t n, std::uint8_t* p) {
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

void check_shape_non_negative(const std::vector<std::int64_t>& shape, const std::string& who) {
  for (std::size_t k = 0; k < shape.size(); ++k) {
    KVSIFT_CHECK(shape[k] >= 0, who, " has a negative dimension ", k, " (", shape[k], ") in shape ",
                 shape_string(shape));
  }
}

// The byte count a tensor must hold, with the fault named when it doesn't.
void check_byte_count(const StTensor& t, const std::string& who) {
  const std::int64_t need = checked_bytes(checked_numel(t.shape), t.dtype);
  KVSIFT_CHECK(need >= 0 && static_cast<std::uint64_t>(need) == t.bytes.size(), who, " holds ",
               t.bytes.size(), " bytes but dtype ", st_dtype_name(t.dtype), " and shape ",
               shape_string(t.shape), " need ",
               need >= 0 ? std::to_string(need) : std::string("more than 2^63"));
}

// A JSON value that must be a non-negative integer (a shape extent or an offset).
std::int64_t json_count(const json& v, const std::string& fault) {
  KVSIFT_CHECK(v.is_number_integer(), fault, " (got ", v.dump(), ")");
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    KVSIFT_CHECK(u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), fault,
                 " (got ", u, ", beyond int64)");
    return static_cast<std::int64_t>(u);
  }
  return v.get<std::int64_t>();
}

struct Placed {
  std::string name;
  std::uint64_t begin, end;
};

}  // namespace

// --- dtypes -----------------------------------------------------------------------------------

std::size_t st_dtype_size(StDType t) {
  switch (t) {
    case StDType::f32:
      return 4;
    case StDType::f16:
      return 2;
    case StDType::bf16:
      return 2;
    case StDType::i64:
      return 8;
    case StDType::i32:
      return 4;
    case StDType::u8:
      return 1;
  }
  KVSIFT_FAIL("unknown safetensors dtype code ", static_cast<int>(t));
}

const char* st_dtype_name(StDType t) {
  switch (t) {
    case StDType::f32:
      return "F32";
    case StDType::f16:
      return "F16";
    case StDType::bf16:
      return "BF16";
    case StDType::i64:
      return "I64";
    case StDType::i32:
      return "I32";
    case StDType::u8:
      return "U8";
  }
  KVSIFT_FAIL("unknown safetensors dtype code ", static_cast<int>(t));
}

StDType parse_st_dtype(const std::string& name) {
  for (StDType t :
       {StDType::f32, StDType::f16, StDType::bf16, StDType::i64, StDType::i32, StDType::u8}) {
    if (name == st_dtype_name(t)) return t;
  }
  KVSIFT_FAIL("unknown dtype '", name, "' (kvsift reads F32, F16, BF16, I64, I32, U8)");
}

StDType st_dtype_of(DType t) {
  switch (t) {
    case DType::f32:
      return StDType::f32;
    case DType::f16:
      return StDType::f16;
    case DType::bf16:
      return StDType::bf16;
  }
  KVSIFT_FAIL("unknown kvsift dtype code ", static_cast<int>(t));
}

std::optional<DType> storage_dtype_of(StDType t) {
  switch (t) {
    case StDType::f32:
      return DType::f32;
    case StDType::f16:
      return DType::f16;
    case StDType::bf16:
      return DType::bf16;
    default:
      return std::nullopt;
  }
}

// --- StTensor ---------------------------------------------------------------------------------

std::int64_t StTensor::numel() const {
  const std::int64_t n = checked_numel(shape);
  KVSIFT_CHECK(n >= 0, "tensor shape ", shape_string(shape),
               " is negative or overflows an int64 element count");
  return n;
}

std::vector<float> StTensor::to_f32() const {
  KVSIFT_CHECK(dtype == StDType::f32 || dtype == StDType::f16 || dtype == StDType::bf16,
               "to_f32: tensor has integer dtype ", st_dtype_name(dtype),
               "; only F32, F16 and BF16 convert to floats (use to_i64)");
  check_byte_count(*this, "to_f32: tensor");
  const std::size_t n = static_cast<std::size_t>(numel());
  const std::size_t size = st_dtype_size(dtype);
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t* p = bytes.data() + i * size;
    switch (dtype) {
      case StDType::f32:
        out[i] = bits_to_float(static_cast<std::uint32_t>(load_le(p, 4)));
        break;
      case StDType::f16:
        out[i] = f16_bits_to_float(static_cast<std::uint16_t>(load_le(p, 2)));
        break;
      default:
        out[i] = bf16_bits_to_float(static_cast<std::uint16_t>(load_le(p, 2)));
        break;
    }
  }
  return out;
}

std::vector<std::int64_t> StTensor::to_i64() const {
  KVSIFT_CHECK(dtype == StDType::i64 || dtype == StDType::i32 || dtype == StDType::u8,
               "to_i64: tensor has floating-point dtype ", st_dtype_name(dtype),
               "; only I64, I32 and U8 convert to integers (use to_f32)");
  check_byte_count(*this, "to_i64: tensor");
  const std::size_t n = static_cast<std::size_t>(numel());
  const std::size_t size = st_dtype_size(dtype);
  std::vector<std::int64_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t* p = bytes.data() + i * size;
    switch (dtype) {
      case StDType::i64:
        out[i] = static_cast<std::int64_t>(load_le(p, 8));
        break;
      case StDType::i32:
        out[i] = static_cast<std::int32_t>(static_cast<std::uint32_t>(load_le(p, 4)));
        break;
      default:
        out[i] = p[0];
        break;
    }
  }
  return out;
}

// --- reading ----------------------------------------------------------------------------------

SafetensorsFile SafetensorsFile::load(const std::string& path, std::uint64_t max_bytes) {
  // read_file_bytes rejects directories, devices and FIFOs and caps the size before allocating.
  std::vector<std::uint8_t> image;
  try {
    image = read_file_bytes(path, max_bytes);
  } catch (const Error& e) {
    KVSIFT_FAIL("safetensors '", path, "': ", e.what());
  }
  return parse(image, path);
}

SafetensorsFile SafetensorsFile::parse(const std::vector<std::uint8_t>& image,
                                       const std::string& what) {
  const std::string where = "safetensors '" + what + "': ";
  KVSIFT_CHECK(image.size() >= kHeaderLengthBytes, where, "file is ", image.size(),
               " bytes, shorter than the 8-byte header length");
  const std::uint64_t header_len = load_le(image.data(), kHeaderLengthBytes);
  const std::uint64_t after_prefix = image.size() - kHeaderLengthBytes;
  KVSIFT_CHECK(header_len <= after_prefix, where, "header length ", header_len,
               " runs past the end of the file (", image.size(), " bytes): truncated header");

  const auto* header_begin = reinterpret_cast<const char*>(image.data() + kHeaderLengthBytes);
  json header;
  try {
    header = json::parse(header_begin, header_begin + header_len);
  } catch (const json::exception& e) {
    KVSIFT_FAIL(where, "bad JSON header: ", e.what());
  }
  KVSIFT_CHECK(header.is_object(), where, "JSON header is not an object (it is a ",
               header.type_name(), ")");

  const std::uint8_t* data = image.data() + kHeaderLengthBytes + header_len;
  const std::uint64_t data_size = after_prefix - header_len;

  SafetensorsFile file;
  std::vector<Placed> placed;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      KVSIFT_CHECK(entry.is_object(), where, "__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        KVSIFT_CHECK(value.is_string(), where, "metadata value of '", key,
                     "' is not a string (it is a ", value.type_name(), ")");
        file.metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string who = where + "tensor '" + name + "'";
    KVSIFT_CHECK(entry.is_object(), who, " entry is not an object");
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      KVSIFT_CHECK(entry.contains(field), who, " is missing '", field, "'");
    }
    const json& dtype = entry["dtype"];
    const json& shape = entry["shape"];
    const json& offsets = entry["data_offsets"];
    KVSIFT_CHECK(dtype.is_string(), who, " dtype is not a string");
    KVSIFT_CHECK(shape.is_array(), who, " shape is not an array");
    KVSIFT_CHECK(offsets.is_array() && offsets.size() == 2, who,
                 " data_offsets is not a [begin, end] pair (got ", offsets.dump(), ")");

    StTensor t;
    try {
      t.dtype = parse_st_dtype(dtype.get<std::string>());
    } catch (const Error& e) {
      KVSIFT_FAIL(who, ": ", e.what());
    }
    for (const json& d : shape) {
      t.shape.push_back(json_count(d, who + " shape holds a non-integer extent"));
    }
    check_shape_non_negative(t.shape, who);

    const std::int64_t begin =
        json_count(offsets[0], who + " data_offsets begin is not an integer");
    const std::int64_t end = json_count(offsets[1], who + " data_offsets end is not an integer");
    KVSIFT_CHECK(begin >= 0 && end >= 0, who, " has negative data_offsets [", begin, ", ", end,
                 "]");
    KVSIFT_CHECK(end >= begin, who, " data_offsets end (", end, ") < begin (", begin, ")");
    KVSIFT_CHECK(static_cast<std::uint64_t>(end) <= data_size, who, " data_offsets [", begin, ", ",
                 end, "] run past the end of the data block (", data_size,
                 " bytes): out of range or truncated data");

    const std::int64_t need = checked_bytes(checked_numel(t.shape), t.dtype);
    KVSIFT_CHECK(need == end - begin, who, " byte count ", end - begin,
                 " != numel * element size (",
                 need >= 0 ? std::to_string(need) : std::string("overflow"), " for ",
                 st_dtype_name(t.dtype), " ", shape_string(t.shape), ")");

    t.bytes.assign(data + begin, data + end);
    placed.push_back({name, static_cast<std::uint64_t>(begin), static_cast<std::uint64_t>(end)});
    file.tensors_.emplace(name, std::move(t));
  }

  // Two tensors sharing bytes would alias on write-back; the reference loader rejects it too.
  std::sort(placed.begin(), placed.end(), [](const Placed& a, const Placed& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (std::size_t i = 1; i < placed.size(); ++i) {
    const Placed& a = placed[i - 1];
    const Placed& b = placed[i];
    const bool empty = a.begin == a.end || b.begin == b.end;  // zero-size tensors share nothing
    KVSIFT_CHECK(empty || b.begin >= a.end, where, "tensors '", a.name, "' [", a.begin, ", ", a.end,
                 ") and '", b.name, "' [", b.begin, ", ", b.end, ") overlap");
  }
  return file;
}

// --- access -----------------------------------------------------------------------------------

const StTensor& SafetensorsFile::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    std::string have;
    for (const auto& kv : tensors_) have += (have.empty() ? "" : ", ") + kv.first;
    KVSIFT_FAIL("missing tensor '", name, "' (have: ", have.empty() ? "none" : have, ")");
  }
  return it->second;
}

const StTensor& SafetensorsFile::get(const std::string& name,
                                     const std::vector<std::int64_t>& expected) const {
  const StTensor& t = get(name);
  bool match = t.shape.size() == expected.size();
  for (std::size_t k = 0; match && k < expected.size(); ++k) {
    match = expected[k] == -1 || expected[k] == t.shape[k];
  }
  KVSIFT_CHECK(match, "tensor '", name, "' has shape ", shape_string(t.shape), ", expected ",
               shape_string(expected), " (-1 = any)");
  return t;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

// --- building ---------------------------------------------------------------------------------

void SafetensorsFile::put(const std::string& name, StTensor t) {
  KVSIFT_CHECK(!name.empty() && name != kMetadataKey, "tensor name '", name,
               "' is reserved or empty");
  const std::string who = "put: tensor '" + name + "'";
  check_shape_non_negative(t.shape, who);
  st_dtype_size(t.dtype);  // rejects an out-of-range enum value
  check_byte_count(t, who);
  tensors_[name] = std::move(t);
}

void SafetensorsFile::put_f32(const std::string& name, std::vector<std::int64_t> shape,
                              const float* data) {
  StTensor t;
  t.dtype = StDType::f32;
  t.shape = std::move(shape);
  check_shape_non_negative(t.shape, "put_f32: tensor '" + name + "'");
  const auto n = static_cast<std::size_t>(t.numel());
  t.bytes.resize(n * 4);
  for (std::size_t i = 0; i < n; ++i) store_le(float_bits(data[i]), 4, t.bytes.data() + i * 4);
  put(name, std::move(t));
}

void SafetensorsFile::put_i64(const std::string& name, std::vector<std::int64_t> shape,
                              const std::int64_t* data) {
  StTensor t;
  t.dtype = StDType::i64;
  t.shape = std::move(shape);
  check_shape_non_negative(t.shape, "put_i64: tensor '" + name + "'");
  const auto n = static_cast<std::size_t>(t.numel());
  t.bytes.resize(n * 8);
  for (std::size_t i = 0; i < n; ++i) {
    store_le(static_cast<std::uint64_t>(data[i]), 8, t.bytes.data() + i * 8);
  }
  put(name, std::move(t));
}

void SafetensorsFile::put_u8(const std::string& name, std::vector<std::int64_t> shape,
                             const std::uint8_t* data) {
  StTensor t;
  t.dtype = StDType::u8;
  t.shape = std::move(shape);
  check_shape_non_negative(t.shape, "put_u8: tensor '" + name + "'");
  t.bytes.assign(data, data + t.numel());
  put(name, std::move(t));
}

// --- writing ----------------------------------------------------------------------------------

std::vector<std::uint8_t> SafetensorsFile::serialize() const {
  // std::map iterates by name, so tensors (and their data) come out sorted, as the reference
  // writer lays them out; offsets follow that order with no gaps.
  json header = json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors_) {
    header[name] = {{"dtype", st_dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  if (!metadata_.empty()) header[kMetadataKey] = metadata_;

  std::string text = header.dump();
  text.append((kHeaderAlignment - text.size() % kHeaderAlignment) % kHeaderAlignment, ' ');

  std::vector<std::uint8_t> image(kHeaderLengthBytes);
  image.reserve(kHeaderLengthBytes + text.size() + offset);
  store_le(text.size(), kHeaderLengthBytes, image.data());
  image.insert(image.end(), text.begin(), text.end());
  for (const auto& kv : tensors_)
    image.insert(image.end(), kv.second.bytes.begin(), kv.second.bytes.end());
  return image;
}

void SafetensorsFile::save(const std::string& path) const {
  // A fresh O_EXCL temporary renamed over `path`: a crash mid-write never leaves a torn file, a
  // planted symlink is never followed, and a non-regular `path` is never replaced.
  write_file_atomically(path, serialize());
}

StTensor StTensor::from_i32(std::vector<std::int64_t> shape,
                            const std::vector<std::int32_t>& values) {
  StTensor t;
  t.dtype = StDType::i32;
  t.shape = std::move(shape);
  KVSIFT_CHECK(t.numel() == static_cast<std::int64_t>(values.size()),
               "StTensor::from_i32: ", values.size(), " values for a shape of ", t.numel(),
               " elements");
  t.bytes.resize(values.size() * sizeof(std::int32_t));
  if (!values.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

}  // namespace kvsift
