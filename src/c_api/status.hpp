// How the C API turns C++ failures into a kvsift_status plus a per-thread message: every entry
// point runs its body inside guarded(), so no exception ever crosses the C boundary.
#pragma once

#include <exception>
#include <new>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "kvsift/c/kvsift.h"
#include "kvsift/core/error.hpp"

namespace kvsift::c_api {

// A failure whose status is not INVALID_ARGUMENT (NO_CUDA, UNSUPPORTED), raised by the C layer's
// own checks before it reaches the C++ API.
class StatusError : public std::runtime_error {
 public:
  StatusError(kvsift_status status, const std::string& what)
      : std::runtime_error(what), status_(status) {}
  kvsift_status status() const { return status_; }

 private:
  kvsift_status status_;
};

// The message kvsift_last_error() returns on this thread.
std::string& last_error();

// Runs `body`; on an exception stores "<function>: <message>" and returns its status. The error
// is cleared first, so a successful call leaves "".
template <class Body>
kvsift_status guarded(const char* function, Body&& body) noexcept {
  try {
    last_error().clear();
    body();
    return KVSIFT_OK;
  } catch (const StatusError& e) {
    last_error() = std::string(function) + ": " + e.what();
    return e.status();
  } catch (const Error& e) {
    last_error() = std::string(function) + ": " + e.what();
    return KVSIFT_ERROR_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    // Building the message may itself fail when memory is exhausted.
    try {
      last_error() = std::string(function) + ": out of host memory";
    } catch (...) {
    }
    return KVSIFT_ERROR_OUT_OF_MEMORY;
  } catch (const nlohmann::json::exception& e) {  // a config the registry did not translate
    try {
      last_error() = std::string(function) + ": JSON config: " + e.what();
    } catch (...) {
    }
    return KVSIFT_ERROR_INVALID_ARGUMENT;
  } catch (const std::exception& e) {
    try {
      last_error() = std::string(function) + ": internal error: " + e.what();
    } catch (...) {
    }
    return KVSIFT_ERROR_INTERNAL;
  } catch (...) {
    try {
      last_error() = std::string(function) + ": internal error: unknown exception";
    } catch (...) {
    }
    return KVSIFT_ERROR_INTERNAL;
  }
}

}  // namespace kvsift::c_api
