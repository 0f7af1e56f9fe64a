// Runs the built `kvsift` binary (KVSIFT_TOOL_BINARY, set by this folder's CMakeLists) as a user
// would, for the tests of what only the whole tool shows: the exit status and the message of a
// refused command line, and what is (not) left on disk afterwards.
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace kvsift::tool_test {

struct ToolRun {
  int exit_code = -1;  // the exit status, or -1 when killed by a signal
  std::string output;  // stdout and stderr together
};

// `kvsift <args...>`, output captured through `capture` (a path the test owns).
inline ToolRun run_tool(const std::vector<std::string>& args, const std::string& capture) {
  std::vector<std::string> argv_s{KVSIFT_TOOL_BINARY};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  ToolRun r;
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(capture.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) ::_exit(126);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return r;
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  std::ifstream in(capture, std::ios::binary);
  r.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  ::unlink(capture.c_str());
  return r;
}

}  // namespace kvsift::tool_test
