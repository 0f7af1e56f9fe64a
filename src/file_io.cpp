// POSIX implementation of core/file_io.hpp. Every system call's failure becomes a kvsift::Error
// with the path and strerror(errno); nothing here follows a symlink it is about to write through.
#include "kvsift/core/file_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kvsift/core/error.hpp"

namespace kvsift {

namespace {

std::string sys_error() { return std::strerror(errno); }

const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Closes a descriptor on scope exit unless released.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  int release() {
    const int f = fd;
    fd = -1;
    return f;
  }
};

std::string directory_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string base_name(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// A name no one else is using yet; O_EXCL makes the final decision.
std::string temporary_name(const std::string& path, unsigned attempt) {
  static std::atomic<unsigned long> counter{0};
  const auto ticks =
      static_cast<unsigned long>(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::string dir = directory_of(path);
  return (dir == "/" ? "" : dir) + "/." + base_name(path) + ".tmp." +
         std::to_string(static_cast<long>(::getpid())) + "." +
         std::to_string(counter.fetch_add(1)) + "." + std::to_string((ticks ^ attempt) % 1000000);
}

void write_all(int fd, const std::uint8_t* p, std::size_t n, const std::string& path,
               const std::string& tmp) {
  while (n > 0) {
    const std::size_t chunk = n < (std::size_t{1} << 30) ? n : (std::size_t{1} << 30);
    const ssize_t w = ::write(fd, p, chunk);
    if (w < 0 && errno == EINTR) continue;
    KVSIFT_CHECK(w > 0, "write '", path, "': writing the temporary '", tmp,
                 "' failed: ", w < 0 ? sys_error() : std::string("no progress"));
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

}  // namespace

std::vector<std::uint8_t> read_file_bytes(const std::string& path, std::uint64_t max_bytes) {
  KVSIFT_CHECK(!path.empty(), "read: the input path is empty");
  // O_NONBLOCK: opening a FIFO with no writer would otherwise block forever before fstat() can
  // reject it. It has no effect on reads of a regular file.
  Fd fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK)};
  KVSIFT_CHECK(fd.fd >= 0, "read '", path, "': cannot open: ", sys_error());
  struct stat st {};
  KVSIFT_CHECK(::fstat(fd.fd, &st) == 0, "read '", path, "': cannot stat: ", sys_error());
  KVSIFT_CHECK(S_ISREG(st.st_mode), "read '", path, "': is ", file_kind(st.st_mode),
               ", not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  KVSIFT_CHECK(size <= max_bytes, "read '", path, "': file is ", size,
               " bytes, over the input limit of ", max_bytes, " bytes");
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t r = ::read(fd.fd, bytes.data() + got, bytes.size() - got);
    if (r < 0 && errno == EINTR) continue;
    KVSIFT_CHECK(r >= 0, "read '", path, "': read error: ", sys_error());
    KVSIFT_CHECK(r > 0, "read '", path, "': file shrank while being read (", got, " of ", size,
                 " bytes)");
    got += static_cast<std::size_t>(r);
  }
  std::uint8_t extra = 0;
  ssize_t r;
  do {
    r = ::read(fd.fd, &extra, 1);
  } while (r < 0 && errno == EINTR);
  KVSIFT_CHECK(r == 0, "read '", path, "': file grew while being read (more than ", size,
               " bytes)");
  return bytes;
}

void check_output_not_input(const std::string& output, const std::vector<std::string>& inputs) {
  KVSIFT_CHECK(!output.empty(), "output path is empty");
  struct stat out {};
  const bool out_exists = ::stat(output.c_str(), &out) == 0;
  char out_real[PATH_MAX];
  const bool out_resolved = ::realpath(output.c_str(), out_real) != nullptr;
  for (const std::string& input : inputs) {
    struct stat in {};
    if (out_exists && ::stat(input.c_str(), &in) == 0) {
      KVSIFT_CHECK(!(in.st_dev == out.st_dev && in.st_ino == out.st_ino), "output '", output,
                   "' is the same file as input '", input,
                   "'; writing it would destroy the input (choose another output path)");
    }
    char in_real[PATH_MAX];
    if (out_resolved && ::realpath(input.c_str(), in_real) != nullptr) {
      KVSIFT_CHECK(std::strcmp(in_real, out_real) != 0, "output '", output, "' resolves to '",
                   out_real, "', the input '", input,
                   "'; writing it would destroy the input (choose another output path)");
    }
  }
}

void write_file_atomically(const std::string& path, const void* data, std::size_t size) {
  KVSIFT_CHECK(!path.empty(), "write: the output path is empty");
  KVSIFT_CHECK(path.back() != '/', "write '", path, "': names a directory, not a file");
  KVSIFT_CHECK(data != nullptr || size == 0, "write '", path, "': no data (null pointer)");
  // lstat, not stat: a symlink at `path` is itself refused, never followed.
  struct stat existing {};
  const bool exists = ::lstat(path.c_str(), &existing) == 0;
  KVSIFT_CHECK(exists || errno == ENOENT, "write '", path, "': cannot stat: ", sys_error());
  KVSIFT_CHECK(!exists || S_ISREG(existing.st_mode), "write '", path, "': refusing to replace ",
               file_kind(existing.st_mode), "; only a regular file is ever replaced");

  std::string tmp;
  Fd fd;
  for (unsigned attempt = 0; attempt < 64 && fd.fd < 0; ++attempt) {
    tmp = temporary_name(path, attempt);
    fd.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    KVSIFT_CHECK(fd.fd >= 0 || errno == EEXIST, "write '", path,
                 "': cannot create a temporary in '", directory_of(path), "': ", sys_error());
  }
  KVSIFT_CHECK(fd.fd >= 0, "write '", path, "': no free temporary name in '", directory_of(path),
               "'");
  try {
    if (exists) (void)::fchmod(fd.fd, existing.st_mode & 07777);  // keep a replaced file's mode
    write_all(fd.fd, static_cast<const std::uint8_t*>(data), size, path, tmp);
    KVSIFT_CHECK(::fsync(fd.fd) == 0, "write '", path, "': fsync of '", tmp,
                 "' failed: ", sys_error());
    KVSIFT_CHECK(::close(fd.release()) == 0, "write '", path, "': closing '", tmp,
                 "' failed: ", sys_error());
    // Checked again just before the rename: something may have been planted meanwhile. (A window
    // remains between this check and rename(); rename itself never follows a symlink at `path`.)
    struct stat now {};
    if (::lstat(path.c_str(), &now) == 0) {
      KVSIFT_CHECK(S_ISREG(now.st_mode), "write '", path, "': refusing to replace ",
                   file_kind(now.st_mode), "; only a regular file is ever replaced");
    }
    KVSIFT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "write '", path,
                 "': cannot rename the temporary '", tmp, "' over it: ", sys_error());
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  // Make the rename itself durable; failure here cannot undo a complete file, so it is ignored.
  Fd dir{::open(directory_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dir.fd >= 0) (void)::fsync(dir.fd);
}

void write_file_atomically(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  write_file_atomically(path, bytes.data(), bytes.size());
}

void write_file_atomically(const std::string& path, const std::string& text) {
  write_file_atomically(path, text.data(), text.size());
}

}  // namespace kvsift
