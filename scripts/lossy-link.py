#!/usr/bin/env python3
"""A lossy, delayed point-to-point IP link between two network namespaces, in user space.

For kernels without `sch_netem` (tc netem): there, `scripts/bench-quic loss` measures DERP
over TCP and over QUIC under loss across it, and derpd's netem test runs over it. Two TUN
devices, one in each namespace, carry IP packets; this process moves every packet from one
to the other after a fixed one-way delay, dropping each with the given probability,
independently in each direction (what `tc qdisc add dev X root netem delay D loss P` on both
ends of a veth pair does).

    lossy-link.py NS_A ADDR_A NS_B ADDR_B DELAY_MS LOSS_PERCENT [SEED [NAME]]

Creates tun devices `NAMEA`/`NAMEB` (NAME defaults to `lossy`), moves them into the
(existing) namespaces, gives them ADDR_A and ADDR_B as the two ends of the link, prints
"ready" and runs until killed. A namespace given as `-` is the one this process runs in (for
a test whose clients run in its own process). Needs root (CAP_NET_ADMIN). Only forwards
between the two namespaces it was given.
"""

import fcntl
import heapq
import os
import random
import select
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def ip(*args):
    subprocess.run(["ip", *args], check=True)


def ip_in(ns, *args):
    ip(*(["-n", ns] if ns != "-" else []), *args)


def main():
    ns_a, addr_a, ns_b, addr_b = sys.argv[1:5]
    delay = float(sys.argv[5]) / 1000.0
    loss = float(sys.argv[6]) / 100.0
    rng = random.Random(int(sys.argv[7]) if len(sys.argv) > 7 else 1)
    prefix = sys.argv[8] if len(sys.argv) > 8 else "lossy"
    name_a, name_b = prefix + "A", prefix + "B"

    fds = {}
    for name, ns, here, there in ((name_a, ns_a, addr_a, addr_b), (name_b, ns_b, addr_b, addr_a)):
        fds[name] = open_tun(name)
        if ns != "-":
            ip("link", "set", name, "netns", ns)
        ip_in(ns, "addr", "add", here, "peer", there, "dev", name)
        ip_in(ns, "link", "set", name, "mtu", "1500", "up")
        ip_in(ns, "link", "set", "lo", "up")
    peer = {fds[name_a]: fds[name_b], fds[name_b]: fds[name_a]}
    print("ready", flush=True)

    # (due time, sequence, destination fd, packet): a heap keeps per-direction order, since
    # every packet of a direction gets the same delay.
    pending = []
    seq = 0
    poller = select.poll()
    for fd in peer:
        poller.register(fd, select.POLLIN)
    while True:
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, dst, pkt = heapq.heappop(pending)
            try:
                os.write(dst, pkt)
            except BlockingIOError:
                pass  # the kernel's queue is full: a drop, as a real link would
        timeout = max(0.0, pending[0][0] - now) * 1000.0 if pending else 1000.0
        for fd, _ in poller.poll(timeout):
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if rng.random() < loss:
                    continue
                seq += 1
                heapq.heappush(pending, (time.monotonic() + delay, seq, peer[fd], pkt))


if __name__ == "__main__":
    main()
