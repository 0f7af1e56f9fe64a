// Safe file I/O (core/file_io.hpp) and hostile safetensors files: every file, link, FIFO and
// header here is made by the test in its own temporary directory. /dev/null is used only as a
// target that must be refused and left untouched.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/file_io.hpp"
#include "kvsift/core/safetensors.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

// A fresh directory removed (with its plain entries) at scope exit.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/kvsift_fileio_XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void spit(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  const std::string cmd = "ls -A '" + dir + "'";
  FILE* p = ::popen(cmd.c_str(), "r");
  char line[4096];
  while (p && std::fgets(line, sizeof line, p)) {
    std::string s(line);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    out.push_back(s);
  }
  if (p) ::pclose(p);
  return out;
}

// An image with the given JSON header and `data` bytes after it.
std::vector<std::uint8_t> image(const std::string& header, std::size_t data = 0) {
  std::vector<std::uint8_t> out(8 + header.size() + data, 0);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(n >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  return out;
}

}  // namespace

TEST_CASE("read_file_bytes rejects directories, devices and FIFOs by name") {
  TempDir dir;
  REQUIRE_THROWS_WITH(read_file_bytes(dir.path),
                      Contains("read '" + dir.path + "': is a directory, not a regular file"));
  REQUIRE_THROWS_WITH(read_file_bytes("/dev/zero"),
                      Contains("read '/dev/zero': is a character device, not a regular file"));
  const std::string fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // Must not block waiting for a writer.
  REQUIRE_THROWS_WITH(read_file_bytes(fifo), Contains("is a FIFO, not a regular file"));
  REQUIRE_THROWS_WITH(read_file_bytes(dir / "missing"), Contains("cannot open"));
  REQUIRE_THROWS_WITH(SafetensorsFile::load(dir.path), Contains("safetensors '" + dir.path + "'"));
}

TEST_CASE("read_file_bytes caps the size before allocating") {
  TempDir dir;
  spit(dir / "ten", "0123456789");
  REQUIRE(read_file_bytes(dir / "ten").size() == 10);
  REQUIRE(read_file_bytes(dir / "ten", 10).size() == 10);
  REQUIRE_THROWS_WITH(read_file_bytes(dir / "ten", 9),
                      Contains("file is 10 bytes, over the input limit of 9 bytes"));
  REQUIRE_THROWS_WITH(SafetensorsFile::load(dir / "ten", 4), Contains("over the input limit"));
  REQUIRE(kDefaultMaxInputBytes == (std::uint64_t{4} << 30));
}

TEST_CASE("write_file_atomically writes, replaces regular files and leaves no temporary") {
  TempDir dir;
  const std::string out = dir / "out.bin";
  write_file_atomically(out, std::string("first"));
  REQUIRE(slurp(out) == "first");
  REQUIRE(::chmod(out.c_str(), 0640) == 0);
  write_file_atomically(out, std::string("second"));
  REQUIRE(slurp(out) == "second");
  struct stat st {};
  REQUIRE(::stat(out.c_str(), &st) == 0);
  REQUIRE((st.st_mode & 0777) == 0640);  // a replaced file keeps its mode
  write_file_atomically(out, std::vector<std::uint8_t>{});
  REQUIRE(slurp(out).empty());
  REQUIRE(entries(dir.path) == std::vector<std::string>{"out.bin"});
}

TEST_CASE("write_file_atomically never follows or replaces a symlink, directory or device") {
  TempDir dir;
  const std::string victim = dir / "victim";
  spit(victim, "precious");
  const std::string link = dir / "link";
  REQUIRE(::symlink(victim.c_str(), link.c_str()) == 0);
  REQUIRE_THROWS_WITH(write_file_atomically(link, std::string("x")),
                      Contains("write '" + link + "': refusing to replace a symbolic link"));
  REQUIRE(slurp(victim) == "precious");
  struct stat st {};
  REQUIRE(::lstat(link.c_str(), &st) == 0);
  REQUIRE(S_ISLNK(st.st_mode));  // still the link, not a regular file

  // The old writer opened "<out>.tmp" and followed a symlink planted there; the new one never
  // opens an existing name.
  const std::string planted = dir / "out.tmp";
  REQUIRE(::symlink(victim.c_str(), planted.c_str()) == 0);
  write_file_atomically(dir / "out", std::string("fresh"));
  REQUIRE(slurp(victim) == "precious");
  REQUIRE(slurp(dir / "out") == "fresh");

  const std::string sub = dir / "sub";
  REQUIRE(::mkdir(sub.c_str(), 0700) == 0);
  REQUIRE_THROWS_WITH(write_file_atomically(sub, std::string("x")),
                      Contains("refusing to replace a directory"));

  // /dev/null: refused and untouched (still a character device).
  struct stat before {};
  REQUIRE(::stat("/dev/null", &before) == 0);
  REQUIRE_THROWS_WITH(write_file_atomically("/dev/null", std::string("x")),
                      Contains("write '/dev/null': refusing to replace a character device"));
  SafetensorsFile f;
  const float one = 1.0f;
  f.put_f32("x", {1}, &one);
  REQUIRE_THROWS_WITH(f.save("/dev/null"), Contains("refusing to replace a character device"));
  struct stat after {};
  REQUIRE(::stat("/dev/null", &after) == 0);
  REQUIRE(S_ISCHR(after.st_mode));
  REQUIRE(after.st_ino == before.st_ino);
  REQUIRE(after.st_rdev == before.st_rdev);

  REQUIRE_THROWS_WITH(write_file_atomically(dir / "nodir/out", std::string("x")),
                      Contains("cannot create a temporary"));
}

TEST_CASE("a failed write reports the error, removes the temporary and keeps the old file") {
  TempDir dir;
  const std::string out = dir / "out.bin";
  spit(out, "old");
  // Cap the file size so write() fails with EFBIG half-way (SIGXFSZ ignored so it is an error,
  // not a signal), then restore the limit.
  struct rlimit saved {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
  auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 100;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::string error;
  try {
    write_file_atomically(out, std::string(1000, 'x'));
  } catch (const Error& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, old_handler);
  REQUIRE_THAT(error, Contains("write '" + out + "': writing the temporary"));
  REQUIRE(slurp(out) == "old");
  REQUIRE(entries(dir.path) == std::vector<std::string>{"out.bin"});
}

TEST_CASE("check_output_not_input refuses an output that resolves to an input") {
  TempDir dir;
  const std::string in = dir / "case.safetensors";
  spit(in, "data");
  REQUIRE_THROWS_WITH(check_output_not_input(in, {in}), Contains("is the same file as input"));
  REQUIRE_THROWS_WITH(check_output_not_input(dir.path + "/./case.safetensors", {in}),
                      Contains("the same file as input"));
  const std::string link = dir / "alias";
  REQUIRE(::symlink(in.c_str(), link.c_str()) == 0);
  REQUIRE_THROWS_WITH(check_output_not_input(link, {dir / "other", in}),
                      Contains("same file as input '" + in + "'"));
  const std::string hard = dir / "hard";
  REQUIRE(::link(in.c_str(), hard.c_str()) == 0);
  REQUIRE_THROWS_WITH(check_output_not_input(hard, {in}), Contains("same file as input"));
  REQUIRE_NOTHROW(check_output_not_input(dir / "new.safetensors", {in}));
  spit(dir / "other.safetensors", "x");
  REQUIRE_NOTHROW(check_output_not_input(dir / "other.safetensors", {in, dir / "missing"}));
  REQUIRE(slurp(in) == "data");
}

TEST_CASE("hostile safetensors headers are errors naming the fault") {
  const std::string hdr = R"({"t":{"dtype":"F32","shape":[)";
  // Extents whose product wraps int64 to a small number.
  auto wrap = image(hdr + R"(4294967296,4294967296,4],"data_offsets":[0,0]}})");
  REQUIRE_THROWS_WITH(SafetensorsFile::parse(wrap, "wrap"), Contains("overflow"));
  auto neg = image(hdr + R"(-1,4],"data_offsets":[0,16]}})", 16);
  REQUIRE_THROWS_WITH(SafetensorsFile::parse(neg, "neg"), Contains("negative dimension 0 (-1)"));
  auto big = image(hdr + R"(18446744073709551615],"data_offsets":[0,4]}})", 4);
  REQUIRE_THROWS_WITH(SafetensorsFile::parse(big, "big"), Contains("beyond int64"));
  auto past = image(hdr + R"(4],"data_offsets":[0,16]}})", 8);
  REQUIRE_THROWS_WITH(SafetensorsFile::parse(past, "past"), Contains("run past the end"));
  auto frac = image(hdr + R"(4.5],"data_offsets":[0,16]}})", 16);
  REQUIRE_THROWS_WITH(SafetensorsFile::parse(frac, "frac"), Contains("non-integer extent"));
  // Header length beyond the file.
  std::vector<std::uint8_t> lying(8, 0xff);
  REQUIRE_THROWS_WITH(SafetensorsFile::parse(lying, "lying"), Contains("runs past the end"));
}

TEST_CASE("safetensors save round-trips through the atomic writer") {
  TempDir dir;
  SafetensorsFile f;
  const float x[3] = {1.5f, -2.0f, 3.25f};
  f.put_f32("x", {3}, x);
  f.metadata()["k"] = "v";
  f.save(dir / "a.safetensors");
  const SafetensorsFile g = SafetensorsFile::load(dir / "a.safetensors");
  REQUIRE(g.get("x").to_f32() == std::vector<float>{1.5f, -2.0f, 3.25f});
  REQUIRE(g.metadata().at("k") == "v");
  REQUIRE(entries(dir.path) == std::vector<std::string>{"a.safetensors"});
}
