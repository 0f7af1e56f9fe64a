// libFuzzer harness for the safetensors reader (src/safetensors.cpp): any byte string must either
// parse or raise kvsift::Error — never crash, read out of bounds or allocate without bound (ASan
// and UBSan watch). A parsed file must convert every tensor and survive serialize -> parse.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<std::uint8_t> image(data, data + size);
  kvsift::SafetensorsFile file;
  try {
    file = kvsift::SafetensorsFile::parse(image, "fuzz");
  } catch (const kvsift::Error&) {
    return 0;  // rejected with a message: the expected outcome for most inputs
  }
  for (const std::string& name : file.names()) {
    const kvsift::StTensor& t = file.get(name);
    try {
      if (kvsift::storage_dtype_of(t.dtype).has_value()) {
        (void)t.to_f32();
      } else {
        (void)t.to_i64();
      }
    } catch (const kvsift::Error&) {
      std::abort();  // a tensor that parsed must convert
    }
  }
  try {
    const kvsift::SafetensorsFile again = kvsift::SafetensorsFile::parse(file.serialize(), "again");
    if (again.names() != file.names() || again.metadata() != file.metadata()) std::abort();
  } catch (const kvsift::Error&) {
    std::abort();  // what kvsift writes, kvsift must read
  }
  return 0;
}
