#pragma once
// Socket helpers of the tests.
#include <chrono>
#include <cstdint>

namespace tdist::test {

// A free TCP port on 127.0.0.1 (bound to port 0, then released), for tests that must name a
// port before the server starts (init_method URLs, MASTER_PORT for child processes).
uint16_t free_port();

// True when the other end closed the connection on `fd` (EOF or reset) within `limit`; bytes
// that arrive before are read and dropped.
bool sees_eof(int fd, std::chrono::milliseconds limit);

// Sets the loopback interface of this process's network namespace up or down; false on failure.
bool set_loopback_up(bool up);

// Moves this process into a network namespace of its own (unshare) with loopback up, where
// taking loopback down later makes every connection of the process vanish (no FIN, no reset):
// a vanished host. False when it cannot (not root, no user namespaces): callers skip.
bool enter_own_network_namespace();

}  // namespace tdist::test
