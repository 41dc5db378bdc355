// The receiving side of RPC's shared memory maps no more of a peer's memfd than the frame or the
// offer accounts for (issue 41, item 10): a slot or stream far larger than what it carries is a
// ProtocolError, not a mapping (MAP_POPULATE: every page of it) of whatever size the peer chose.
// Both ends are this process here: what is checked is the receiver's decision, not the kernel's.

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cstring>
#include <memory>
#include <string>

#include "tdist/core/error.h"
#include "tdist/rpc/detail/shm_stream.h"
#include "tdist/rpc/detail/shm_tensors.h"

namespace tdist::rpc::detail {
namespace {

constexpr uint64_t kLarge = uint64_t{16} << 20;

TEST(ShmTensorBounds, ASlotFarLargerThanItsTensorIsRefused) {
  auto m = create_sealed_memfd("tdist-rpc-slot", kShmHeaderBytes + kLarge);
  ASSERT_TRUE(m) << "no shared memory: " << std::strerror(errno);
  const uint64_t tag = new_shm_tag();
  const uint64_t header[3] = {kShmSlotMagic, tag, kLarge};
  std::memcpy(m->base, header, sizeof(header));
  ShmMappings maps;
  ShmRef ref;
  ref.fd = m->fd;
  ref.tag = tag;
  const TensorMeta meta = describe_tensor(at::empty({16}, at::kByte));
  auto releases = std::make_shared<ReleaseQueue>();
  EXPECT_THROW(maps.tensor(::getpid(), ref, meta, releases), ProtocolError);
  ::munmap(m->base, m->bytes);
  ::close(m->fd);
}

TEST(ShmTensorBounds, AStreamLargerThanItsOfferIsRefused) {
  auto m = create_sealed_memfd("tdist-rpc-stream", kStreamDataOffset + kLarge);
  ASSERT_TRUE(m) << "no shared memory: " << std::strerror(errno);
  const uint64_t tag = new_shm_tag();
  const uint64_t header[3] = {kStreamMagic, tag, kMinStreamBytes};  // offers the smallest ring
  std::memcpy(m->base, header, sizeof(header));
  std::string why;
  EXPECT_THROW(ShmStream::open(::getpid(), m->fd, tag, kMinStreamBytes, &why), ProtocolError);
  ::munmap(m->base, m->bytes);
  ::close(m->fd);
}

}  // namespace
}  // namespace tdist::rpc::detail
