// What the opaque C handles hold.
#pragma once

#include <memory>
#include <string>

#include "kvsift/core/keep_plan.hpp"
#include "kvsift/policy/cache_owning_policy.hpp"
#include "kvsift/policy/policy.hpp"

struct kvsift_policy {
  std::unique_ptr<kvsift::Policy> impl;
  std::string name;  // the registry name it was created from (NUL-terminated for C)
};

struct kvsift_plan {
  kvsift::KeepPlan plan;
};

struct kvsift_owning_policy {
  std::unique_ptr<kvsift::CacheOwningPolicy> impl;
};
