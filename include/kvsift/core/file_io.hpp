// Safe file input and output for everything kvsift reads or writes (safetensors cases and
// outputs, steering vectors, the tool's JSON reports). Inputs: regular files only, size-capped,
// read whole. Outputs: never written in place and never through a name that already exists —
// a fresh temporary is created with O_CREAT|O_EXCL next to the target, synced, then renamed over
// it; anything that is not a regular file is never replaced; a failed write leaves no file behind.
// Implemented in src/file_io.cpp (POSIX).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvsift {

// The default cap on an input file's size: 4 GiB. Larger than any golden case or calibration set
// by orders of magnitude, small enough that `--case /dev/zero`-style mistakes and hostile files
// fail fast instead of exhausting memory. Callers that need more pass their own cap.
inline constexpr std::uint64_t kDefaultMaxInputBytes = std::uint64_t{4} << 30;

// Reads the whole of `path`. Throws kvsift::Error naming the path when it cannot be opened, is not
// a regular file (a directory, a device such as /dev/zero, a FIFO, a socket), is larger than
// `max_bytes`, or changes size while being read. A FIFO is opened non-blocking, so it is rejected
// instead of hanging the reader.
std::vector<std::uint8_t> read_file_bytes(const std::string& path,
                                          std::uint64_t max_bytes = kDefaultMaxInputBytes);

// Throws kvsift::Error when `output` names the same file as any of `inputs`: the same device and
// inode (through symlinks, hard links, "./a" vs "a"), or the same canonical path. Call it before
// any work whose output would destroy an input (`--out` equal to `--case`). Inputs that do not
// exist are skipped (the reader reports them); an output that does not exist yet matches nothing.
void check_output_not_input(const std::string& output, const std::vector<std::string>& inputs);

// Writes `size` bytes to `path` atomically: a new temporary beside `path` (same directory, so the
// rename stays on one filesystem) is created with O_CREAT|O_EXCL|O_NOFOLLOW, written, fsync'ed and
// renamed over `path`; the directory is then synced. Throws kvsift::Error naming the path and the
// system error when `path` exists but is not a regular file (symlink, directory, device node, FIFO
// — never replaced, never followed), when the directory is missing or not writable, or on any
// failed write, sync or rename; in every failure the temporary is removed and `path` is untouched.
// A replaced regular file keeps its permission bits; a new one gets 0666 minus the umask.
void write_file_atomically(const std::string& path, const void* data, std::size_t size);
void write_file_atomically(const std::string& path, const std::vector<std::uint8_t>& bytes);
void write_file_atomically(const std::string& path, const std::string& text);

}  // namespace kvsift
