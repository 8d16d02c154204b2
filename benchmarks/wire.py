"""Bytes on the wire, read from the kernel: what each rank's TCP sockets carried during a call.

Shared by the optimizer-step benchmarks (``moe_step.py``, ``tp_step.py``). The count is
collective-agnostic: gloo's connections and the rendezvous store's, whoever sent on them, as
the kernel acknowledged them (``getsockopt(TCP_INFO)``), not what a collective says it sends.
"""

from __future__ import annotations

import ctypes
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from harness import measure


class TcpInfo(ctypes.Structure):
    """The head of ``struct tcp_info`` (``linux/tcp.h``) up to ``tcpi_bytes_received``: the
    offsets of the two byte counters follow from the fields before them (120 and 128 on
    x86-64 Linux), not from a number typed in here."""

    _fields_ = [("tcpi_state", ctypes.c_uint8), ("tcpi_ca_state", ctypes.c_uint8),
                ("tcpi_retransmits", ctypes.c_uint8), ("tcpi_probes", ctypes.c_uint8),
                ("tcpi_backoff", ctypes.c_uint8), ("tcpi_options", ctypes.c_uint8),
                ("tcpi_wscale", ctypes.c_uint8), ("tcpi_app_limited", ctypes.c_uint8)]
    _fields_ += [(name, ctypes.c_uint32) for name in (
        "rto", "ato", "snd_mss", "rcv_mss", "unacked", "sacked", "lost", "retrans", "fackets",
        "last_data_sent", "last_ack_sent", "last_data_recv", "last_ack_recv", "pmtu",
        "rcv_ssthresh", "rtt", "rttvar", "snd_ssthresh", "snd_cwnd", "advmss", "reordering",
        "rcv_rtt", "rcv_space", "total_retrans")]
    _fields_ += [("tcpi_pacing_rate", ctypes.c_uint64), ("tcpi_max_pacing_rate", ctypes.c_uint64),
                 ("tcpi_bytes_acked", ctypes.c_uint64), ("tcpi_bytes_received", ctypes.c_uint64)]


ACKED_AT, RECEIVED_AT = TcpInfo.tcpi_bytes_acked.offset, TcpInfo.tcpi_bytes_received.offset


def tcp_bytes() -> tuple[int, int]:
    """(bytes sent and acknowledged, bytes received) over every TCP socket this process holds:
    gloo's connections to the other ranks and the rendezvous store's. Collective-agnostic: it
    counts what the kernel carried, whoever asked."""
    sent = received = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.fromfd(int(name), socket.AF_INET, socket.SOCK_STREAM)  # a dup, closed below
        except OSError:
            continue
        try:
            if (sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) not in (socket.AF_INET, socket.AF_INET6)
                    or sock.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) != socket.IPPROTO_TCP):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            if len(info) >= ctypes.sizeof(TcpInfo):
                sent += int.from_bytes(info[ACKED_AT:ACKED_AT + 8], sys.byteorder)
                received += int.from_bytes(info[RECEIVED_AT:RECEIVED_AT + 8], sys.byteorder)
        except OSError:
            continue
        finally:
            sock.close()
    return sent, received


def metered(fn: Callable[[], Any]) -> tuple[dict[str, float], int]:
    """``harness.measure(fn)`` and the bytes this rank sent during it (its two barriers
    included; :func:`barrier_bytes` is what they cost alone)."""
    before = tcp_bytes()[0]
    timing = measure(fn)
    time.sleep(0.002)  # the last segments' acknowledgements (loopback: microseconds)
    return timing, tcp_bytes()[0] - before


def barrier_bytes(samples: int = 5) -> int:
    return int(statistics.median(metered(lambda: None)[1] for _ in range(samples)))


def wire_check() -> dict[str, float]:
    """The meter against transfers of known size: a 1 MiB ``send`` from rank 0 to rank 1, and a
    1 MiB ``all_reduce`` (a ring sends 2 (n-1)/n of it per rank)."""
    import torch
    import torch.distributed as dist

    payload = 1 << 20
    rank, world = dist.get_rank(), dist.get_world_size()
    empty = barrier_bytes()
    buffer = torch.zeros(payload // 4)

    def send():
        if rank == 0:
            dist.send(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)

    _, sent = metered(send)
    _, reduced = metered(lambda: dist.all_reduce(buffer))
    return {"send_1MiB_rank0": (sent - empty) / payload, "all_reduce_1MiB": (reduced - empty) / payload,
            "ring_expectation": 2 * (world - 1) / world, "barrier_pair_bytes": empty}
