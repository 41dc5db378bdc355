#pragma once
// A free TCP port on 127.0.0.1 (bound to port 0, then released), for tests that must name a
// port before the server starts (init_method URLs, MASTER_PORT for child processes).
#include <cstdint>

namespace tdist::test {

uint16_t free_port();

}  // namespace tdist::test
