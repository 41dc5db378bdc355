#pragma once
// Sets environment variables for one scope and restores the previous values after it.
#include <cstdlib>
#include <map>
#include <optional>
#include <string>

namespace tdist::test {

using EnvVars = std::map<std::string, std::optional<std::string>>;

class EnvGuard {
 public:
  // A value of std::nullopt unsets the variable.
  explicit EnvGuard(const EnvVars& vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k.c_str());
      saved_[k] = old ? std::optional<std::string>(old) : std::nullopt;
      apply(k, v);
    }
  }
  ~EnvGuard() {
    for (const auto& [k, v] : saved_) apply(k, v);
  }

 private:
  static void apply(const std::string& k, const std::optional<std::string>& v) {
    if (v) {
      setenv(k.c_str(), v->c_str(), 1);
    } else {
      unsetenv(k.c_str());
    }
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

}  // namespace tdist::test
