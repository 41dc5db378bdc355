#include "tdist/autograd/detail/header.h"

#include <cstring>

#include "tdist/core/error.h"

namespace tdist::autograd::detail {

void prepend_header(rpc::OutMessage& m, const Header& h) {
  Bytes head(kFixedHeaderSize + 4 * h.indices.size());
  uint8_t* p = head.data();
  const uint32_t count = static_cast<uint32_t>(h.indices.size());
  std::memcpy(p, &h.context_id, 8);
  std::memcpy(p + 8, &h.message_id, 8);
  std::memcpy(p + 16, &count, 4);
  if (count) std::memcpy(p + kFixedHeaderSize, h.indices.data(), 4 * count);
  m.body.insert(m.body.begin(), head.begin(), head.end());
  m.flags |= rpc::kFlagAutograd;
}

Header take_header(rpc::Message& m, int world_size) {
  if (m.body.size() < kFixedHeaderSize) {
    throw ProtocolError(str("autograd header truncated: ", m.body.size(), " bytes"));
  }
  Header h;
  uint32_t count = 0;
  std::memcpy(&h.context_id, m.body.data(), 8);
  std::memcpy(&h.message_id, m.body.data() + 8, 8);
  std::memcpy(&count, m.body.data() + 16, 4);
  if (h.context_id <= 0 || context_creator(h.context_id) >= world_size) {
    throw ProtocolError(str("bad distributed autograd context id ", h.context_id));
  }
  if (count > m.tensors.size() || m.body.size() - kFixedHeaderSize < 4 * size_t{count}) {
    throw ProtocolError(
        str("autograd header names ", count, " tensors; the message carries ", m.tensors.size()));
  }
  if ((count > 0) != (h.message_id >= 0)) {
    throw ProtocolError(str("autograd header: message id ", h.message_id, " with ", count,
                            " tensors that require grad"));
  }
  h.indices.resize(count);
  if (count) std::memcpy(h.indices.data(), m.body.data() + kFixedHeaderSize, 4 * size_t{count});
  for (size_t i = 0; i < h.indices.size(); ++i) {
    if (h.indices[i] >= m.tensors.size() || (i > 0 && h.indices[i] <= h.indices[i - 1])) {
      throw ProtocolError("autograd header: tensor indices out of range or not increasing");
    }
  }
  m.body.erase(m.body.begin(),
               m.body.begin() + static_cast<std::ptrdiff_t>(kFixedHeaderSize + 4 * count));
  return h;
}

}  // namespace tdist::autograd::detail
