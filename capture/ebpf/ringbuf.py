"""Drain a bcc ring buffer with the GIL held, and wait for it without consuming.

bcc calls libbcc through `ctypes.CDLL`, which releases the GIL for the call; `ring_buffer_consume` then
calls back into Python once per record, and each callback must take the GIL again. While another thread
runs Python (the recorder's decoding, the TLS joiner), each of those takes waits for the switch interval
(5 ms): draining 5,000 records took 1.7-2.2 s here with two busy threads, against 16-19 ms with the GIL
held throughout (`ctypes.PyDLL`), so under load the drain, not the ring, was the bottleneck and records
were lost. A consume is a burst of short callbacks that only copy bytes, so holding the GIL for it costs
the other threads little.

Waiting is the other half: `ring_buffer_poll` waits and consumes in one call (and so with the GIL
released); `RingReader.wait` waits on the ring's file descriptor with `select.epoll` instead (the GIL
released while it sleeps), and `consume` drains.
"""

from __future__ import annotations

import ctypes
import os
import select
from typing import Any


class RingReader:
    """The ring buffers opened on one bcc BPF object (open_ring_buffer), drained with the GIL held."""

    def __init__(self, bpf: Any, table: bytes) -> None:
        self._bpf = bpf
        self._consume: Any = None
        manager = getattr(bpf, "_ringbuf_manager", None)   # bcc's handle of the object's ring buffers
        try:
            from bcc import libbcc

            fn = ctypes.PyDLL(libbcc.lib._name).bpf_consume_ringbuf
        except (ImportError, AttributeError, OSError):
            fn = None
        if manager and fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_int
            self._consume, self._manager = fn, manager
        self._epoll = select.epoll()
        self._epoll.register(bpf[table].map_fd, select.EPOLLIN)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)   # wake(): a stop need not wait out a wait
        self._epoll.register(self._wake, select.EPOLLIN)

    def wait(self, timeout_s: float) -> None:
        """Until the ring has records and was woken (a record written with a wake-up), wake(), or the timeout."""
        self._epoll.poll(timeout_s)

    def wake(self) -> None:
        """End the wait under way, and every later one (the reader is stopping)."""
        os.eventfd_write(self._wake, 1)

    def consume(self) -> None:
        """Every record in the ring now, through the callbacks, in ring order."""
        if self._consume is not None:
            self._consume(self._manager)
        else:                                   # a bcc without the handle: the slower way, same records
            self._bpf.ring_buffer_consume()

    def close(self) -> None:
        self._epoll.close()
        os.close(self._wake)
