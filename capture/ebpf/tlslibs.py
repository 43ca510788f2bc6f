"""Which TLS implementation each process runs, and which files the TLS probes attach to.

A process's TLS is found in what it maps (/proc/PID/maps) and resolved through its own root
(/proc/PID/root), so a container's copy of libssl, bind-mounted or in its own image, is a file of its
own, probed on its own:

    OpenSSL, a library (libssl.so.*, any path, any mount namespace)        read: uprobes on SSL_read/_write
    OpenSSL inside the executable, exported (SSL_read in its dynamic table) read, as the library
      ... Node.js (its OpenSSL works on memory buffers: the socket is the one
          its event loop writes the handshake to, tls.bpf.c's bind_pending)  read
    Go crypto/tls (a Go executable, capture/ebpf/goelf.py's analysis)      read: Go's own probes (tls.bpf.c);
                                                                           else named, with the binary's reason
    BoringSSL linked in statically, hidden (grpcio's cygrpc, Envoy)        named: nothing to attach to
    Java's JSSE (a process mapping libjvm.so)                              named: Java code, no native function

Probes attach once per file, keyed by (device, inode): a hundred nginx workers and the host's curl all
share the system libssl and cost one attachment. Nothing here guesses: where a file cannot be read the
reason says what was found and what would make it readable.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from capture.ebpf.goelf import GoElfError, GoTlsInfo, analyze, describe

_LIBSSL = re.compile(r"^libssl\.so(\.\d+)*$")            # OpenSSL's, not NSS's libssl3.so
_LIBCRYPTO = re.compile(r"^libcrypto\.so(\.\d+)*$")
_OPENSSL_VERSION = re.compile(rb"OpenSSL \d+\.\d+\.\d+[a-z]?(?:-[\w.]+)? +\d{1,2} \w{3} \d{4}")
_MAYBE_BORING = re.compile(r"grpc|envoy|boring", re.I)    # files worth searching for BoringSSL's marks
_LIBJVM = re.compile(r"^libjvm\.so$")                      # a JVM: its TLS is JSSE, Java code
_BORINGSSL = re.compile(rb"BoringSSL")
_OPENSSL_API = (b"SSL_read", b"SSL_write")
_SCAN_CAP = 512 << 20        # never search a file bigger than this for a version or a library's marks
_MAPS_CAP = 8 << 20          # a maps file bigger than this is not read whole


@dataclass(frozen=True)
class TlsFile:
    """One file that holds a TLS implementation, as one process maps it."""

    kind: str           # openssl | openssl-in-binary | node | go | boringssl-static
    path: str           # as the process sees it
    attach_path: str    # a path in our own mount namespace naming the same file ("" when none does)
    dev: int
    ino: int
    readable: bool
    version: str = ""
    why_not: str = ""   # for a file that is not read: what it is and what would make it readable
    map_start: int = 0  # where the process maps the file's first byte (a PIE Go binary's load bias)
    go: GoTlsInfo | None = field(default=None, compare=False)   # a Go binary that can be read: its analysis

    @property
    def key(self) -> tuple[int, int]:
        return self.dev, self.ino


@dataclass
class ProcessTls:
    pid: int
    comm: str
    files: list[TlsFile] = field(default_factory=list)
    error: str = ""     # the process could not be inspected (gone, not permitted)

    def verdict(self) -> str:
        """One line: what will be read, or why nothing will."""
        if self.error:
            return f"cannot tell: {self.error}"
        readable = [f for f in self.files if f.readable]
        if readable:
            return "read: " + ", ".join(f"{f.kind} {f.path}" + (f" ({f.version})" if f.version else "")
                                        for f in readable)
        if self.files:
            return "not read: " + "; ".join(f.why_not for f in self.files)
        return "no TLS library mapped (plain TCP, or TLS this tool does not know)"

    def as_dict(self) -> dict[str, object]:
        files = []
        for f in self.files:
            d = {k: v for k, v in asdict(f).items() if k not in ("go", "map_start")}
            if f.go is not None:
                d["detail"] = describe(f.go)
            files.append(d)
        return {"pid": self.pid, "comm": self.comm, "verdict": self.verdict(), "error": self.error, "files": files}


@dataclass(frozen=True)
class _Mapped:
    path: str
    dev: int
    ino: int
    start: int
    end: int
    executable: bool


def _maps(pid: int) -> list[_Mapped]:
    """The files process `pid` maps, one entry per file (its first range). Raises OSError."""
    with open(f"/proc/{pid}/maps", "rb") as f:
        text = f.read(_MAPS_CAP)
    seen: dict[tuple[int, int], _Mapped] = {}
    execs: set[tuple[int, int]] = set()
    for line in text.decode("utf-8", "replace").splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[4] == "0":
            continue
        try:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            ino = int(parts[4])
        except ValueError:
            continue
        key = (os.makedev(major, minor), ino)
        path = parts[5].removesuffix(" (deleted)")
        if key not in seen:
            seen[key] = _Mapped(path, key[0], ino, start, end, False)
        if "x" in parts[1]:
            execs.add(key)
    return [_Mapped(m.path, m.dev, m.ino, m.start, m.end, (m.dev, m.ino) in execs) for m in seen.values()]


def _same_file(path: str, dev: int, ino: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_ino == ino and (st.st_dev == dev or os.major(dev) == 0)   # overlayfs maps show dev 0:x


def attach_path(pid: int, m: _Mapped) -> str:
    """A path that names the mapped file from here: the process's own root, else its map_files link."""
    for candidate in (f"/proc/{pid}/root{m.path}", f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}"):
        if _same_file(candidate, m.dev, m.ino):
            return candidate
    return ""


class Inspector:
    """Classifies processes' mapped files; what it learned about a file is kept per (device, inode)."""

    def __init__(self) -> None:
        self._exports: dict[tuple[int, int], bool] = {}
        self._boring: dict[tuple[int, int], bool] = {}
        self._versions: dict[tuple[int, int], str] = {}
        self._go: dict[tuple[int, int], tuple[GoTlsInfo | None, str] | None] = {}

    def process(self, pid: int) -> ProcessTls:
        comm = _comm(pid)
        out = ProcessTls(pid, comm)
        try:
            mapped = _maps(pid)
            if not mapped:      # a kernel thread, or a process exiting: nothing mapped, no TLS
                return out
            exe = os.stat(f"/proc/{pid}/exe")
        except OSError as exc:
            out.error = f"process {pid}: {exc.strerror or exc}"
            return out
        crypto = next((m for m in mapped if _LIBCRYPTO.match(os.path.basename(m.path))), None)
        for m in mapped:
            name = os.path.basename(m.path)
            if _LIBSSL.match(name):
                where = attach_path(pid, m)
                version = self._version(crypto, pid) if crypto is not None else ""
                out.files.append(TlsFile("openssl", m.path, where, m.dev, m.ino, bool(where), version,
                                         "" if where else f"{m.path}: the mapped file cannot be opened from here"))
                continue
            if _LIBJVM.match(name):
                out.files.append(TlsFile(
                    "java-jsse", m.path, attach_path(pid, m), m.dev, m.ino, False, "",
                    f"a JVM ({m.path}): Java's TLS (JSSE) is Java code, JIT-compiled, with no native function to "
                    "attach a probe to; record such a service on its plaintext side (a sidecar, the client), or "
                    "terminate TLS in front of it"))
                continue
            is_exe = (m.dev, m.ino) == (exe.st_dev, exe.st_ino)
            maybe_boring = bool(_MAYBE_BORING.search(name))
            if not m.executable or not (is_exe or maybe_boring):
                continue           # libc and the like: not opened at all (a host has thousands of them)
            if not (where := attach_path(pid, m)):
                continue
            if is_exe and (go := self._go_file(m, where)) is not None:
                info, why = go
                out.files.append(TlsFile("go", m.path, where, m.dev, m.ino, info is not None,
                                         info.go_version or "" if info else "", why, m.start, info))
            elif self._exports_openssl(m, where):
                if comm == "node" or name in ("node", "nodejs"):
                    out.files.append(TlsFile("node", m.path, where, m.dev, m.ino, True))
                else:
                    out.files.append(TlsFile("openssl-in-binary", m.path, where, m.dev, m.ino, True))
            elif maybe_boring and self._has_boringssl(m, where):
                out.files.append(TlsFile(
                    "boringssl-static", m.path, where, m.dev, m.ino, False, "",
                    f"BoringSSL linked statically into {name} with its symbols hidden (grpcio, Envoy): no "
                    "function to attach a probe to; record such a service on its plaintext side (a sidecar, "
                    "the client) or build it against the system OpenSSL"))
        return out

    def _exports_openssl(self, m: _Mapped, where: str) -> bool:
        key = (m.dev, m.ino)
        if key not in self._exports:
            self._exports[key] = _exports(where, _OPENSSL_API)
        return self._exports[key]

    def _has_boringssl(self, m: _Mapped, where: str) -> bool:
        key = (m.dev, m.ino)
        if key not in self._boring:
            self._boring[key] = _search(where, _BORINGSSL) is not None
        return self._boring[key]

    def _version(self, crypto: _Mapped, pid: int) -> str:
        key = (crypto.dev, crypto.ino)
        if key not in self._versions:
            where = attach_path(pid, crypto)
            found = _search(where, _OPENSSL_VERSION) if where else None
            self._versions[key] = found.decode("ascii", "replace") if found else ""
        return self._versions[key]

    def _go_file(self, m: _Mapped, where: str) -> tuple[GoTlsInfo | None, str] | None:
        """None: not a Go binary; else (its analysis if it can be read, why not if it cannot)."""
        key = (m.dev, m.ino)
        if key not in self._go:
            self._go[key] = _go_file(where, m.path)
        return self._go[key]


def _go_file(where: str, shown: str) -> tuple[GoTlsInfo | None, str] | None:
    """None: not a Go binary; else capture/ebpf/goelf.py's analysis, or why its crypto/tls is not read."""
    try:
        info = analyze(where)
    except GoElfError as exc:
        return None, f"Go binary {shown}? it cannot be analysed ({exc})"
    if info is None:
        return None
    if info.why_not:
        return None, f"Go binary {shown} ({info.go_version or 'unknown version'}): {info.why_not}"
    return info, ""


def _exports(path: str, names: Iterable[bytes]) -> bool:
    """Whether the ELF file at `path` defines every name in its dynamic symbol table (GNU hash lookup)."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            table = elf.get_section_by_name(".gnu.hash") or elf.get_section_by_name(".hash")
            if table is None or not hasattr(table, "get_symbol"):
                return False
            for name in names:
                sym = table.get_symbol(name.decode())
                if sym is None or sym["st_shndx"] == "SHN_UNDEF":
                    return False
            return True
    except (OSError, ELFError, ValueError, KeyError):
        return False


def _search(path: str, pattern: re.Pattern[bytes]) -> bytes | None:
    """The first match of `pattern` in the file (None: none, unreadable, or bigger than _SCAN_CAP)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not 0 < size <= _SCAN_CAP:
                return None
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                found = pattern.search(mm)
                return bytes(found.group(0)) if found else None
    except (OSError, ValueError):
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()
    except OSError:
        return "?"


def all_pids() -> list[int]:
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def port_pids(port: int) -> list[int]:
    """Processes holding a TCP socket on `port` (listening, or a connection either end of which is it)."""
    from capture.ebpf import procnet

    pids = {c.pid for c in procnet.listening(port)}
    for side in ("server", "client"):
        pids.update(c.pid for c in procnet.open_connections(port, side))
    return sorted(pids)


def target_pids(pid: int | None, cgroup: str | None, port: int = 0) -> list[int]:
    """The processes a recording targets: --pid, the --cgroup's, the holders of a socket on `port`, else all."""
    if pid:
        return [pid]
    if cgroup:
        from capture.ebpf.cgroups import members

        return sorted(members(Path(cgroup)))
    return port_pids(port) if port else all_pids()


def inspect_all(pids: Iterable[int], inspector: Inspector | None = None) -> Iterator[ProcessTls]:
    inspector = inspector or Inspector()
    for pid in pids:
        yield inspector.process(pid)
