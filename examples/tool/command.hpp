// Subcommands of the `kvsift` tool register themselves here, one file each (tool/<name>.cpp):
//   static const RegisterCommand reg{{"score", "score a golden-format case", &run_score}};
#pragma once

#include <string>
#include <vector>

namespace kvsift::tool {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);  // args after the subcommand name
};

inline std::vector<Command>& commands() {
  static std::vector<Command> all;
  return all;
}

struct RegisterCommand {
  explicit RegisterCommand(Command c) { commands().push_back(c); }
};

}  // namespace kvsift::tool
