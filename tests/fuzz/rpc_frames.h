#pragma once
// RPC frames for the seed corpora of the RPC fuzz targets, built with the library's encoders:
// a frame as rpc/detail/connection.cpp lays it out, a call's payload as agent.h encodes it, and the
// headers that name registered functions and methods.
#include <ATen/core/Tensor.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "tdist/core/serialize.h"
#include "tdist/core/tensor_wire.h"
#include "tdist/rpc/detail/archive.h"
#include "tdist/rpc/detail/message.h"
#include "tdist/rpc/registry.h"

namespace tdist::fuzz {

// A frame as Connection::frame lays it out: header, payload + tensor section, tensor bytes (or,
// with `addresses`, the tensors' addresses in the sender's memory instead of their bytes).
inline Bytes rpc_frame(rpc::detail::MessageType type, uint32_t flags, uint64_t id,
                       const Bytes& payload, const std::vector<at::Tensor>& tensors,
                       bool addresses = false) {
  namespace detail = rpc::detail;
  detail::TensorSection section;
  Bytes tensor_bytes;
  for (const at::Tensor& t : tensors) {
    const at::Tensor c = contiguous_values(t);
    section.metas.push_back(describe_tensor(c));
    if (addresses) {
      section.addresses.push_back(0x7f0000001000 + 4096 * section.addresses.size());
    } else {
      const auto* p = static_cast<const uint8_t*>(c.data_ptr());
      tensor_bytes.insert(tensor_bytes.end(), p, p + c.nbytes());
    }
  }
  const Bytes meta = tensors.empty() ? Bytes() : encode(section);
  detail::FrameHeader h;
  h.type = type;
  h.flags = flags | (addresses ? detail::kFlagRemoteTensors : 0);
  h.id = id;
  h.meta_len = static_cast<uint32_t>(meta.size());
  h.body_len = static_cast<uint32_t>(payload.size() + meta.size());
  h.length = h.body_len + tensor_bytes.size();
  Bytes out(detail::kHeaderSize);
  detail::encode_header(h, out.data());
  out.insert(out.end(), payload.begin(), payload.end());
  out.insert(out.end(), meta.begin(), meta.end());
  out.insert(out.end(), tensor_bytes.begin(), tensor_bytes.end());
  return out;
}

// agent.h's encode_message: fields without a context, then arguments with RPC's context (their
// tensors appended to `tensors`).
template <class... A>
Bytes rpc_payload(const Bytes& fields, std::vector<at::Tensor>& tensors, const A&... args) {
  Bytes body = fields;
  rpc::detail::SendContext sc;
  sc.tensors = &tensors;
  if constexpr (sizeof...(A) > 0) {
    rpc::detail::ArgOutputArchive ar(body, sc);
    ar(args...);
  }
  return body;
}

// The call header of registered function `name`, or of method `name` of registered class T.
inline rpc::detail::CallHeader rpc_call_header(const std::string& name) {
  auto fn = rpc::registry().find_function(name);
  if (!fn) std::abort();
  return {name, fn->signature.hash};
}
template <class T>
rpc::detail::CallHeader rpc_method_header(const std::string& name) {
  auto m = rpc::registry().find_method(rpc::detail::type_info_of<T>().hash, name);
  if (!m) std::abort();
  return {name, m->signature.hash};
}

}  // namespace tdist::fuzz
