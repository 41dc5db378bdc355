#!/usr/bin/env python3
"""A link with delay and loss, in user space: forwards Ethernet frames between two TAP devices,
each frame after --delay-ms, dropping each with probability --loss. For kernels without the netem
queueing discipline (tests/apps/impaired_link_test.sh bridges each host's link to one TAP).

    impaired_link.py TAP_A TAP_B [--delay-ms 10] [--loss 0.01] [--seed 1]

Creates both TAP devices (they exist while it runs), prints "ready" once they do, and forwards
until killed; on SIGTERM it prints how many frames it forwarded and dropped.
"""
import argparse
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def open_tap(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("tap_a")
    p.add_argument("tap_b")
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    a, b = open_tap(args.tap_a), open_tap(args.tap_b)
    other = {a: b, b: a}
    delay = args.delay_ms / 1000.0
    queue = []  # (due, sequence, fd, frame): per direction in arrival order, as a wire keeps it
    seq = 0
    counts = {"forwarded": 0, "dropped": 0}

    def report(*_):
        print(f"forwarded {counts['forwarded']} dropped {counts['dropped']}", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, report)
    print("ready", flush=True)
    while True:
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else None
        readable, _, _ = select.select([a, b], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if args.loss > 0 and rng.random() < args.loss:
                    counts["dropped"] += 1
                    continue
                heapq.heappush(queue, (now + delay, seq, other[fd], frame))
                seq += 1
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, fd, frame = heapq.heappop(queue)
            try:
                os.write(fd, frame)
                counts["forwarded"] += 1
            except (BlockingIOError, OSError):
                counts["dropped"] += 1  # the device's queue is full: the wire drops it


if __name__ == "__main__":
    main()
