// `kvsift`: the command-line face of the library. Each subcommand lives in its own file and
// registers itself (command.hpp); errors print one line and exit non-zero, never crash.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "command.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/version.hpp"

namespace {
void usage() {
  std::printf("kvsift %s: KV-cache compression policies for reasoning models\n\n",
              kvsift::version_string().c_str());
  std::printf("usage: kvsift <command> [--flag value ...]\n\ncommands:\n");
  for (const auto& c : kvsift::tool::commands()) std::printf("  %-10s %s\n", c.name, c.summary);
  std::printf("\n'kvsift <command> --help' lists a command's flags.\n");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::printf("%s\n", kvsift::version_string().c_str());
    return 0;
  }
  const std::vector<std::string> args(argv + 2, argv + argc);
  for (const auto& c : kvsift::tool::commands()) {
    if (std::strcmp(c.name, argv[1]) != 0) continue;
    try {
      return c.run(args);
    } catch (const kvsift::Error& e) {
      std::fprintf(stderr, "kvsift %s: error: %s\n", c.name, e.what());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kvsift %s: error: %s\n", c.name, e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "kvsift: unknown command '%s'\n\n", argv[1]);
  usage();
  return 2;
}
