"""Find TCP sockets in /proc/net/tcp{,6} + /proc/PID/fd: connections already open when capture
started, listening sockets, and the ends of one socket.

The eBPF program learns sockets from accept4/connect; connections older than the capture are
found here, inserted into its socket map and recorded with `joined_midstream` set. Listening
sockets on the port are found here too (accepts with no address are matched by listener), and
`socket_inode` + `tcp_ends` give the peer of such an accept.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OpenConn:
    pid: int
    fd: int
    local: tuple[str, int]
    remote: tuple[str, int]
    family: int
    comm: str


def _addr(hexaddr: str) -> tuple[str, int]:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = str(ipaddress.IPv4Address(raw[::-1]))
    else:   # /proc prints IPv6 as four little-endian 32-bit words
        ip6 = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        ip = str(ip6.ipv4_mapped or ip6)
    return ip, int(port, 16)


ESTABLISHED, LISTEN = "01", "0A"   # /proc/net/tcp `st` column


def established(port: int, side: str, state: str = ESTABLISHED,
                ) -> dict[int, tuple[tuple[str, int], tuple[str, int], int]]:
    """Socket inode -> (local, remote, family) of TCP sockets in `state` (ESTABLISHED unless told)
    on `port` (0 = any): the local port for the server side, the remote one for the client side."""
    out = {}
    for name, family in (("tcp", 2), ("tcp6", 10)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != state:
                continue
            local, remote = _addr(f[1]), _addr(f[2])
            mine = local[1] if side == "server" else remote[1]
            if port and mine != port:
                continue
            out[int(f[9])] = (local, remote, family)
    return out


def open_connections(port: int, side: str, pids: set[int] | None = None) -> list[OpenConn]:
    """Connections on `port` held by `pids` (all processes when None), one per (pid, fd)."""
    return _holders(established(port, side), pids)


def listening(port: int, pids: set[int] | None = None) -> list[OpenConn]:
    """Listening TCP sockets on `port` (0 = any) held by `pids` (all when None), one per (pid, fd):
    a forked server has the same socket in every worker."""
    return _holders(established(port, "server", LISTEN), pids)


def _holders(socks: dict[int, tuple[tuple[str, int], tuple[str, int], int]],
             pids: set[int] | None) -> list[OpenConn]:
    if not socks:
        return []
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        if pids is not None and pid not in pids:
            continue
        found += _scan_fds(pid, entry, socks)
    return found


def _scan_fds(pid: int, entry: Path, socks: dict[int, tuple[tuple[str, int], tuple[str, int], int]]
              ) -> list[OpenConn]:
    out: list[OpenConn] = []
    try:
        fds = list((entry / "fd").iterdir())
        comm = (entry / "comm").read_text().strip()
    except OSError:
        return out        # gone, or not ours to read
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and (inode := int(target[8:-1])) in socks:
            local, remote, family = socks[inode]
            out.append(OpenConn(pid, int(fd.name), local, remote, family, comm))
    return out


def socket_inode(pid: int, fd: int) -> int | None:
    """The socket inode behind `fd` of process `pid`; None when it is gone or not a socket."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    if not target.startswith("socket:["):
        return None
    return int(target[8:-1])


def tcp_ends(pid: int, inode: int) -> tuple[tuple[str, int], tuple[str, int], int, str] | None:
    """(local, remote, family, state) of TCP socket `inode`, from the tables of `pid`'s network
    namespace; None when it is not (or no longer) there."""
    for name, family in (("tcp", 2), ("tcp6", 10)):
        try:
            for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
                f = line.split()
                if int(f[9]) == inode:
                    return _addr(f[1]), _addr(f[2]), family, f[3]
        except OSError:
            continue
    return None


def local_end(pid: int, fd: int) -> tuple[str, int] | None:
    """The local address of socket `fd` in process `pid` (for client-side flows), if it can be read."""
    inode = socket_inode(pid, fd)
    ends = tcp_ends(pid, inode) if inode is not None else None
    return ends[0] if ends else None
