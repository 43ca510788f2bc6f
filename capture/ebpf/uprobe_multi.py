"""Uprobes as BPF links (BPF_TRACE_UPROBE_MULTI), which come off in one grace period, not one each.

A uprobe attached the way bcc does it (a perf event per probe) is removed in that event's close, which
waits for an RCU grace period under a lock every such close shares: the TLS program's ~30 uprobes took
3.5 s of every `record`'s stop, one after another, whatever the number of threads. A uprobe_multi link
holds any number of probes of one program in one file, and closing it waits once; links of different
programs close side by side. Kernels since 6.6 have it; `Links.attach` raises LinkUnsupported where
this one does not (an older kernel, a program loaded for perf events), and the caller then attaches
with bcc as before.

The link is made with the bpf(2) syscall directly (bcc's Python has no call for it); the program must
be loaded with expected_attach_type BPF_TRACE_UPROBE_MULTI (`load`).
"""

from __future__ import annotations

import ctypes
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from typing import Any

BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
_NR_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine())
_KPROBE = 2        # BPF_PROG_TYPE_KPROBE: uprobes are kprobe programs
_CLOSE_THREADS = 16


class LinkUnsupported(Exception):
    """This kernel (or this program's load) cannot make uprobe_multi links: attach with perf events."""


class _LinkCreate(ctypes.Structure):
    """union bpf_attr, as BPF_LINK_CREATE reads it for uprobe_multi (the rest of the union is zero)."""

    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("path", ctypes.c_uint64), ("offsets", ctypes.c_uint64),
                ("ref_ctr_offsets", ctypes.c_uint64), ("cookies", ctypes.c_uint64), ("cnt", ctypes.c_uint32),
                ("multi_flags", ctypes.c_uint32), ("pid", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)


def load(bpf: Any, fn_name: str) -> int:
    """The fd of program `fn_name` loaded for uprobe_multi links (bcc keeps it, as its own loads)."""
    try:
        return int(bpf.load_func(fn_name.encode(), _KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI).fd)
    except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
        raise LinkUnsupported(str(exc).splitlines()[0][:160]) from exc


def create(prog_fd: int, path: bytes, offsets: list[int], ret: bool = False) -> int:
    """One link of `prog_fd` at `offsets` (file offsets) in the file at `path`, for every process; its fd."""
    if _NR_BPF is None:
        raise LinkUnsupported(f"no bpf(2) number known for {platform.machine()}")
    offs = (ctypes.c_uint64 * len(offsets))(*offsets)
    cpath = ctypes.create_string_buffer(path)
    attr = _LinkCreate(prog_fd=prog_fd, attach_type=BPF_TRACE_UPROBE_MULTI,
                       path=ctypes.addressof(cpath), offsets=ctypes.addressof(offs), cnt=len(offsets),
                       multi_flags=BPF_F_UPROBE_MULTI_RETURN if ret else 0)
    fd = _libc.syscall(_NR_BPF, BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        err = ctypes.get_errno()
        raise LinkUnsupported(f"BPF_LINK_CREATE uprobe_multi: {os.strerror(err)}")
    return int(fd)


def close_all(fds: list[int]) -> None:
    """Close links side by side (each close waits for its own grace period)."""
    if len(fds) <= 1:
        for fd in fds:
            os.close(fd)
        return
    with ThreadPoolExecutor(min(_CLOSE_THREADS, len(fds)), thread_name_prefix="bpf-unlink") as pool:
        list(pool.map(os.close, fds))
