#!/usr/bin/env python3
"""Strangers on every port of a job: scripts/soak.sh --workload flood runs this next to jobs
that train, to show that no listening port of theirs (store, collective mesh, RPC) can be made to
grow, stall or fail by someone who does not hold the job's token.

    scripts/flood.py --pids PID[,PID...] [--seconds S] [--hold N] [--rate R] [--report S]

Every 0.2 s it finds the TCP ports that the given processes and all their descendants listen
on (/proc/<pid>/fd against /proc/net/tcp{,6}), so a port that exists only for a moment (the
mesh listens while a group forms) is found too. On each port it keeps, at once:
  hold      up to N connections opened and left idle (connect-and-hold); a fifth of them are
            replaced every 5 s, so the server keeps seeing new ones;
  garbage   connections that send 256-4096 random bytes, then wait for the server to close them;
  half      connections that read the server's challenge, send back its first 6 bytes (a
            handshake's magic and version) and stop there (a half handshake);
  badhello  connections that read the challenge and answer it with a HELLO-sized message of
            random bytes (a handshake whose MAC cannot verify).
R new stranger connections per second and port (default 20) are spread over the kinds. Every
--report seconds and at the end it prints, per kind: connections made, refused (RST or
ECONNREFUSED), closed by the server, still open; and the ports seen. It stops after --seconds
(default: until SIGTERM or SIGINT). Loopback only: it connects to the address a port listens on.
"""
import argparse
import errno
import os
import random
import selectors
import signal
import socket
import sys
import time

KINDS = ("hold", "garbage", "half", "badhello")


def descendants(roots):
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    seen, todo = set(), list(roots)
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo.extend(children.get(p, []))
    return seen


def listening_sockets():
    """inode -> (family, address, port) of every listening TCP socket of this network namespace."""
    out = {}
    for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A: LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if family == socket.AF_INET:
                addr = socket.inet_ntop(family, raw[::-1])
            else:  # four little-endian 32-bit words
                addr = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            if addr in ("0.0.0.0", "::"):
                addr = "127.0.0.1" if family == socket.AF_INET else "::1"
            out[cols[9]] = (family, addr, int(hexport, 16))
    return out


def ports_of(pids):
    listening = listening_sockets()
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                target = listening.get(link[8:-1])
                if target:
                    found.add(target)
    return found


class Conn:
    __slots__ = ("sock", "kind", "target", "state", "opened", "got")

    def __init__(self, sock, kind, target):
        self.sock, self.kind, self.target = sock, kind, target
        self.state, self.opened, self.got = "connecting", time.monotonic(), b""


class Flood:
    def __init__(self, hold, rate):
        self.sel = selectors.DefaultSelector()
        self.hold, self.rate = hold, rate
        self.conns = {}  # fd -> Conn
        self.stats = {k: {"made": 0, "refused": 0, "closed_by_server": 0} for k in KINDS}
        self.ports_seen = set()
        self.next_kind = 0

    def open(self, target, kind):
        family, addr, port = target
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect((addr, port))
        except BlockingIOError:
            pass
        except OSError:
            self.stats[kind]["refused"] += 1
            s.close()
            return
        c = Conn(s, kind, target)
        self.conns[s.fileno()] = c
        self.sel.register(s, selectors.EVENT_WRITE, c)

    def close(self, c, by_server=False):
        if by_server:
            self.stats[c.kind]["closed_by_server"] += 1
        self.sel.unregister(c.sock)
        del self.conns[c.sock.fileno()]
        c.sock.close()

    def count(self, target, kind):
        return sum(1 for c in self.conns.values() if c.target == target and c.kind == kind)

    def on_event(self, c, mask):
        if c.state == "connecting":
            err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.stats[c.kind]["refused"] += 1
                self.close(c)
                return
            self.stats[c.kind]["made"] += 1
            c.state = "open"
            if c.kind == "garbage":
                try:
                    c.sock.send(os.urandom(random.randint(256, 4096)))
                except OSError:
                    pass
            self.sel.modify(c.sock, selectors.EVENT_READ, c)
            return
        try:
            data = c.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close(c, by_server=True)
            return
        if c.state == "open" and c.kind in ("half", "badhello"):
            c.got += data
            if len(c.got) >= 8:
                try:
                    if c.kind == "half":
                        c.sock.send(c.got[:6])
                    else:
                        c.sock.send(c.got[:6] + os.urandom(160))
                except OSError:
                    pass
                c.state = "answered"

    def tick(self, targets, dt):
        """Opens this tick's share of new connections and replaces some held ones."""
        budget = self.rate * dt
        for target in targets:
            n = int(budget) + (1 if random.random() < budget - int(budget) else 0)
            for _ in range(n):
                kind = KINDS[self.next_kind % len(KINDS)]
                self.next_kind += 1
                if kind == "hold" and self.count(target, "hold") >= self.hold:
                    continue
                if kind != "hold" and self.count(target, kind) >= self.hold:
                    # The oldest of this kind makes room: strangers come and go.
                    oldest = min((c for c in self.conns.values()
                                  if c.target == target and c.kind == kind), key=lambda c: c.opened)
                    self.close(oldest)
                self.open(target, kind)

    def churn(self, targets):
        for target in targets:
            held = sorted((c for c in self.conns.values() if c.target == target and c.kind == "hold"),
                          key=lambda c: c.opened)
            for c in held[: max(1, len(held) // 5)]:
                self.close(c)

    def forget(self, targets):
        for c in [c for c in self.conns.values() if c.target not in targets]:
            self.close(c)

    def report(self, label):
        parts = []
        for k in KINDS:
            s = self.stats[k]
            open_now = sum(1 for c in self.conns.values() if c.kind == k)
            parts.append(f"{k}: {s['made']} made, {s['refused']} refused, "
                         f"{s['closed_by_server']} closed by the server, {open_now} open")
        print(f"flood {label}: {len(self.ports_seen)} ports seen; " + "; ".join(parts), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pids", required=True, help="comma-separated root pids")
    ap.add_argument("--seconds", type=float, default=0)
    ap.add_argument("--hold", type=int, default=32)
    ap.add_argument("--rate", type=float, default=20)
    ap.add_argument("--report", type=float, default=60)
    a = ap.parse_args()
    roots = [int(p) for p in a.pids.split(",") if p]
    flood = Flood(a.hold, a.rate)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    start = last = last_scan = last_churn = last_report = time.monotonic()
    targets = set()
    while not stop and (a.seconds <= 0 or time.monotonic() - start < a.seconds):
        now = time.monotonic()
        if now - last_scan >= 0.2:
            targets = ports_of(descendants(roots))
            flood.ports_seen |= {t[2] for t in targets}
            flood.forget(targets)
            last_scan = now
        flood.tick(targets, now - last)
        last = now
        if now - last_churn >= 5:
            flood.churn(targets)
            last_churn = now
        if now - last_report >= a.report:
            flood.report(f"at {now - start:.0f} s")
            last_report = now
        try:
            events = flood.sel.select(timeout=0.05)
        except OSError as e:
            if e.errno != errno.EINTR:
                raise
            events = []
        for key, mask in events:
            if key.fd in flood.conns:
                flood.on_event(key.data, mask)
    flood.report(f"end ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
