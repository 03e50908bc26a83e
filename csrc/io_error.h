// The one error type the native core throws: errno + what was being done + the path.
// module.cpp translates it into Python's OSError(errno, message, filename), which Python
// maps onto FileNotFoundError, PermissionError, ... by errno.
#pragma once
#include <cstring>
#include <stdexcept>
#include <string>

namespace fastckpt {

class IoError : public std::runtime_error {
 public:
  // `what` says what failed, without the errno's text: what() appends strerror(err) once.
  IoError(int err, const std::string& what, std::string path = "")
      : std::runtime_error(what.empty() ? std::strerror(err) : what + ": " + std::strerror(err)),
        err_(err),
        message_(what),
        path_(std::move(path)) {}
  int err() const { return err_; }
  // What failed, without strerror(err): pass this, not what(), to rethrow as a new IoError.
  const std::string& message() const { return message_; }
  const std::string& path() const { return path_; }

 private:
  int err_;
  std::string message_;
  std::string path_;
};

}  // namespace fastckpt
