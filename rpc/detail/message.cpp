#include "tdist/rpc/detail/message.h"

#include <cstring>

#include "tdist/core/error.h"
#include "tdist/core/net/frame.h"
#include "tdist/core/serialize.h"

namespace tdist::rpc::detail {
namespace {

template <class T>
void put(uint8_t*& p, T v) {
  std::memcpy(p, &v, sizeof(T));
  p += sizeof(T);
}

template <class T>
T get(const uint8_t*& p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  p += sizeof(T);
  return v;
}

}  // namespace

const char* message_type_name(MessageType type) {
  switch (type) {
    case MessageType::kCall:
      return "CALL";
    case MessageType::kResponse:
      return "RESPONSE";
    case MessageType::kError:
      return "ERROR";
    case MessageType::kRemoteCall:
      return "REMOTE_CALL";
    case MessageType::kRRefFetch:
      return "RREF_FETCH";
    case MessageType::kRRefMethodCall:
      return "RREF_METHOD_CALL";
    case MessageType::kRRefMethodRemote:
      return "RREF_METHOD_REMOTE";
    case MessageType::kRRefForkRequest:
      return "RREF_FORK_REQUEST";
    case MessageType::kRRefUserDelete:
      return "RREF_USER_DELETE";
    case MessageType::kRRefChildAccept:
      return "RREF_CHILD_ACCEPT";
    case MessageType::kTensorRelease:
      return "TENSOR_RELEASE";
    case MessageType::kShmRelease:
      return "SHM_RELEASE";
    case MessageType::kStreamOffer:
      return "STREAM_OFFER";
    case MessageType::kStreamAccept:
      return "STREAM_ACCEPT";
    case MessageType::kStreamSwitch:
      return "STREAM_SWITCH";
  }
  return "UNKNOWN";
}

void encode_header(const FrameHeader& h, uint8_t* out) {
  uint8_t* p = out;
  net::encode_frame_prefix(kProtocol, static_cast<uint16_t>(h.type), p);
  p += net::kFramePrefixBytes;
  put<uint32_t>(p, h.flags);
  put<uint32_t>(p, h.body_len);
  put<uint32_t>(p, h.meta_len);
  put<uint32_t>(p, 0);
  put<uint64_t>(p, h.id);
  put<uint64_t>(p, h.length);
}

FrameHeader decode_header(const uint8_t* in, uint64_t max_frame_bytes) {
  const uint16_t type = net::check_frame_prefix(in, kProtocol).code;
  const uint8_t* p = in + net::kFramePrefixBytes;
  FrameHeader h;
  if (type == 0 || type > static_cast<uint16_t>(MessageType::kMaxType)) {
    throw ProtocolError(str("unknown message type ", type));
  }
  h.type = static_cast<MessageType>(type);
  h.flags = get<uint32_t>(p);
  if (h.flags & ~kKnownFlags) throw ProtocolError(str("unknown frame flags 0x", std::hex, h.flags));
  h.body_len = get<uint32_t>(p);
  h.meta_len = get<uint32_t>(p);
  auto reserved = get<uint32_t>(p);
  if (reserved != 0) throw ProtocolError("reserved frame header field is not zero");
  h.id = get<uint64_t>(p);
  h.length = get<uint64_t>(p);
  if (std::string problem = net::length_problem(h.length, max_frame_bytes, "frame");
      !problem.empty()) {
    throw ProtocolError(problem);
  }
  if (h.body_len > h.length || h.meta_len > h.body_len) {
    throw ProtocolError(str("inconsistent frame lengths: length ", h.length, ", body ", h.body_len,
                            ", tensor section ", h.meta_len));
  }
  return h;
}

TensorSection take_tensor_section(const FrameHeader& h, Bytes& body) {
  TensorSection section;
  if (h.meta_len > 0) {
    section = decode<TensorSection>(body.data() + (h.body_len - h.meta_len), h.meta_len);
    body.resize(h.body_len - h.meta_len);
  }
  return section;
}

void check_tensor_section(const FrameHeader& h, const TensorSection& section, bool accept_remote,
                          uint64_t max_frame_bytes) {
  const uint64_t inline_total = h.length - h.body_len;
  const bool any_remote = !section.addresses.empty();
  if (any_remote) {
    if (section.addresses.size() != section.metas.size()) {
      throw ProtocolError(str("tensor section has ", section.metas.size(), " tensors but ",
                              section.addresses.size(), " addresses"));
    }
    if (!accept_remote || !(h.flags & kFlagRemoteTensors)) {
      throw ProtocolError("peer sent tensor addresses but the same-host fast path is off");
    }
  }
  if (!section.shm.empty() || !section.retired.empty()) {
    if (!any_remote) throw ProtocolError("peer named shared-memory slots without addresses");
    if (!section.shm.empty() && section.shm.size() != section.metas.size()) {
      throw ProtocolError(str("tensor section has ", section.metas.size(), " tensors but ",
                              section.shm.size(), " slot names"));
    }
    if (section.retired.size() > kMaxRetired) {
      throw ProtocolError(
          str("peer retired ", section.retired.size(), " shared-memory slots in one frame"));
    }
    for (size_t i = 0; i < section.shm.size(); ++i) {
      if (section.shm[i].tag != 0 && section.addresses[i] == 0) {
        throw ProtocolError("peer named a shared-memory slot for a tensor in the frame");
      }
    }
  }
  uint64_t inline_sum = 0;
  uint64_t remote_sum = 0;
  for (size_t i = 0; i < section.metas.size(); ++i) {
    const bool remote = any_remote && section.addresses[i] != 0;
    if (remote) {
      validate_tensor_meta(section.metas[i], max_frame_bytes - remote_sum);
      remote_sum += section.metas[i].nbytes;
    } else {
      validate_tensor_meta(section.metas[i], inline_total - inline_sum);
      inline_sum += section.metas[i].nbytes;
    }
  }
  if (inline_sum != inline_total) {
    throw ProtocolError(
        str("frame carries ", inline_total, " tensor bytes but its tensors need ", inline_sum));
  }
}

StreamOffer check_stream_frame(const FrameHeader& h, const Bytes& body) {
  const char* name = message_type_name(h.type);
  if (h.type != MessageType::kStreamOffer) {
    if (h.length != 0) throw ProtocolError(str(name, " frame with a body"));
    return {};
  }
  if (h.meta_len != 0 || h.length != h.body_len || h.body_len > kMaxStreamOfferBytes) {
    throw ProtocolError(str(name, " frame of ", h.length, " bytes (body ", h.body_len,
                            ", tensor section ", h.meta_len, ")"));
  }
  return decode<StreamOffer>(body);
}

}  // namespace tdist::rpc::detail
