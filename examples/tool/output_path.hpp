// The tool's one check on an output path, run by every subcommand that writes (score, quantize,
// dequantize, calibrate) BEFORE any work: `--out` must not name an input (the same file through
// "./", a hard link or a symlink: check_output_not_input), and an existing `--out` must be a
// regular file, so a symlink, directory or device node is refused up front rather than after a
// long run. write_file_atomically enforces the same rule again at write time (the name may change
// in between); this check only makes the refusal early and cheap.
#pragma once

#include <sys/stat.h>

#include <string>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/file_io.hpp"

namespace kvsift::tool {

inline void check_output_path(const std::string& out, const std::vector<std::string>& inputs) {
  check_output_not_input(out, inputs);
  struct stat st {};
  if (::lstat(out.c_str(), &st) != 0) return;  // absent: created by the write
  const char* kind = S_ISLNK(st.st_mode)    ? "a symbolic link"
                     : S_ISDIR(st.st_mode)  ? "a directory"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                                            : nullptr;
  KVSIFT_CHECK(kind == nullptr, "--out '", out, "' is ", kind,
               "; only a regular file is ever replaced (choose another output path)");
}

}  // namespace kvsift::tool
