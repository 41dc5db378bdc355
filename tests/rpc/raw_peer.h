#pragma once
// A hostile or broken peer for the RPC tests: a raw TCP client that speaks the wire format
// (Note [RPC handshake] in rpc/detail/auth.h, Note [RPC wire format] in rpc/detail/message.h) and can lie.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tdist/core/net/socket_io.h"
#include "tdist/rpc/detail/auth.h"
#include "tdist/rpc/detail/message.h"

namespace tdist::rpc::test {

// Ten seconds from now: the deadline of a raw peer's reads and writes (a test never hangs).
net::Clock::time_point soon();
// A socket connected to 127.0.0.1:port with 10 s read/write timeouts (a test never hangs).
int connect_raw(uint16_t port);
// True when the peer closes the connection (EOF or reset) before the socket's timeout; bytes
// before the close (e.g. the handshake challenge) are skipped.
bool closed_by_peer(int fd);
// True when the peer has closed the connection by now (does not wait).
bool closed_now(int fd);
// send() that ignores failures (the agent may have closed: that is the point).
void send_bytes(int fd, const void* data, size_t n);
std::vector<uint8_t> header_bytes(detail::FrameHeader h, uint32_t magic = detail::kMagic);
// Client handshake options of a raw peer claiming rank `rank` of world 2, no fast path.
detail::HandshakeOptions raw_options(const std::string& token, int rank = 0);

// The client side of the handshake with forged fields: claiming rank `rank` and process `pid`,
// and asking for the same-host fast path. Returns whether the server said it will read our memory.
// Throws when the server refuses or closes.
bool forged_handshake(int fd, const std::string& token, int rank, pid_t pid);

// A CALL of the test agents' "add" (rpc_test_util.h) of 20 and 22 with `id`: its header, and its
// body in `body`.
detail::FrameHeader add_call(uint64_t id, std::vector<uint8_t>* body);

// Runs the raw peer `child` (a TDIST_TEST_CHILD of this binary) in a process of its own with
// AGENT_PORT=port, and expects it to exit 0 within 60 s (its output goes into the failure).
void expect_raw_peer_passes(const std::string& child, uint16_t port);

// Appends `section` to `body` as the frame's tensor section and sets h's lengths (no tensor bytes
// follow the body) and kFlagRemoteTensors: a frame whose tensors the receiver is to read from the
// sender's memory or slots, as the same-host fast path sends them.
void add_tensor_section(detail::FrameHeader& h, std::vector<uint8_t>& body,
                        const detail::TensorSection& section);

// Sends a frame and reads the next frame back (its header and its body + tensor bytes). A worker
// that granted us the fast path offers its shared-memory stream first (Note [RPC shared-memory
// frame streams]); read_frame skips the offer unless told not to, so the worker keeps writing to
// the socket (a raw peer never accepts).
void send_frame(int fd, detail::FrameHeader h, const std::vector<uint8_t>& body);
detail::FrameHeader read_frame(int fd, std::vector<uint8_t>* body, bool skip_offers = true);

}  // namespace tdist::rpc::test
