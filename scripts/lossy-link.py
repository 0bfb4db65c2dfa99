#!/usr/bin/env python3
"""A lossy, delayed, optionally rate-limited point-to-point IP link between two network
namespaces, in user space.

For kernels without `sch_netem` (tc netem): there, `scripts/bench-quic` measures DERP over
TCP and over QUIC across it, and derpd's netem test runs over it. Two TUN devices, one in
each namespace, carry IP packets; this process moves every packet from one to the other after
a fixed one-way delay, dropping each with the given probability, independently in each
direction (what `tc qdisc add dev X root netem delay D loss P` on both ends of a veth pair
does).

    lossy-link.py [--rate-mbit R [--queue-ms Q | --policer-ms B] [--one-way]] NS_A ADDR_A NS_B ADDR_B DELAY_MS LOSS_PERCENT [SEED [NAME]]

Creates tun devices `NAMEA`/`NAMEB` (NAME defaults to `lossy`), moves them into the
(existing) namespaces, gives them ADDR_A and ADDR_B as the two ends of the link, prints
"ready" and runs until killed. A namespace given as `-` is the one this process runs in (for
a test whose clients run in its own process). Needs root (CAP_NET_ADMIN). Only forwards
between the two namespaces it was given.

With --rate-mbit, each direction is also a bottleneck of R Mbit/s (IP bytes) with a
drop-tail queue that holds Q milliseconds of it (default 50): a packet that arrives while
more than Q ms of packets wait is dropped (netem's `rate`, or `tbf ... limit`, behave alike).
With --policer-ms instead, the bottleneck is a token-bucket policer with no queue: tokens
(bytes) accrue at R Mbit/s into a bucket that holds B milliseconds of R; a packet that finds
tokens for its size passes at once and takes them, one that does not is dropped (`tc filter
... police rate R burst ... drop`, or a provider's egress policer). With --one-way only the
a>b direction has the bottleneck (b>a carries everything, still delayed and lossy).

On SIGUSR1 it prints one line with its counts so far, per direction (`a>b` and `b>a`):
`counts a>b in=N lost=N queue=N police=N eagain=N b>a ...`: packets read, dropped as random
loss, dropped by the full queue, dropped by the policer, and dropped because the receiving
TUN device's queue was full (`eagain`, an unplanned loss).
"""

import fcntl
import heapq
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
# Packets a TUN device holds for this process to read; a forwarder held off the CPU for a
# moment then delays packets instead of dropping them.
TXQUEUELEN = "10000"


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def ip(*args):
    subprocess.run(["ip", *args], check=True)


def ip_in(ns, *args):
    ip(*(["-n", ns] if ns != "-" else []), *args)


def take_flag(argv, name):
    if name in argv:
        argv.remove(name)
        return True
    return False


def take_option(argv, name, default=None):
    if name in argv:
        i = argv.index(name)
        value = float(argv[i + 1])
        del argv[i:i + 2]
        return value
    return default


class Direction:
    """One way across the link: its bottleneck (if any) and its counts."""

    def __init__(self, name, rate_bps, queue_s, bucket_s=None):
        self.name = name
        self.rate_bps = rate_bps
        self.queue_s = queue_s
        self.busy_until = 0.0
        # The policer's bucket, in bytes, full at the start; None for a queue.
        self.bucket = rate_bps * bucket_s / 8 if rate_bps and bucket_s is not None else None
        self.tokens = self.bucket
        self.filled_at = time.monotonic()
        self.counts = {"in": 0, "lost": 0, "queue": 0, "police": 0, "eagain": 0}

    def departure(self, now, size):
        """When a packet arriving now leaves the bottleneck, or None if the bottleneck drops
        it."""
        if self.rate_bps is None:
            return now
        if self.bucket is not None:
            self.tokens = min(self.bucket, self.tokens + (now - self.filled_at) * self.rate_bps / 8)
            self.filled_at = now
            if self.tokens < size:
                self.counts["police"] += 1
                return None
            self.tokens -= size
            return now
        start = max(now, self.busy_until)
        if start - now > self.queue_s:
            self.counts["queue"] += 1
            return None
        self.busy_until = start + size * 8 / self.rate_bps
        return self.busy_until

    def line(self):
        return f"{self.name} " + " ".join(f"{k}={v}" for k, v in self.counts.items())


def main():
    argv = sys.argv[1:]
    rate = take_option(argv, "--rate-mbit")
    queue_ms = take_option(argv, "--queue-ms", 50.0)
    policer_ms = take_option(argv, "--policer-ms")
    one_way = take_flag(argv, "--one-way")
    ns_a, addr_a, ns_b, addr_b = argv[0:4]
    delay = float(argv[4]) / 1000.0
    loss = float(argv[5]) / 100.0
    rng = random.Random(int(argv[6]) if len(argv) > 6 else 1)
    prefix = argv[7] if len(argv) > 7 else "lossy"
    name_a, name_b = prefix + "A", prefix + "B"

    fds = {}
    for name, ns, here, there in ((name_a, ns_a, addr_a, addr_b), (name_b, ns_b, addr_b, addr_a)):
        fds[name] = open_tun(name)
        if ns != "-":
            ip("link", "set", name, "netns", ns)
        ip_in(ns, "addr", "add", here, "peer", there, "dev", name)
        ip_in(ns, "link", "set", name, "mtu", "1500", "txqueuelen", TXQUEUELEN, "up")
        ip_in(ns, "link", "set", "lo", "up")
    peer = {fds[name_a]: fds[name_b], fds[name_b]: fds[name_a]}
    rate_bps = rate * 1e6 if rate else None
    bucket_s = policer_ms / 1000.0 if policer_ms is not None else None
    way = {
        fds[name_a]: Direction("a>b", rate_bps, queue_ms / 1000.0, bucket_s),
        fds[name_b]: Direction("b>a", None if one_way else rate_bps, queue_ms / 1000.0, bucket_s),
    }
    signal.signal(signal.SIGUSR1, lambda *_: print(
        "counts " + " ".join(d.line() for d in way.values()), flush=True))
    print("ready", flush=True)

    # (due time, sequence, destination fd, packet, direction): a heap keeps per-direction
    # order, since every packet of a direction leaves the bottleneck in arrival order and
    # gets the same delay.
    pending = []
    seq = 0
    poller = select.poll()
    for fd in peer:
        poller.register(fd, select.POLLIN)
    while True:
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, dst, pkt, d = heapq.heappop(pending)
            try:
                os.write(dst, pkt)
            except BlockingIOError:
                d.counts["eagain"] += 1  # the kernel's queue is full: a drop, as a real link would
        timeout = max(0.0, pending[0][0] - now) * 1000.0 if pending else 1000.0
        try:
            ready = poller.poll(timeout)
        except InterruptedError:
            continue
        for fd, _ in ready:
            d = way[fd]
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                d.counts["in"] += 1
                if rng.random() < loss:
                    d.counts["lost"] += 1
                    continue
                leaves = d.departure(time.monotonic(), len(pkt))
                if leaves is None:
                    continue
                seq += 1
                heapq.heappush(pending, (leaves + delay, seq, peer[fd], pkt, d))


if __name__ == "__main__":
    main()
