// Fuzzes what an RPC worker decodes from a peer (Note [RPC wire format] in rpc/detail/message.h), with
// the functions rpc/detail/connection.cpp and the agent's handlers use, in their order: the frame header
// (decode_header), the body, the tensor section at its end (take_tensor_section,
// check_tensor_section), the tensor bytes that follow (receive_tensor, rpc/detail/tensor_pool.h),
// then the payload as the message's type says (rpc/detail/request_handler.cpp, rpc/detail/dispatcher.cpp,
// rpc/rref.h): the fields of a call (CallHeader, RRef and fork ids), then its arguments through
// the registry's decoders (registered below, tensors as indices into the frame's tensors, an
// RRef's fork data); a result of one of a few types, an error, an RRef control message.
//
// Input: byte 0 holds the receiver's settings (bit 0: the same-host fast path is on, so tensor
// addresses are accepted; bits 1-3: the type a RESPONSE's result is decoded as); then the 40-byte
// header; then the bytes that follow it on the connection. A frame whose bytes the input does not
// hold is one the connection would still be waiting for: its tensors read what there is, then
// fail as a closed connection does.
//
// Any input must end in a decoded message or a tdist::Error (a ProtocolError, a NetworkError for
// the end of the input, an InvalidArgument from a handler's check), never a crash, a sanitizer
// report or an allocation the input's bytes do not pay for. The RRef protocol that a decoded id
// would then drive (rpc/detail/rref_context.h) is not fuzzed here: it needs a running agent.
//
// TDIST_FUZZ_WRITE_SEEDS=<dir> fuzz_rpc_message writes the seed corpus (a frame of each type,
// framed as rpc/detail/connection.cpp frames them, with the library's encoders) into <dir> and exits.
#include <ATen/ops/arange.h>
#include <ATen/ops/ones.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tdist/core/error.h"
#include "tdist/core/serialize.h"
#include "tdist/rpc/detail/archive.h"
#include "tdist/rpc/detail/tensor_pool.h"
#include "tdist/rpc/detail/message.h"
#include "tdist/rpc/registry.h"
#include "tdist/rpc/detail/rref_context.h"
#include "tdist/rpc/types.h"
#include "tests/fuzz/fuzz_files.h"
#include "tests/fuzz/rpc_frames.h"

namespace {

namespace rpc = tdist::rpc;
namespace detail = tdist::rpc::detail;
using detail::FrameHeader;
using detail::Message;
using detail::MessageType;

const uint64_t kMaxFrameBytes = rpc::RpcOptions{}.max_frame_bytes;
constexpr int kPeerRank = 1;

// The bytes after the header, read as a connection reads its socket.
struct Stream {
  const uint8_t* data;
  size_t size;
  void read(void* dst, size_t n) {
    if (n > size) throw tdist::NetworkError("connection closed by peer");
    if (n) std::memcpy(dst, data, n);
    data += n;
    size -= n;
  }
};

// A class whose methods RREF_METHOD_CALL frames call (the owner's value of the target RRef).
struct Counter {
  int64_t value = 0;
  explicit Counter(int64_t v = 0) : value(v) {}
  int64_t add(int64_t d) { return value ^= d; }
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& ts, double) { return ts; }
};

void register_functions() {
  rpc::register_function("add", [](int64_t a, int64_t b) { return a ^ b; });
  rpc::register_function("tensors",
                         [](at::Tensor t, std::vector<at::Tensor> ts, std::optional<at::Tensor> o) {
                           return std::make_tuple(t, ts, o);
                         });
  rpc::register_function("strings",
                         [](std::string s, std::map<std::string, double> m, std::set<std::string> k,
                            std::vector<std::pair<int32_t, std::string>> v) {
                           return s.size() + m.size() + k.size() + v.size();
                         });
  rpc::register_function("named", [](std::map<std::string, at::Tensor> m, std::array<int64_t, 3> a,
                                     std::vector<bool> b, std::array<bool, 2> c) {
    return m.size() + a.size() + b.size() + c.size();
  });
  // Where a call passes an RRef, its fork data travels (RRef<T>::load reads it, then runs the
  // RRef protocol, which needs an agent).
  rpc::register_function("fork", [](detail::ForkData fd, int64_t) { return fd.type_name; });
  rpc::register_function("nothing", [] {});
  rpc::register_class<Counter>("Counter")
      .constructor<int64_t>()
      .method("add", &Counter::add)
      .method("scale", &Counter::scale);
}

// request_handler.cpp's read_fields: the leading fields, written without a context; returns
// the offset of the arguments.
template <class... Fields>
size_t read_fields(const Message& msg, Fields&... fields) {
  tdist::BoundedInputArchive ar(msg.body.data(), msg.body.size());
  try {
    ar(fields...);
  } catch (const cereal::Exception& e) {
    throw tdist::ProtocolError(e.what());
  }
  return msg.body.size() - ar.remaining();
}

detail::RecvContext recv_context(Message& msg) {
  detail::RecvContext rc;
  rc.tensors = &msg.tensors;
  rc.rrefs = nullptr;
  rc.from_rank = msg.from;
  return rc;
}

// A call's arguments, decoded by the registered function `name` when its signature matches.
void call_function(Message& msg, const detail::CallHeader& h, size_t offset) {
  auto fn = rpc::registry().find_function(h.name);
  if (!fn || fn->signature.hash != h.signature) return;  // the handler refuses it
  auto rc = recv_context(msg);
  detail::ArgInputArchive ar(msg.body.data() + offset, msg.body.size() - offset, rc);
  fn->invoke(ar);
}

void call_method(Message& msg, const detail::CallHeader& h, size_t offset) {
  static Counter counter;
  auto m = rpc::registry().find_method(detail::type_info_of<Counter>().hash, h.name);
  if (!m || m->signature.hash != h.signature) return;
  auto rc = recv_context(msg);
  detail::ArgInputArchive ar(msg.body.data() + offset, msg.body.size() - offset, rc);
  m->invoke(&counter, ar);
}

// agent.h's decode_result<R>: a response's result.
template <class R>
void decode_result(Message& msg) {
  auto rc = recv_context(msg);
  detail::ArgInputArchive ar(msg.body.data(), msg.body.size(), rc);
  if constexpr (!std::is_void_v<R>) {
    R value{};
    ar(value);
  }
  detail::check_all_read(ar, "result");
}

void decode_response(Message& msg, unsigned result_type) {
  switch (result_type) {
    case 0:
      decode_result<void>(msg);
      break;
    case 1:
      decode_result<int64_t>(msg);
      break;
    case 2:
      decode_result<at::Tensor>(msg);
      break;
    case 3:
      decode_result<std::vector<at::Tensor>>(msg);
      break;
    case 4:
      decode_result<std::tuple<at::Tensor, std::vector<at::Tensor>, std::optional<at::Tensor>>>(
          msg);
      break;
    case 5:
      decode_result<std::map<std::string, at::Tensor>>(msg);
      break;
    case 6:
      decode_result<detail::ForkData>(msg);
      break;  // an RRef as a result
    default:
      (void)tdist::decode<std::string>(msg.body);
      break;  // REMOTE_CALL's answer (rref.h)
  }
}

void decode_payload(Message& msg, unsigned result_type) {
  detail::CallHeader h;
  rpc::RRefId rref;
  rpc::ForkId fork;
  rpc::detail::RRefSecret secret;
  switch (msg.type) {
    case MessageType::kCall:
      call_function(msg, h, read_fields(msg, h));
      break;
    case MessageType::kRemoteCall:
      call_function(msg, h, read_fields(msg, h, rref, fork, secret));
      break;
    case MessageType::kRRefFetch: {
      uint64_t type_hash = 0;
      std::string type;
      read_fields(msg, rref, type_hash, type);
      break;
    }
    case MessageType::kRRefMethodCall: {
      rpc::ForkId phantom;
      call_method(msg, h, read_fields(msg, h, rref, phantom));
      break;
    }
    case MessageType::kRRefMethodRemote: {
      rpc::ForkId phantom;
      rpc::RRefId result;
      call_method(msg, h, read_fields(msg, h, rref, phantom, result, fork, secret));
      break;
    }
    case MessageType::kRRefForkRequest:
      (void)tdist::decode<std::tuple<rpc::RRefId, rpc::ForkId, rpc::detail::RRefSecret>>(msg.body);
      break;
    case MessageType::kRRefUserDelete:
      (void)tdist::decode<std::tuple<rpc::RRefId, rpc::ForkId>>(msg.body);
      break;
    case MessageType::kRRefChildAccept:
      (void)tdist::decode<rpc::ForkId>(msg.body);
      break;
    case MessageType::kResponse:
      decode_response(msg, result_type);
      break;
    case MessageType::kError:
      (void)tdist::decode<detail::ErrorBody>(msg.body);
      break;
    case MessageType::kTensorRelease:
    case MessageType::kShmRelease:
    case MessageType::kStreamOffer:
    case MessageType::kStreamAccept:
    case MessageType::kStreamSwitch:
      break;
  }
}

// connection.cpp's read_frames and read_frame_tensors, for one frame.
void read_frame(const uint8_t* hdr, Stream& in, bool accept_remote, unsigned result_type) {
  const FrameHeader h = detail::decode_header(hdr, kMaxFrameBytes);
  if (h.type == MessageType::kTensorRelease || h.type == MessageType::kShmRelease) {
    if (h.length != 0) throw tdist::ProtocolError("release frame with a body");
    return;
  }
  if (detail::is_stream_frame(h.type)) {
    tdist::Bytes body;
    if (h.length == h.body_len && h.body_len <= detail::kMaxStreamOfferBytes) {
      body.resize(h.body_len);
      in.read(body.data(), h.body_len);
    }
    (void)detail::check_stream_frame(h, body);
    return;
  }
  Message m;
  m.type = h.type;
  m.flags = h.flags;
  m.id = h.id;
  m.from = kPeerRank;
  // The connection grows the body as its bytes arrive; here they are all in memory.
  if (h.body_len > in.size) throw tdist::NetworkError("connection closed by peer");
  m.body.resize(h.body_len);
  in.read(m.body.data(), h.body_len);
  detail::TensorSection section = detail::take_tensor_section(h, m.body);
  detail::check_tensor_section(h, section, accept_remote, kMaxFrameBytes);
  for (size_t i = 0; i < section.metas.size(); ++i) {
    const tdist::TensorMeta& meta = section.metas[i];
    if (!section.addresses.empty() && section.addresses[i] != 0) {
      // Read from the peer's memory (same host): its bytes are not in the input. A small
      // stand-in keeps the message whole; a large one ends the frame.
      if (meta.nbytes >= detail::kMinCached) return;
      m.tensors.push_back(detail::empty_for_receive(meta));
      if (meta.nbytes) std::memset(m.tensors.back().data_ptr(), 0, meta.nbytes);
    } else {
      m.tensors.push_back(
          detail::receive_tensor(meta, [&in](void* dst, size_t n) { in.read(dst, n); }));
    }
  }
  // A frame with kFlagAutograd starts with distributed autograd's header, which the hooks strip
  // (autograd/hooks.cpp; the autograd_header target fuzzes that); the payload after it is read
  // the same way.
  decode_payload(m, result_type);
}

// --- The seed corpus ---------------------------------------------------------------------

using tdist::fuzz::rpc_payload;
detail::CallHeader call_header(const std::string& name) {
  return tdist::fuzz::rpc_call_header(name);
}
detail::CallHeader method_header(const std::string& name) {
  return tdist::fuzz::rpc_method_header<Counter>(name);
}

using tdist::fuzz::write_seed;

void write_seeds(const std::string& dir) {
  const rpc::RRefId rref{0, 7};
  const rpc::ForkId fork{1, 3};
  const at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3});
  const at::Tensor b = at::ones({4}, at::kLong);
  std::vector<at::Tensor> ts;
  auto call = [&](const std::string& file, MessageType type, const tdist::Bytes& body,
                  uint8_t settings = 0, bool addresses = false) {
    write_seed(dir + "/" + file, settings, tdist::fuzz::rpc_frame(type, 0, 5, body, ts, addresses));
    ts.clear();
  };
  call("call_add", MessageType::kCall,
       rpc_payload(tdist::encode(call_header("add")), ts, int64_t{1}, int64_t{2}));
  call("call_tensors", MessageType::kCall,
       rpc_payload(tdist::encode(call_header("tensors")), ts, a, std::vector<at::Tensor>{b, a.t()},
                   std::optional<at::Tensor>(at::Tensor())));
  call("call_tensors_remote", MessageType::kCall,
       rpc_payload(tdist::encode(call_header("tensors")), ts, a, std::vector<at::Tensor>{b},
                   std::optional<at::Tensor>()),
       1, true);
  call("call_strings", MessageType::kCall,
       rpc_payload(tdist::encode(call_header("strings")), ts, std::string("s"),
                   std::map<std::string, double>{{"x", 1.5}}, std::set<std::string>{"k"},
                   std::vector<std::pair<int32_t, std::string>>{{1, "one"}}));
  call("call_named", MessageType::kCall,
       rpc_payload(tdist::encode(call_header("named")), ts,
                   std::map<std::string, at::Tensor>{{"w", a}}, std::array<int64_t, 3>{1, 2, 3},
                   std::vector<bool>{true, false}, std::array<bool, 2>{false, true}));
  call("call_fork", MessageType::kCall,
       rpc_payload(tdist::encode(call_header("fork")), ts,
                   detail::ForkData{0, rref, fork, 2, 99, "int64"}, int64_t{4}));
  call("call_nothing", MessageType::kCall, rpc_payload(tdist::encode(call_header("nothing")), ts));
  call("remote_call", MessageType::kRemoteCall,
       rpc_payload(tdist::encode(call_header("Counter"), rref, fork, detail::RRefSecret{1, 2}), ts,
                   int64_t{5}));
  call("rref_fetch", MessageType::kRRefFetch,
       rpc_payload(tdist::encode(rref, uint64_t{42}, std::string("int64")), ts));
  call("method_call", MessageType::kRRefMethodCall,
       rpc_payload(tdist::encode(method_header("add"), rref, rpc::ForkId{}), ts, int64_t{3}));
  call("method_remote", MessageType::kRRefMethodRemote,
       rpc_payload(tdist::encode(method_header("scale"), rref, fork, rpc::RRefId{1, 9},
                                 rpc::ForkId{1, 10}, detail::RRefSecret{3, 4}),
                   ts, std::vector<at::Tensor>{a}, 2.0));
  call("fork_request", MessageType::kRRefForkRequest,
       tdist::encode(rref, fork, detail::RRefSecret{1, 2}));
  call("user_delete", MessageType::kRRefUserDelete, tdist::encode(rref, fork));
  call("child_accept", MessageType::kRRefChildAccept, tdist::encode(fork));
  call("response_void", MessageType::kResponse, rpc_payload({}, ts), 0 << 1);
  call("response_int", MessageType::kResponse, rpc_payload({}, ts, int64_t{3}), 1 << 1);
  call("response_tensors", MessageType::kResponse,
       rpc_payload({}, ts, std::vector<at::Tensor>{a, b}), 3 << 1);
  call("response_tuple", MessageType::kResponse,
       rpc_payload({}, ts,
                   std::make_tuple(a, std::vector<at::Tensor>{b}, std::optional<at::Tensor>(a))),
       4 << 1);
  call("response_rref", MessageType::kResponse,
       rpc_payload({}, ts, detail::ForkData{0, rref, fork, 0, 99, "int64"}), 6 << 1);
  call("response_remote_call", MessageType::kResponse, tdist::encode(std::string()), 7 << 1);
  call("error", MessageType::kError, tdist::encode(detail::ErrorBody{"boom", "worker1"}));
  call("tensor_release", MessageType::kTensorRelease, {});
  call("shm_release", MessageType::kShmRelease, {});
  call("stream_offer", MessageType::kStreamOffer, tdist::encode(detail::StreamOffer{7, 1 << 20}));
  call("stream_switch", MessageType::kStreamSwitch, {});
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  register_functions();
  tdist::fuzz::write_seeds_if_asked(write_seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 + detail::kHeaderSize) return 0;
  const bool accept_remote = data[0] & 1;
  const unsigned result_type = (data[0] >> 1) & 7;
  Stream in{data + 1 + detail::kHeaderSize, size - 1 - detail::kHeaderSize};
  try {
    read_frame(data + 1, in, accept_remote, result_type);
  } catch (const tdist::Error&) {}
  return 0;
}
