"""Go `crypto/tls`: can a Go binary's TLS plaintext be traced with uprobes, and where.

Go does not use OpenSSL, so the OpenSSL probes see nothing of a Go service. tls.bpf.c's Go probes attach
to `crypto/tls.(*Conn).Write` and `crypto/tls.(*Conn).Read` (entries, and their return instructions,
where the byte count is known) and to the handshake's entry. This module is the pure-Python half: it
reads one Go ELF binary and says whether that works and with which numbers. Nothing is guessed: what cannot
be known from the file is reported in `why_not` instead.

    analyze(path) -> GoTlsInfo | None    (None: an ELF that is not a Go binary)
        go version    .go.buildinfo (the 1.18+ inline varint strings, or the pre-1.18 pointers to
                      runtime.buildVersion), else the runtime.buildVersion symbol
        arch          ELF e_machine: x86_64 / aarch64 are supported (64-bit little-endian)
        register ABI  Go >= 1.17 on x86_64, >= 1.18 on aarch64 (Go 1.17 used it on amd64 only);
                      the stack ABI is not supported
        probes        the symbol table (.symtab): Write, Read and handshakeContext entries, and every
                      return instruction inside Read and Write, found by disassembling the function (capstone)
                      within its symbol size. Never uretprobes: the kernel's return probe rewrites
                      the return address on the stack, and Go moves (copies) goroutine stacks.
        fd path       tls.Conn.conn (an interface: itab word, data word) -> *net.TCPConn
                      -> conn.fd (*netFD) -> netFD.pfd (poll.FD) -> FD.Sysfd: field offsets from the
                      binary's DWARF (pyelftools), else from KNOWN_OFFSETS (Go 1.17-1.23, 64-bit)

Addresses come twice: `*_vaddr` is the ELF virtual address (st_value; what bcc's
`attach_uprobe(name=path, addr=...)` takes: bcc 0.26 maps it to a file offset itself, through the
PT_LOAD segments), `*_offset` is the file offset (what the kernel's uprobe interface takes:
perf_event_open's uprobe offset, uprobe_events' PATH:OFFSET, libbpf's func_offset), computed the same
way: vaddr - p_vaddr + p_offset of the PT_LOAD segment that holds it.

Bounds: the file is read in pieces, never whole; every section and segment must lie inside the file;
symbol and string tables are capped at MAX_TABLE_BYTES, a function to disassemble at MAX_FUNC_BYTES,
each decompressed DWARF section at MAX_DWARF_SECTION_BYTES (a larger one is not read: the table is
used). A damaged or hostile file raises GoElfError with a one-line message.
"""

from __future__ import annotations

import io
import os
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from capture.errors import CaptureError

if TYPE_CHECKING:   # pyelftools is imported where a binary is read
    from elftools.dwarf.die import DIE
    from elftools.dwarf.dwarfinfo import DWARFInfo

MAX_FUNC_BYTES = 1 << 20             # a function larger than this is not disassembled (GoElfError)
MAX_TABLE_BYTES = 256 << 20          # .symtab / .strtab / .shstrtab
MAX_DWARF_SECTION_BYTES = 256 << 20  # one DWARF section, decompressed
BUILDINFO_SCAN_BYTES = 64 << 10      # where Go's debug/buildinfo looks for the header, too
MAX_VERSION_BYTES = 1024
MAX_DIE_CANDIDATES = 64              # occurrences of a type name tried in .debug_info
MAX_STRUCT_MEMBERS = 4096

READ_SYMBOL = "crypto/tls.(*Conn).Read"
WRITE_SYMBOL = "crypto/tls.(*Conn).Write"
# Every handshake (explicit, or the one Read and Write start) runs through this one (Go 1.17+; before:
# Handshake): a probe at its entry names the socket before the handshake's first byte moves.
HANDSHAKE_SYMBOLS = ("crypto/tls.(*Conn).handshakeContext", "crypto/tls.(*Conn).Handshake")
BUILD_VERSION_SYMBOL = "runtime.buildVersion"
# Go 1.20 renamed the itab symbols from go.itab.* to go:itab.*
TCPCONN_ITAB_SYMBOLS = ("go:itab.*net.TCPConn,net.Conn", "go.itab.*net.TCPConn,net.Conn")

STRIPPED = "stripped Go binary (built with -ldflags=-s -w): crypto/tls symbols absent"
NO_TLS = "Go binary without crypto/tls"

_BUILDINFO_MAGIC = b"\xff Go buildinf:"
_ELF_MAGIC = b"\x7fELF"
_ARCHES = {3: "i386", 8: "mips", 20: "ppc", 21: "ppc64", 22: "s390x", 40: "arm", 62: "x86_64",
           183: "aarch64", 243: "riscv64", 258: "loong64"}
_SUPPORTED = ("x86_64", "aarch64")
_REGABI_SINCE = {"x86_64": 17, "aarch64": 18}   # Go 1.x minor that switched the arch to the register ABI

_SHT_NOBITS, _SHT_SYMTAB = 8, 2
_SHF_COMPRESSED = 0x800
_PT_LOAD = 1
_PF_X, _PF_W = 1, 2
_STT_FUNC = 2


class GoElfError(CaptureError):
    """The file cannot be read as an ELF binary (missing, truncated, damaged or hostile)."""


@dataclass(frozen=True)
class GoStructOffsets:
    """Byte offsets that lead from a *tls.Conn to the socket's fd (64-bit Go).

    fd = *(int64 *)(*(*(*(conn + tls_conn_conn + iface_data) + tcpconn_conn_fd) + netfd_pfd + fd_sysfd)
    (the interface's data word is the *net.TCPConn; conn.fd is a *netFD; pfd is embedded by value).
    """

    tls_conn_conn: int    # crypto/tls.Conn.conn (net.Conn interface: itab word, then data word)
    iface_data: int       # the data word inside an interface value (runtime.iface.data)
    tcpconn_conn_fd: int  # net.TCPConn.conn (net.conn, embedded) + net.conn.fd (*net.netFD)
    netfd_pfd: int        # net.netFD.pfd (internal/poll.FD, by value)
    fd_sysfd: int         # internal/poll.FD.Sysfd (int)


# Go 1.17-1.23 on 64-bit targets: tls.Conn starts with `conn net.Conn`, TCPConn is `struct{ conn }`,
# conn is `struct{ fd *netFD }`, netFD starts with `pfd poll.FD`, and poll.FD is
# `{ fdmu fdMutex (uint64 + 2 x uint32 = 16 bytes); Sysfd int; ... }`.
# Checked for go1.19 only (the toolchain at hand): against the DWARF of amd64 and arm64 builds and the amd64
# build's own reflect (tests/test_capture_goelf.py). For 1.17-1.18 and 1.20-1.23 the entries follow the struct
# definitions above in the Go sources; no binary of those versions was checked.
_GO_117_TO_123 = GoStructOffsets(tls_conn_conn=0, iface_data=8, tcpconn_conn_fd=0, netfd_pfd=0, fd_sysfd=16)
KNOWN_OFFSETS: dict[tuple[int, int], GoStructOffsets] = {(1, minor): _GO_117_TO_123 for minor in range(17, 24)}


@dataclass(frozen=True)
class GoTlsInfo:
    """What analyze() found in one Go binary. `why_not` is None exactly when it can be traced."""

    path: str
    go_version: str | None          # as the binary records it, e.g. "go1.19.8"
    arch: str                       # "x86_64", "aarch64", or the other machine the ELF header names
    pie: bool                       # ET_DYN (position independent): add the load bias to *_vaddr at run time
    stripped: bool                  # no .symtab
    has_dwarf: bool
    register_abi: bool              # arguments and results in registers (else: stack ABI)
    write_vaddr: int | None         # crypto/tls.(*Conn).Write entry
    write_offset: int | None
    read_vaddr: int | None          # crypto/tls.(*Conn).Read entry
    read_offset: int | None
    read_ret_vaddrs: tuple[int, ...]    # every return instruction inside crypto/tls.(*Conn).Read
    read_ret_offsets: tuple[int, ...]
    write_ret_vaddrs: tuple[int, ...]   # ... and inside Write (its result says how much was written)
    write_ret_offsets: tuple[int, ...]
    handshake_vaddr: int | None     # crypto/tls.(*Conn).handshakeContext entry (None: absent)
    handshake_offset: int | None
    link_base: int                  # vaddr - file offset of the first PT_LOAD: a mapping of file offset 0
                                    # that starts at S has load bias S - link_base (0 for a non-PIE binary)
    tcpconn_itab_vaddr: int | None  # go:itab.*net.TCPConn,net.Conn: tls.Conn.conn's itab word when it wraps a TCPConn
    offsets: GoStructOffsets | None
    offsets_source: str | None      # "dwarf" or "table:go1.N"
    why_not: str | None

    @property
    def traceable(self) -> bool:
        return self.why_not is None


def describe(info: GoTlsInfo) -> str:
    """One line for humans."""
    head = f"{info.path}: Go {info.go_version or '(version unknown)'} {info.arch}"
    head += ", register ABI" if info.register_abi else ", stack ABI"
    head += ", PIE" if info.pie else ""
    head += ", stripped" if info.stripped else ""
    if info.why_not is not None:
        return f"{head}: not traceable: {info.why_not}"
    o = info.offsets
    assert o is not None and info.write_offset is not None and info.read_offset is not None
    return (f"{head}: uprobes at file offsets Write {info.write_offset:#x} + {len(info.write_ret_offsets)} "
            f"return instructions, Read {info.read_offset:#x} + {len(info.read_ret_offsets)} return instructions"
            f"{', handshake' if info.handshake_offset is not None else ''}; fd = conn+{o.tls_conn_conn} "
            f"-> data+{o.iface_data} -> fd+{o.tcpconn_conn_fd} -> pfd+{o.netfd_pfd} -> Sysfd+{o.fd_sysfd} "
            f"({info.offsets_source})")


def go_minor(version: str | None) -> int | None:
    """7 for "go1.7.3", 22 for "go1.22rc1" or "devel go1.22-abcdef ..."; None when not a Go 1.x version."""
    m = re.match(r"(?:devel )?go1\.(\d+)(?!\d)", version or "")
    return int(m.group(1)) if m else None


def analyze(path: str) -> GoTlsInfo | None:
    """Analyze the ELF file at `path`. None: not a Go binary. GoElfError: unreadable or damaged."""
    with _Elf(path) as elf:
        return _analyze(elf, path)


# --- the analysis --------------------------------------------------------------------------------------

def _analyze(elf: _Elf, path: str) -> GoTlsInfo | None:
    version = _buildinfo_version(elf)
    go_sections = any(elf.section(n) is not None for n in (".go.buildinfo", ".gopclntab", ".note.go.buildid"))
    if version is None and not go_sections and BUILD_VERSION_SYMBOL not in elf.symbols((BUILD_VERSION_SYMBOL,)):
        return None   # checked first so that a large C or C++ binary is not read further
    symbols = elf.symbols((READ_SYMBOL, WRITE_SYMBOL, BUILD_VERSION_SYMBOL) + TCPCONN_ITAB_SYMBOLS
                          + HANDSHAKE_SYMBOLS)
    if version is None and BUILD_VERSION_SYMBOL in symbols:
        version = _read_go_string(elf, symbols[BUILD_VERSION_SYMBOL][0])
    arch = elf.arch
    minor = go_minor(version)
    regabi = arch in _REGABI_SINCE and elf.is64 and elf.little and minor is not None \
        and minor >= _REGABI_SINCE[arch]
    fields: dict[str, Any] = dict(
        path=path, go_version=version, arch=arch, pie=elf.e_type == 3, stripped=elf.symtab is None,
        has_dwarf=elf.has_dwarf(), register_abi=regabi, write_vaddr=None, write_offset=None,
        read_vaddr=None, read_offset=None, read_ret_vaddrs=(), read_ret_offsets=(),
        write_ret_vaddrs=(), write_ret_offsets=(), handshake_vaddr=None, handshake_offset=None,
        link_base=min((seg.vaddr - seg.offset for seg in elf.loads), default=0),
        tcpconn_itab_vaddr=None, offsets=None, offsets_source=None, why_not=None)

    def result(why_not: str | None = None) -> GoTlsInfo:
        return GoTlsInfo(**{**fields, "why_not": why_not})

    if arch not in _SUPPORTED or not elf.is64 or not elf.little:
        kind = f"{arch}, {'64' if elf.is64 else '32'}-bit {'little' if elf.little else 'big'}-endian"
        return result(f"unsupported architecture ({kind}): only 64-bit little-endian x86_64 and aarch64")
    if version is None or minor is None:
        return result(f"Go version unknown ({version or 'no readable .go.buildinfo or runtime.buildVersion'})"
                      ": not guessed")
    if not regabi:
        return result(f"{version} on {arch} uses the stack ABI (register ABI since Go 1.17 on x86_64, "
                      "1.18 on aarch64): not supported")
    if elf.symtab is None:
        return result(STRIPPED)
    if READ_SYMBOL not in symbols and WRITE_SYMBOL not in symbols:
        return result(NO_TLS)
    for name in (WRITE_SYMBOL, READ_SYMBOL):
        if name not in symbols:
            other = READ_SYMBOL if name == WRITE_SYMBOL else WRITE_SYMBOL
            return result(f"{name} absent from the symbol table ({other} is there): both are needed")
    wv, _ = symbols[WRITE_SYMBOL]
    rv, _ = symbols[READ_SYMBOL]
    fields.update(write_vaddr=wv, write_offset=elf.file_offset(wv, 1, WRITE_SYMBOL, executable=True),
                  read_vaddr=rv, read_offset=elf.file_offset(rv, 1, READ_SYMBOL, executable=True))
    for name in TCPCONN_ITAB_SYMBOLS:
        if name in symbols:
            fields["tcpconn_itab_vaddr"] = symbols[name][0]
            break
    for name in HANDSHAKE_SYMBOLS:
        if name in symbols:
            hv = symbols[name][0]
            fields.update(handshake_vaddr=hv, handshake_offset=elf.file_offset(hv, 1, name, executable=True))
            break
    for name, prefix in ((READ_SYMBOL, "read"), (WRITE_SYMBOL, "write")):
        vaddr, size = symbols[name]
        if size <= 0:
            return result(f"{name} has no symbol size: its return instructions cannot be bounded")
        if size > MAX_FUNC_BYTES:
            raise GoElfError(f"{path}: {name} claims {size} bytes (more than {MAX_FUNC_BYTES}): damaged symbol table")
        code = elf.read(elf.file_offset(vaddr, size, name, executable=True), size)
        rets, why = _return_instructions(code, vaddr, arch, name)
        if why is not None:
            return result(why)
        fields.update({f"{prefix}_ret_vaddrs": tuple(rets),
                       f"{prefix}_ret_offsets": tuple(elf.file_offset(a, 1, name, executable=True) for a in rets)})

    table = KNOWN_OFFSETS.get((1, minor))
    try:
        offsets = _dwarf_offsets(elf) if fields["has_dwarf"] else None
    except _LayoutMismatch as exc:
        return result(f"DWARF layout differs from what the fd path expects: {exc}")
    except GoElfError:
        raise
    except Exception as exc:   # pyelftools met damaged DWARF inside a type it had found
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise GoElfError(f"{path}: damaged DWARF ({detail})") from exc
    if offsets is not None:
        fields.update(offsets=offsets, offsets_source="dwarf")
    elif table is not None:
        fields.update(offsets=table, offsets_source=f"table:go1.{minor}")
    else:
        known = f"go1.{min(k[1] for k in KNOWN_OFFSETS)}-go1.{max(k[1] for k in KNOWN_OFFSETS)}"
        return result(f"struct offsets unknown: no usable DWARF and {version} is not in the table ({known})")
    return result()


def _return_instructions(code: bytes, vaddr: int, arch: str, name: str = READ_SYMBOL) -> tuple[list[int], str | None]:
    """Addresses of the return instructions in `code` (one whole function), by a linear sweep."""
    import capstone

    if arch == "x86_64":
        md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    else:
        arm64 = getattr(capstone, "CS_ARCH_ARM64", None)   # capstone 6 renames it CS_ARCH_AARCH64
        md = capstone.Cs(arm64 if arm64 is not None else capstone.CS_ARCH_AARCH64, capstone.CS_MODE_ARM)
    md.detail = True
    rets: list[int] = []
    leaves: list[int] = []   # direct jumps out of the function: a way out that is no return instruction
    end = vaddr
    try:
        for insn in md.disasm(code, vaddr):
            if insn.group(capstone.CS_GRP_RET):
                rets.append(insn.address)
            elif insn.group(capstone.CS_GRP_JUMP) and not insn.group(capstone.CS_GRP_CALL):
                targets = [op.imm for op in insn.operands if op.type == capstone.CS_OP_IMM]
                if targets and not vaddr <= targets[-1] < vaddr + len(code):
                    leaves.append(insn.address)
            end = insn.address + insn.size
    except capstone.CsError as exc:
        return [], f"{name}: disassembly failed ({exc})"
    if leaves:   # a tail call: its callee's return would skip every probe placed here
        return [], (f"{name}: jumps out of the function at {leaves[0]:#x} (a tail call): "
                    "return probes would miss that way out")
    if end != vaddr + len(code):
        # Capstone stops at the first byte it cannot decode: a return after it would be missed.
        return [], (f"{name}: cannot disassemble past {end:#x} (function ends at "
                    f"{vaddr + len(code):#x}): its return instructions are not all known")
    if not rets:
        return [], f"{name}: no return instruction found"
    return rets, None


def _buildinfo_version(elf: _Elf) -> str | None:
    """The version string of the .go.buildinfo header (Go 1.13+), as Go's debug/buildinfo reads it."""
    sec = elf.section(".go.buildinfo")
    if sec is not None and sec.type != _SHT_NOBITS:
        data = elf.read(sec.offset, min(sec.size, BUILDINFO_SCAN_BYTES))
    else:   # no section headers for it: the start of the first writable, non-executable segment
        seg = next((s for s in elf.loads if s.flags & (_PF_X | _PF_W) == _PF_W), None)
        if seg is None:
            return None
        data = elf.read(seg.offset, min(seg.filesz, BUILDINFO_SCAN_BYTES))
    at = data.find(_BUILDINFO_MAGIC)
    while at >= 0 and at % 16:
        at = data.find(_BUILDINFO_MAGIC, at + 1)
    if at < 0 or len(data) < at + 32:
        return None
    head = data[at:]
    ptr_size, flags = head[14], head[15]
    if flags & 2:   # Go 1.18+: varint-length strings right after the 32-byte header
        n, pos = _uvarint(head, 32)
        if n > MAX_VERSION_BYTES or pos + n > len(head):
            raise GoElfError(f"{elf.path}: .go.buildinfo version string is damaged ({n} bytes)")
        return _version_text(elf, head[pos:pos + n])
    if ptr_size not in (4, 8):
        raise GoElfError(f"{elf.path}: .go.buildinfo pointer size {ptr_size}: damaged")
    big = flags & 1
    ptr = int.from_bytes(head[16:16 + ptr_size], "big" if big else "little")
    return _read_go_string(elf, ptr, ptr_size=ptr_size, big=bool(big))


def _read_go_string(elf: _Elf, vaddr: int, ptr_size: int | None = None, big: bool | None = None) -> str:
    """The Go string whose header (data pointer, length) is at `vaddr`."""
    ptr_size = ptr_size or (8 if elf.is64 else 4)
    order: Literal["big", "little"] = "big" if (big if big is not None else not elf.little) else "little"
    hdr = elf.read(elf.file_offset(vaddr, 2 * ptr_size, "the Go version string header"), 2 * ptr_size)
    data = int.from_bytes(hdr[:ptr_size], order)
    n = int.from_bytes(hdr[ptr_size:], order)
    if n > MAX_VERSION_BYTES:
        raise GoElfError(f"{elf.path}: Go version string claims {n} bytes: damaged")
    return _version_text(elf, elf.read(elf.file_offset(data, n, "the Go version string"), n))


def _version_text(elf: _Elf, raw: bytes) -> str:
    if not raw or not all(0x20 <= b < 0x7F for b in raw):
        raise GoElfError(f"{elf.path}: the Go version string is not printable ASCII: damaged")
    return raw.decode("ascii")


def _uvarint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(pos + 10, len(data))):
        b = data[i]
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i + 1
        shift += 7
    return 1 << 64, len(data)   # unterminated: larger than any bound


# --- DWARF ---------------------------------------------------------------------------------------------

class _LayoutMismatch(Exception):
    """The DWARF describes a struct on the fd path, but not with the field (or type) expected."""


def _dwarf_offsets(elf: _Elf) -> GoStructOffsets | None:
    """The fd-path offsets from DWARF; None when the DWARF is missing, too large or lacks the types."""
    from elftools.dwarf.dwarfinfo import DebugSectionDescriptor, DwarfConfig, DWARFInfo

    info = elf.debug_section("info")
    abbrev = elf.debug_section("abbrev")
    if info is None or abbrev is None:
        return None
    sections: dict[str, DebugSectionDescriptor | None] = {}
    for name, data in (("info", info), ("abbrev", abbrev), ("str", elf.debug_section("str"))):
        sections[name] = None if data is None else DebugSectionDescriptor(
            stream=io.BytesIO(data), name=f".debug_{name}", global_offset=None, size=len(data), address=0)
    dwarf = DWARFInfo(
        config=DwarfConfig(little_endian=elf.little, machine_arch="x64" if elf.arch == "x86_64" else "AArch64",
                           default_address_size=8 if elf.is64 else 4),
        debug_info_sec=sections["info"], debug_abbrev_sec=sections["abbrev"], debug_str_sec=sections["str"],
        debug_aranges_sec=None, debug_frame_sec=None, eh_frame_sec=None, debug_loc_sec=None,
        debug_ranges_sec=None, debug_line_sec=None, debug_pubtypes_sec=None, debug_pubnames_sec=None,
        debug_addr_sec=None, debug_str_offsets_sec=None, debug_line_str_sec=None, debug_loclists_sec=None,
        debug_rnglists_sec=None, debug_sup_sec=None, gnu_debugaltlink_sec=None, debug_types_sec=None)

    structs = {}
    for name in ("crypto/tls.Conn", "net.TCPConn", "net.conn", "net.netFD", "internal/poll.FD"):
        die = _find_struct(dwarf, info, name)
        if die is None:
            return None
        structs[name] = die
    tls_conn, iface_type = _member(structs["crypto/tls.Conn"], "conn", "net.Conn")
    iface = _resolve_struct(iface_type)
    if iface is None:
        raise _LayoutMismatch("crypto/tls.Conn.conn's type net.Conn does not resolve to an interface struct")
    iface_data, _ = _member(iface, "data", None)
    tcp_conn, _ = _member(structs["net.TCPConn"], "conn", "net.conn")
    conn_fd, _ = _member(structs["net.conn"], "fd", "*net.netFD")
    pfd, _ = _member(structs["net.netFD"], "pfd", "internal/poll.FD")
    sysfd, _ = _member(structs["internal/poll.FD"], "Sysfd", "int")
    return GoStructOffsets(tls_conn_conn=tls_conn, iface_data=iface_data, tcpconn_conn_fd=tcp_conn + conn_fd,
                           netfd_pfd=pfd, fd_sysfd=sysfd)


def _find_struct(dwarf: DWARFInfo, info: bytes, name: str) -> DIE | None:
    """The DW_TAG_structure_type DIE named `name`, found without walking every DIE.

    Go's linker writes a type's name inline (DW_FORM_string) as its DIE's first attribute, right after
    the abbreviation code: each occurrence of the name is tried as such a DIE, and one is accepted only
    when pyelftools parses a structure type there whose DW_AT_name is exactly that occurrence.
    """
    needle = name.encode() + b"\0"
    at = info.find(needle)
    tries = 0
    while at > 0 and tries < MAX_DIE_CANDIDATES:
        tries += 1
        # the abbreviation code is a ULEB128 that ends right before the name: 1 to 4 bytes
        for k in range(1, 5):
            start = at - k
            if start < 0 or (k == 1 and info[at - 1] & 0x80) or (k > 1 and not info[start] & 0x80):
                break
            try:
                die = dwarf.get_DIE_from_refaddr(start)
                attr = die.attributes.get("DW_AT_name")
            except Exception:   # not a DIE boundary: pyelftools' errors vary with the bytes it met
                continue
            if die.tag == "DW_TAG_structure_type" and attr is not None and attr.offset == at \
                    and attr.value == needle[:-1]:
                return die
        at = info.find(needle, at + 1)
    return None


def _die_name(die: DIE | None) -> str | None:
    attr = die.attributes.get("DW_AT_name") if die is not None else None
    if attr is None or not isinstance(attr.value, bytes):
        return None
    return attr.value.decode("utf-8", errors="replace")


def _die_type(die: DIE) -> DIE | None:
    if "DW_AT_type" not in die.attributes:
        return None
    try:
        return die.get_DIE_from_attribute("DW_AT_type")
    except Exception:   # a reference out of the section: treated as no type
        return None


def _resolve_struct(die: DIE | None) -> DIE | None:
    """Follow typedefs (Go's interface types are typedefs of runtime.iface) to the structure type."""
    for _ in range(8):
        if die is None or die.tag == "DW_TAG_structure_type":
            return die
        if die.tag != "DW_TAG_typedef":
            return None
        die = _die_type(die)
    return None


def _member(struct_die: DIE, field: str, type_name: str | None) -> tuple[int, DIE | None]:
    """(offset, type DIE) of a struct's field; _LayoutMismatch when absent or of another type."""
    sname = _die_name(struct_die)
    for i, child in enumerate(struct_die.iter_children()):
        if i >= MAX_STRUCT_MEMBERS:
            break
        if child.tag != "DW_TAG_member" or _die_name(child) != field:
            continue
        ftype = _die_type(child)
        if type_name is not None and _die_name(ftype) != type_name:
            raise _LayoutMismatch(f"{sname}.{field} is of type {_die_name(ftype)}, not {type_name}")
        loc = child.attributes.get("DW_AT_data_member_location")
        value = loc.value if loc is not None else None
        if isinstance(value, list) and len(value) >= 2 and value[0] == 0x23:   # DW_OP_plus_uconst
            value, _ = _uvarint(bytes(value), 1)
        if not isinstance(value, int) or not 0 <= value < 1 << 32:
            raise _LayoutMismatch(f"{sname}.{field} has no constant offset ({loc})")
        return value, ftype
    raise _LayoutMismatch(f"{sname} has no field {field}")


# --- ELF -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Section:
    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int


@dataclass(frozen=True)
class _Load:
    offset: int
    vaddr: int
    filesz: int
    flags: int


class _Elf:
    """A bounded ELF reader: headers validated against the file size, reads in pieces."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise GoElfError(f"{path}: cannot open: {exc.strerror}") from exc
        try:
            self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> _Elf:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise GoElfError(f"{self.path}: read of {size} bytes at {offset:#x} runs past the end of the "
                             f"file ({self.size} bytes): truncated or damaged")
        try:
            data = os.pread(self._fd, size, offset)
        except OSError as exc:
            raise GoElfError(f"{self.path}: read failed: {exc.strerror}") from exc
        if len(data) != size:
            raise GoElfError(f"{self.path}: short read at {offset:#x}: the file changed while read")
        return data

    def _parse(self) -> None:
        try:
            self.size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise GoElfError(f"{self.path}: cannot stat: {exc.strerror}") from exc
        if self.size < 16:
            raise GoElfError(f"{self.path}: not an ELF file ({self.size} bytes)")
        ident = self.read(0, 16)
        if ident[:4] != _ELF_MAGIC:
            raise GoElfError(f"{self.path}: not an ELF file (no ELF magic)")
        if ident[4] not in (1, 2) or ident[5] not in (1, 2):
            raise GoElfError(f"{self.path}: ELF class {ident[4]} / data encoding {ident[5]}: damaged header")
        self.is64 = ident[4] == 2
        self.little = ident[5] == 1
        e = "<" if self.little else ">"
        if self.is64:
            fmt, ph_fmt, sh_fmt = e + "HHIQQQIHHHHHH", e + "IIQQQQQQ", e + "IIQQQQIIQQ"
        else:
            fmt, ph_fmt, sh_fmt = e + "HHIIIIIHHHHHH", e + "IIIIIIII", e + "IIIIIIIIII"
        hsize = struct.calcsize(fmt)
        if self.size < 16 + hsize:
            raise GoElfError(f"{self.path}: truncated ELF header ({self.size} bytes)")
        (self.e_type, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
         shstrndx) = struct.unpack(fmt, self.read(16, hsize))
        self.arch = _ARCHES.get(machine, f"e_machine {machine}")
        self.loads: list[_Load] = []
        self.sections: list[_Section] = []
        self.symtab: _Section | None = None

        if phnum:
            if not struct.calcsize(ph_fmt) <= phentsize <= 256:
                raise GoElfError(f"{self.path}: program header entries of {phentsize} bytes: damaged header")
            table = self.read(phoff, phnum * phentsize)
            for i in range(phnum):
                f = struct.unpack_from(ph_fmt, table, i * phentsize)
                if self.is64:
                    p_type, p_flags, p_offset, p_vaddr, _, p_filesz = f[:6]
                else:
                    p_type, p_offset, p_vaddr, _, p_filesz, _, p_flags = f[:7]
                if p_type != _PT_LOAD:
                    continue
                if p_offset + p_filesz > self.size:
                    raise GoElfError(f"{self.path}: PT_LOAD segment {i} (offset {p_offset:#x}, {p_filesz} "
                                     f"bytes) runs past the end of the file ({self.size} bytes): truncated or damaged")
                self.loads.append(_Load(p_offset, p_vaddr, p_filesz, p_flags))

        if shoff == 0:
            return
        if shnum == 0:
            raise GoElfError(f"{self.path}: extended section numbering (e_shnum 0): not supported")
        if not struct.calcsize(sh_fmt) <= shentsize <= 256:
            raise GoElfError(f"{self.path}: section header entries of {shentsize} bytes: damaged header")
        table = self.read(shoff, shnum * shentsize)
        raw = [struct.unpack_from(sh_fmt, table, i * shentsize) for i in range(shnum)]
        for i, (_, sh_type, _, _, sh_offset, sh_size, *_rest) in enumerate(raw):
            if sh_type not in (0, _SHT_NOBITS) and sh_offset + sh_size > self.size:
                raise GoElfError(f"{self.path}: section {i} (offset {sh_offset:#x}, {sh_size} bytes) runs past "
                                 f"the end of the file ({self.size} bytes): truncated or damaged")
        if shstrndx >= shnum:
            raise GoElfError(f"{self.path}: section name table index {shstrndx} of {shnum}: damaged header")
        names = self._table_bytes(raw[shstrndx][4], raw[shstrndx][5], "the section name table")
        for name_off, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, *_rest in raw:
            end = names.find(b"\0", name_off)
            name = names[name_off:end if end >= 0 else len(names)].decode("utf-8", errors="replace")
            self.sections.append(_Section(name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link))
        self.symtab = next((s for s in self.sections if s.type == _SHT_SYMTAB), None)

    def _table_bytes(self, offset: int, size: int, what: str) -> bytes:
        if size > MAX_TABLE_BYTES:
            raise GoElfError(f"{self.path}: {what} claims {size} bytes (more than {MAX_TABLE_BYTES}): damaged")
        return self.read(offset, size)

    def section(self, name: str) -> _Section | None:
        return next((s for s in self.sections if s.name == name), None)

    def file_offset(self, vaddr: int, size: int, what: str, executable: bool = False) -> int:
        """The file offset of [vaddr, vaddr+size) through the PT_LOAD segment that holds all of it."""
        for seg in self.loads:
            if seg.vaddr <= vaddr and vaddr + size <= seg.vaddr + seg.filesz:
                if executable and not seg.flags & _PF_X:
                    raise GoElfError(f"{self.path}: {what} at {vaddr:#x} is in a non-executable segment: damaged")
                return vaddr - seg.vaddr + seg.offset
        raise GoElfError(f"{self.path}: {what} at {vaddr:#x} ({size} bytes) is outside every PT_LOAD "
                         "segment's file bytes: damaged")

    def symbols(self, names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        """name -> (st_value, st_size) of the first defined symbol of each name found in .symtab."""
        sec = self.symtab
        if sec is None:
            return {}
        if not 0 <= sec.link < len(self.sections):
            raise GoElfError(f"{self.path}: .symtab links to section {sec.link}: damaged")
        strtab = self.sections[sec.link]
        strings = self._table_bytes(strtab.offset, strtab.size, "the symbol name table")
        # st_name -> wanted name: every position where "name\0" starts (so shared suffixes match too)
        wanted: dict[int, str] = {}
        for name in names:
            needle = name.encode() + b"\0"
            at = strings.find(needle)
            while at >= 0:
                wanted[at] = name
                at = strings.find(needle, at + 1)
        data = self._table_bytes(sec.offset, sec.size, "the symbol table")
        e = "<" if self.little else ">"
        fmt = e + ("IBBHQQ" if self.is64 else "IIIBBH")
        entsize = struct.calcsize(fmt)
        found: dict[str, tuple[int, int]] = {}
        for fields in struct.iter_unpack(fmt, data[:len(data) - len(data) % entsize]):
            hit = wanted.get(fields[0])
            if hit is None or hit in found:
                continue
            if self.is64:
                _, _, _, shndx, value, size = fields
            else:
                _, value, size, _, _, shndx = fields
            if shndx != 0:   # SHN_UNDEF: not defined here
                found[hit] = (value, size)
        return found

    def has_dwarf(self) -> bool:
        return any(self.section(p + "debug_info") is not None for p in (".", ".z"))

    def debug_section(self, base: str) -> bytes | None:
        """.debug_<base> (plain or SHF_COMPRESSED) or .zdebug_<base>, decompressed; None: absent or too large."""
        sec = self.section(".debug_" + base)
        legacy = False
        if sec is None:
            sec = self.section(".zdebug_" + base)
            legacy = True
        if sec is None or sec.type == _SHT_NOBITS:
            return None
        if legacy:   # "ZLIB", 8-byte big-endian size, zlib stream (Go 1.11-1.18)
            head = self.read(sec.offset, min(sec.size, 12))
            if len(head) < 12 or head[:4] != b"ZLIB":
                return None
            size, start = int.from_bytes(head[4:12], "big"), 12
        elif sec.flags & _SHF_COMPRESSED:   # Elf_Chdr (Go 1.19+)
            e = "<" if self.little else ">"
            fmt = e + ("IIQQ" if self.is64 else "III")
            start = struct.calcsize(fmt)
            if sec.size < start:
                return None
            chdr = struct.unpack(fmt, self.read(sec.offset, start))
            if chdr[0] != 1:   # ELFCOMPRESS_ZLIB only
                return None
            size = chdr[2] if self.is64 else chdr[1]
        else:
            return self.read(sec.offset, sec.size) if sec.size <= MAX_DWARF_SECTION_BYTES else None
        if size > MAX_DWARF_SECTION_BYTES:
            return None
        out = bytearray()
        d = zlib.decompressobj()
        try:
            for chunk in self._chunks(sec.offset + start, sec.size - start):
                out += d.decompress(chunk, size + 1 - len(out))
                if len(out) > size:
                    break
        except zlib.error:
            return None
        return bytes(out) if len(out) == size else None

    def _chunks(self, offset: int, size: int, step: int = 1 << 20) -> Iterator[bytes]:
        for at in range(offset, offset + size, step):
            yield self.read(at, min(step, offset + size - at))
