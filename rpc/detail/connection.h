#pragma once
// One TCP connection between two agents, after the handshake (rpc/detail/auth.h).
//
// Reading: one thread per connection reads frames (Note [RPC wire format]) through a small
// buffer; a large body or tensor is read straight into its destination (a tensor's own storage),
// so large tensors are never copied on the way in. With the same-host fast path a large tensor
// is the sender's shared-memory slot, mapped (Note [RPC shared-memory slots] in
// rpc/detail/shm_tensors.h: the slot's release goes out with the next frame written after the
// tensor dies), or, when there is no slot, its bytes are read from the sender's memory
// (process_vm_readv, one copy) and a TENSOR_RELEASE frame then lets the sender drop its
// reference. Each complete frame goes to the
// handler; the reader never runs user code and never writes (it posts what must be sent).
// An incoming connection's thread runs the server handshake first and gets its read buffer
// only once the peer authenticated. Between frames the reader waits without limit; once a
// frame's first byte has come, each read must progress within frame_timeout (the RPC timeout)
// or the connection closes with a TimeoutError naming the peer.
//
// Writing: send() frames the message (header, payload + tensor section, tensor bytes) and writes
// it with scatter-gather sendmsg() straight from the payload and the tensors' memory. Concurrent
// senders combine: the thread that finds the connection idle writes everything queued meanwhile
// in one batch (many small messages cost one system call), the others return at once.
//
// Same host: once the handshake enabled the same-host fast path, each direction moves its frames
// through a shared-memory ring instead of the socket (Note [RPC shared-memory frame streams] in
// rpc/detail/shm_stream.h); the socket then only tells that the peer is gone. What is said here
// of reads and writes holds for the ring as for the socket.
//
// A read or write error, EOF, a malformed frame or close() closes the connection; the handler
// then hears on_closed() once, from the reader thread. send() on a closed connection throws
// NetworkError with the reason; send() on any connection's reader thread throws Error (a
// reader blocked in sendmsg would stop reading: what a reader must send is posted).
// Thread safety: send() and close() from any thread. Ownership: the agent owns connections and
// joins their reader threads (join()) before dropping them.

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tdist/rpc/detail/auth.h"
#include "tdist/rpc/detail/shm_stream.h"
#include "tdist/rpc/detail/shm_tensors.h"
#include "tdist/rpc/future.h"
#include "tdist/rpc/detail/message.h"

namespace tdist::rpc::detail {

class Connection;

class ConnectionHandler {
 public:
  virtual ~ConnectionHandler() = default;
  // A complete frame (reader thread). A request counts against the connection's
  // max_requests_in_flight until the handler calls conn->request_done().
  virtual void on_message(const std::shared_ptr<Connection>& conn, Message&& msg) = 0;
  // An incoming connection passed its handshake (reader thread): a non-empty answer is why it
  // is refused (it closes without reading a frame).
  virtual std::string on_authenticated(const std::shared_ptr<Connection>& conn) = 0;
  // The connection closed (reader thread; once).
  virtual void on_closed(const std::shared_ptr<Connection>& conn, const std::string& reason) = 0;
};

struct ConnectionOptions {
  uint64_t max_frame_bytes = uint64_t{4} << 30;
  // Requests handed to the handler and not yet done (request_done), at most: at the limit the
  // reader waits before the next frame (backpressure). 0: no limit.
  int max_requests_in_flight = 0;
  Millis send_timeout{0};  // SO_SNDTIMEO once established; 0: none
  // Once a frame's first byte has come, each read of the rest must progress within this
  // (TimeoutError naming the peer, the connection closes); between frames no limit. 0: none.
  Millis frame_timeout{0};
  uint64_t remote_tensor_threshold = 256 << 10;  // fast path only for tensors at least this large
  // Shared-memory slots of the fast path, at most this many bytes on one connection (Note [RPC
  // shared-memory slots] in rpc/detail/shm_tensors.h); 0: process_vm_readv only.
  uint64_t shm_bytes = uint64_t{256} << 20;
  HandshakeOptions handshake;   // incoming connections handshake on their thread
  int socket_buffer_bytes = 0;  // SO_SNDBUF / SO_RCVBUF; 0: the system's
  // Between frames the reader keeps reading without blocking this long (yielding the core
  // between tries) before it sleeps in recv (Note [RPC waits spin first] in rpc/agent.cpp).
  std::chrono::microseconds spin{0};
  // Bytes of the shared-memory ring of each direction on the same host (Note [RPC shared-memory
  // frame streams]); 0: frames stay on the socket.
  uint64_t stream_bytes = uint64_t{256} << 10;
};

// Sets a socket's send and receive buffer sizes (RpcOptions::socket_buffer_bytes); 0: no change.
void set_socket_buffers(int fd, int bytes);

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // An outgoing connection whose handshake is done.
  static std::shared_ptr<Connection> outgoing(int fd, const HandshakeResult& hs,
                                              const ConnectionOptions& options,
                                              ConnectionHandler* handler, Executor* executor);
  // An accepted socket; its thread runs the server handshake first and closes the socket
  // without reading a frame when it fails.
  static std::shared_ptr<Connection> incoming(int fd, const ConnectionOptions& options,
                                              ConnectionHandler* handler, Executor* executor);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  void start();
  void send(OutMessage&& m);
  void close(const std::string& reason);
  void join();

  bool is_outgoing() const { return outgoing_; }
  // "worker rank R (host:port)", or "unauthenticated peer host:port" before the handshake.
  std::string peer() const;
  // True the first time only: a stray response from this peer is logged once (dispatcher.h).
  bool first_stray_response() { return !stray_logged_.exchange(true); }
  int peer_rank() const { return peer_rank_.load(); }
  bool closed() const;
  bool finished() const { return finished_.load(); }  // the reader thread has returned
  // An incoming connection whose HELLO verified (it is let finish its handshake).
  bool hello_verified() const { return hs_state_.load() == kHelloVerified; }
  // Closes an incoming connection whose HELLO has not verified, to make room (Note [RPC
  // handshake], busy: it is told so); false, changing nothing, once its HELLO verified.
  bool evict();
  // Whether a frame came from the peer (a connection that closes before one does not count as
  // the loss of an established connection: RpcAgent::Peer).
  bool received_a_frame() const { return received_frame_.load(); }
  // A request handed to on_message() was handled (any thread; see max_requests_in_flight).
  void request_done();
  int requests_in_flight() const { return in_flight_.load(); }
  std::string close_reason() const;

 private:
  Connection(int fd, bool outgoing, const ConnectionOptions& options, ConnectionHandler* handler,
             Executor* executor);
  void run();
  void read_frames();
  void read_frame_tensors(const FrameHeader& h, Message& m, TensorSection& section);
  void frame(OutMessage& m);
  void write_batch(std::deque<OutMessage>& batch);
  void release(uint64_t id);
  // SHM_RELEASE frames for the slots whose received tensors died, onto `batch`.
  void add_slot_releases(std::deque<OutMessage>& batch);

  // The stream frames (Note [RPC shared-memory frame streams]), on the reader thread.
  void on_stream_frame(const FrameHeader& h, const Bytes& body);
  // Posts a body-less frame for a worker thread to send (the reader never writes).
  void post_control(MessageType type, uint64_t id);
  // On the writing thread: offers a ring once, and switches to it once accepted.
  void offer_stream(std::deque<OutMessage>& batch);
  void switch_to_stream();
  void write_stream(const std::vector<struct iovec>& iov);
  void write_socket(std::vector<struct iovec>& iov);
  [[noreturn]] void throw_send_timeout() const;
  // Throws once the peer's end of the socket is gone or close() was called (stream writes).
  void check_writable_socket();

  // Buffered reads.
  void read(void* dst, size_t size);
  size_t fill(size_t want);
  // At least one byte and at most `n` of the incoming stream (ring or socket) into `dst`,
  // waiting as the Note says (between frames without limit, inside one within frame_timeout).
  size_t receive(void* dst, size_t n);
  size_t receive_stream(void* dst, size_t n);
  // After the switch the socket carries nothing: EOF there throws once the ring is empty
  // (returns the bytes still in it), a byte is a ProtocolError.
  size_t check_socket_after_switch(void* dst, size_t n);
  [[noreturn]] void throw_read_error(ssize_t n);
  void set_timeout(int option, Millis timeout);

  // Constant after construction.
  const int fd_;
  const bool outgoing_;
  const ConnectionOptions options_;
  ConnectionHandler* const handler_;
  Executor* const executor_;
  std::string peer_address_;  // set in the constructor

  // Set by the handshake (before any frame).
  std::atomic<int> peer_rank_{-1};
  HandshakeResult hs_;

  // Reader thread only.
  std::vector<uint8_t> in_;
  size_t in_pos_ = 0;
  size_t in_end_ = 0;
  bool between_frames_ = true;  // no byte of the next frame read yet
  std::thread reader_;
  std::atomic<bool> finished_{false};
  std::atomic<bool> stray_logged_{false};
  std::atomic<bool> received_frame_{false};
  // Requests handed to the handler and not done; the reader waits on flight_cv_ at the limit.
  std::atomic<int> in_flight_{0};
  std::mutex flight_mu_;
  std::condition_variable flight_cv_;
  void wait_for_room();
  // Incoming connections: whether the HELLO verified or the accept loop evicted it first.
  enum HandshakeState : int { kInHandshake, kHelloVerified, kEvicted };
  std::atomic<int> hs_state_{kInHandshake};

  mutable std::mutex mu_;
  std::deque<OutMessage> queue_;  // guarded by mu_
  bool writing_ = false;          // guarded by mu_: a thread is writing the queue
  bool closed_ = false;           // guarded by mu_
  std::string close_reason_;      // guarded by mu_

  std::mutex retained_mu_;
  // Tensors whose bytes the peer reads from our memory, by frame id, until TENSOR_RELEASE.
  std::unordered_map<uint64_t, std::vector<at::Tensor>> retained_;  // guarded by retained_mu_

  // Note [RPC shared-memory slots]: ours (sending), our mappings of the peer's (reader thread),
  // and the peer's slots that our received tensors no longer use (sent with our next write).
  ShmSlots slots_;
  ShmMappings mappings_;
  const std::shared_ptr<ReleaseQueue> releases_ = std::make_shared<ReleaseQueue>();

  // Note [RPC shared-memory frame streams]. Sending: the ring is made by the writing thread
  // before tx_state_ leaves kNone and kept until destruction; the reader thread moves the state
  // from kOffered to kAccepted and closes the ring's descriptor.
  enum TxState : int { kNone, kNever, kOffered, kAccepted, kStreaming };
  std::atomic<int> tx_state_{kNone};
  std::unique_ptr<ShmStream> tx_stream_;
  // Receiving (reader thread): the peer's ring, mapped at its offer, read from its switch on.
  std::unique_ptr<ShmStream> rx_stream_;
  std::atomic<ShmStream*> rx_active_{nullptr};
  std::atomic<bool> closing_{false};  // close() was called (wakes stream waits)
};

}  // namespace tdist::rpc::detail
