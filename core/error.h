#pragma once
// Errors and checks used across tdist.
//
// Every failure that a user can see is a `tdist::Error` (a std::runtime_error), or one of its
// subclasses so that callers can tell apart what they may want to handle:
//   TimeoutError     a blocking wait ran past its deadline (the message names who waited for what)
//   NetworkError     a connection could not be made, or broke
//   ProtocolError    bytes from a peer did not follow the wire format
//   InvalidArgument  the caller passed something that cannot work (programmer error)
//
// TDIST_CHECK(cond, msg...) throws tdist::Error with file:line, the condition and the message
// (message parts are streamed with operator<<). TDIST_CHECK_EQ/NE/LT/LE/GT/GE also print both
// values. TDIST_CHECK_ARG throws InvalidArgument; TDIST_THROW(Type, msg...) throws any subclass.

#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "tdist/core/detail/error_format.h"

namespace tdist {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

class TimeoutError : public Error {
 public:
  using Error::Error;
};

class NetworkError : public Error {
 public:
  using Error::Error;
};

class ProtocolError : public Error {
 public:
  using Error::Error;
};

class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Concatenates the arguments with operator<<.
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::stream_all(os, args...);
  return os.str();
}

// The message of a stored exception: what() of a std::exception, else "a non-standard
// exception"; an empty pointer gives "no exception".
inline std::string exception_message(const std::exception_ptr& e) {
  if (!e) return "no exception";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

}  // namespace tdist

#define TDIST_THROW(ErrorType, ...) \
  ::tdist::detail::throw_at<ErrorType>(__FILE__, __LINE__, __VA_ARGS__)

#define TDIST_CHECK(cond, ...)                                                                   \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      ::tdist::detail::throw_at<::tdist::Error>(__FILE__, __LINE__, "check failed: " #cond ": ", \
                                                ##__VA_ARGS__);                                  \
    }                                                                                            \
  } while (0)

#define TDIST_CHECK_ARG(cond, ...)                                                              \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      ::tdist::detail::throw_at<::tdist::InvalidArgument>(__FILE__, __LINE__,                   \
                                                          "invalid argument: ", ##__VA_ARGS__); \
    }                                                                                           \
  } while (0)

#define TDIST_CHECK_OP_(a, b, op, ...)                                                             \
  do {                                                                                             \
    const auto& tdist_a_ = (a);                                                                    \
    const auto& tdist_b_ = (b);                                                                    \
    if (!(tdist_a_ op tdist_b_)) {                                                                 \
      ::tdist::detail::throw_at<::tdist::Error>(__FILE__, __LINE__,                                \
                                                "check failed: " #a " " #op " " #b " (", tdist_a_, \
                                                " vs ", tdist_b_, ") ", ##__VA_ARGS__);            \
    }                                                                                              \
  } while (0)

#define TDIST_CHECK_EQ(a, b, ...) TDIST_CHECK_OP_(a, b, ==, ##__VA_ARGS__)
#define TDIST_CHECK_NE(a, b, ...) TDIST_CHECK_OP_(a, b, !=, ##__VA_ARGS__)
#define TDIST_CHECK_LT(a, b, ...) TDIST_CHECK_OP_(a, b, <, ##__VA_ARGS__)
#define TDIST_CHECK_LE(a, b, ...) TDIST_CHECK_OP_(a, b, <=, ##__VA_ARGS__)
#define TDIST_CHECK_GT(a, b, ...) TDIST_CHECK_OP_(a, b, >, ##__VA_ARGS__)
#define TDIST_CHECK_GE(a, b, ...) TDIST_CHECK_OP_(a, b, >=, ##__VA_ARGS__)
