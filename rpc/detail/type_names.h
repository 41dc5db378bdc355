#pragma once
// Helpers of rpc/signature.h's type names: the demangled C++ name of a user type, and the 64-bit
// hash a signature's text is sent as (FNV-1a, core/hash.h).

#include <cstdint>
#include <string>

namespace tdist::rpc::detail {

std::string demangle(const char* mangled);
uint64_t fnv1a(const std::string& s);

}  // namespace tdist::rpc::detail
