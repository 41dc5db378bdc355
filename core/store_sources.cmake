# The libtorch-free part of core: the TCPStore, its wire format, the connection layer (core/net),
# the environment parsing, the token loader and reading a local process's memory. One list for
# the main build (core/CMakeLists.txt: the tdist_core_store objects that tdist::core and
# tdist-run link) and the fuzz build (tests/fuzz/CMakeLists.txt), relative to core/.
set(TDIST_CORE_STORE_SOURCES
  env.cpp
  net/address.cpp
  net/frame.cpp
  net/handshake.cpp
  net/socket_io.cpp
  process_memory.cpp
  store.cpp
  tcp_store.cpp
  token.cpp
  wire.cpp
  detail/store_util.cpp
  detail/tcp_store_client.cpp
  detail/tcp_store_protocol.cpp
  detail/tcp_store_connection.cpp
  detail/tcp_store_server.cpp
  detail/tcp_store_table.cpp)
