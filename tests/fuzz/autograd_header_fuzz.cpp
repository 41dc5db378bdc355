// Fuzzes distributed autograd's frame header (Note [Autograd frame header] in
// autograd/detail/header.h) as the receiving worker's hooks read it: take_header on the payload
// of a frame with kFlagAutograd, checked against the world size and the message's tensors.
//
// Input: bytes 0-1 (u16, little-endian) the world size minus one; byte 2, its low 3 bits, the
// number of tensors the message carries; byte 3, bit i: tensor i requires grad; then the payload.
// take_header only counts the tensors; they are real ones (some requiring grad) so that the
// message is the one the hooks see.
//
// Any input must give a header or a ProtocolError, never another exception, a crash or a
// sanitizer report. A header that is accepted must satisfy the note: a context id > 0 whose
// creator is below the world size, a message id >= 0 exactly when there are indices, indices
// strictly increasing and below the tensor count; the payload must have lost exactly the
// header's bytes; and prepend_header must write back exactly those bytes, which take_header then
// reads as the same header and the same remaining payload.
//
// TDIST_FUZZ_WRITE_SEEDS=<dir> fuzz_autograd_header writes the seed corpus (headers written by
// prepend_header, as the sending worker's hooks write them) into <dir> and exits.
#include <ATen/ops/ones.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tdist/autograd/detail/header.h"
#include "tdist/core/error.h"
#include "tdist/rpc/detail/message.h"
#include "tests/fuzz/fuzz_files.h"

namespace {

namespace ag = tdist::autograd::detail;
using tdist::rpc::detail::Message;
using tdist::rpc::detail::MessageType;
using tdist::rpc::detail::OutMessage;

constexpr size_t kSettingsSize = 4;
constexpr int kMaxTensors = 7;  // byte 2's low 3 bits

void check(bool ok) {
  if (!ok) std::abort();
}

// Made once: a tensor per input would cost more than the decoder it feeds.
const at::Tensor& tensor(int i, bool requires_grad) {
  static const std::vector<at::Tensor> pool = [] {
    std::vector<at::Tensor> ts;
    for (int j = 0; j < 2 * kMaxTensors; ++j) {
      ts.push_back(at::ones({j % kMaxTensors + 1}, at::kFloat));
      if (j >= kMaxTensors) ts.back().set_requires_grad(true);
    }
    return ts;
  }();
  return pool[i + (requires_grad ? kMaxTensors : 0)];
}

std::vector<at::Tensor> tensors(int count, uint8_t grad_mask) {
  std::vector<at::Tensor> ts;
  for (int i = 0; i < count; ++i) ts.push_back(tensor(i, (grad_mask >> i) & 1));
  return ts;
}

bool same(const ag::Header& a, const ag::Header& b) {
  return a.context_id == b.context_id && a.message_id == b.message_id && a.indices == b.indices;
}

void check_accepted(const ag::Header& h, int world_size, size_t tensor_count) {
  check(h.context_id > 0 && ag::context_creator(h.context_id) < world_size);
  check(h.indices.empty() == (h.message_id < 0));
  for (size_t i = 0; i < h.indices.size(); ++i) {
    check(h.indices[i] < tensor_count);
    check(i == 0 || h.indices[i] > h.indices[i - 1]);
  }
}

void read_header(int world_size, std::vector<at::Tensor> ts, const uint8_t* body, size_t size) {
  Message m;
  m.type = MessageType::kCall;
  m.flags = tdist::rpc::detail::kFlagAutograd;
  m.body.assign(body, body + size);
  m.tensors = ts;
  ag::Header h;
  try {
    h = ag::take_header(m, world_size);
  } catch (const tdist::ProtocolError&) {
    return;
  }
  check_accepted(h, world_size, ts.size());
  const size_t header_size = ag::kFixedHeaderSize + 4 * h.indices.size();
  check(size >= header_size && m.body.size() == size - header_size);
  check(m.body.empty() || std::memcmp(m.body.data(), body + header_size, m.body.size()) == 0);

  OutMessage out;
  out.type = m.type;
  out.body = m.body;
  out.tensors = ts;
  ag::prepend_header(out, h);
  check(out.flags & tdist::rpc::detail::kFlagAutograd);
  check(out.body.size() == size && std::memcmp(out.body.data(), body, size) == 0);

  Message again;
  again.body = out.body;
  again.tensors = std::move(ts);
  const ag::Header h2 = ag::take_header(again, world_size);  // must not throw
  check(same(h, h2) && again.body == m.body);
}

// --- The seed corpus ---------------------------------------------------------------------

// The input for a message of `tensor_count` tensors (`grad_mask`: those that require grad) in a
// world of `world_size`, with the header the sender's hooks write (autograd/hooks.cpp's
// record_send): the indices of the tensors that require grad, a message id when there are any.
tdist::Bytes seed(int world_size, int tensor_count, uint8_t grad_mask, int creator, int64_t seq,
                  int64_t message_id, const std::string& payload) {
  OutMessage m;
  m.body.assign(payload.begin(), payload.end());
  m.tensors = tensors(tensor_count, grad_mask);
  ag::Header h;
  h.context_id = (int64_t{creator} << ag::kContextRankShift) | seq;
  for (int i = 0; i < tensor_count; ++i) {
    if (m.tensors[i].requires_grad()) h.indices.push_back(static_cast<uint32_t>(i));
  }
  if (!h.indices.empty()) h.message_id = message_id;
  ag::prepend_header(m, h);
  const uint16_t ws = static_cast<uint16_t>(world_size - 1);
  tdist::Bytes in{static_cast<uint8_t>(ws), static_cast<uint8_t>(ws >> 8),
                  static_cast<uint8_t>(tensor_count), grad_mask};
  in.insert(in.end(), m.body.begin(), m.body.end());
  return in;
}

void write_seeds(const std::string& dir) {
  auto write = [&dir](const std::string& file, const tdist::Bytes& in) {
    tdist::fuzz::write_seed(dir + "/" + file, in[0], tdist::Bytes(in.begin() + 1, in.end()));
  };
  write("request_no_grad", seed(2, 2, 0, 0, 1, 0, "call fields and arguments"));
  write("request_some_grad", seed(4, 3, 0b101, 3, 17, 5, "args"));
  write("response_all_grad", seed(1, 7, 0x7f, 0, 2, 1, "result"));
  write("header_only", seed(7, 0, 0, 6, 1, 0, ""));
  write("grad_no_payload",
        seed(3, 1, 1, 2, (int64_t{1} << ag::kContextRankShift) - 1, int64_t{1} << 40, ""));
  write("largest_world", seed(65536, 4, 0b1010, 32767, 9, 3, "x"));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tdist::fuzz::write_seeds_if_asked(write_seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kSettingsSize) return 0;
  const int world_size = 1 + (data[0] | data[1] << 8);
  const int tensor_count = data[2] & 7;
  read_header(world_size, tensors(tensor_count, data[3]), data + kSettingsSize,
              size - kSettingsSize);
  return 0;
}
