"""Go crypto/tls uprobe analysis (capture/ebpf/goelf.py) against Go binaries built here with `go build`.

The programs are tests/interop/go/https_roundtrip.go (a stdlib HTTPS server and client; `layout` makes it
print its own tls.Conn -> fd field offsets through reflect) and tests/interop/go/plain_http.go (the network
but no crypto/tls). Every number analyze() gives is compared with a tool that does not share its code:
`go tool nm` for the symbols, pyelftools' program headers for the virtual address -> file offset mapping,
binutils' objdump and `go tool objdump` for the return instructions, the binary's own reflect for the
struct offsets. The builds use CGO_ENABLED=0 (static, no C compiler needed), GOCACHE and GOPATH under
pytest's tmp directory, GOPATH mode (no module proxy is reached).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import subprocess
import time
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from capture.ebpf import goelf
from capture.ebpf.goelf import GoElfError, GoStructOffsets, GoTlsInfo
from tests.golang import ELF_ARCH, GO, GO_SRC, go_cmd
from wire.process import spawn

pytestmark = pytest.mark.skipif(GO is None, reason="needs the Go toolchain (apt-get install golang-go; "
                                                   "scripts/setup.sh does)")
HTTPS_SRC = GO_SRC / "https_roundtrip.go"
PLAIN_SRC = GO_SRC / "plain_http.go"
OTHER_GOARCH = {"amd64": "arm64", "arm64": "amd64"}


@pytest.fixture(scope="module")
def https_bin(build: Callable[..., Path]) -> Path:
    return build("https", HTTPS_SRC)


@pytest.fixture(scope="module")
def https_info(https_bin: Path) -> GoTlsInfo:
    info = goelf.analyze(str(https_bin))
    assert info is not None
    return info


@pytest.fixture(scope="module")
def layout(https_bin: Path) -> dict[str, Any]:
    """The struct offsets the binary's own reflect reports (it runs on this host)."""
    out = subprocess.run([str(https_bin), "layout"], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def _nm(binary: Path) -> dict[str, tuple[int, int]]:
    """name -> (address, size) from `go tool nm -size` (its own ELF reader, not goelf's)."""
    syms: dict[str, tuple[int, int]] = {}
    for line in go_cmd("tool", "nm", "-size", str(binary)).splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4:
            syms.setdefault(parts[3], (int(parts[0], 16), int(parts[1])))
    return syms


def _pt_load_offset(binary: Path, vaddr: int) -> int:
    """vaddr -> file offset through pyelftools' program headers (goelf parses them itself)."""
    from elftools.elf.elffile import ELFFile

    with open(binary, "rb") as f:
        for seg in ELFFile(f).iter_segments():
            if seg["p_type"] == "PT_LOAD" and seg["p_vaddr"] <= vaddr < seg["p_vaddr"] + seg["p_filesz"]:
                return int(vaddr - seg["p_vaddr"] + seg["p_offset"])
    raise AssertionError(f"{vaddr:#x} is in no PT_LOAD segment of {binary}")


def _go_objdump_rets(binary: Path, func: str) -> list[int]:
    """Addresses of the RET instructions `go tool objdump` lists in `func` (any architecture)."""
    out = go_cmd("tool", "objdump", "-s", "^" + re.escape(func) + "$", str(binary))
    rets = [int(m.group(1), 16) for m in re.finditer(r"^\s+\S+\t+0x([0-9a-f]+)\t+[0-9a-f]+\t+RET\b", out, re.M)]
    assert "TEXT " + func in out, out[:2000]
    return rets


def _expected_layout(layout: dict[str, Any]) -> GoStructOffsets:
    fields = ("tls_conn_conn", "iface_data", "tcpconn_conn_fd", "netfd_pfd", "fd_sysfd")
    return GoStructOffsets(**{f: int(layout[f]) for f in fields})


# --- the HTTPS program, as built by default (symbols and DWARF) ------------------------------------------

def test_https_program_runs_and_is_traceable(https_bin: Path, https_info: GoTlsInfo, go_version: str,
                                             host_goarch: str) -> None:
    out = subprocess.run([str(https_bin)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "hello over go tls: /ping", out.stdout + out.stderr   # a real TLS round trip
    info = https_info
    assert info.why_not is None and info.traceable
    assert info.go_version == go_version
    assert info.arch == ELF_ARCH[host_goarch]
    assert info.register_abi is True
    assert info.stripped is False and info.has_dwarf is True and info.pie is False


def test_entry_offsets_match_go_tool_nm_and_pt_load(https_bin: Path, https_info: GoTlsInfo) -> None:
    syms = _nm(https_bin)
    write, read = syms[goelf.WRITE_SYMBOL][0], syms[goelf.READ_SYMBOL][0]
    assert (https_info.write_vaddr, https_info.read_vaddr) == (write, read)
    assert https_info.write_offset == _pt_load_offset(https_bin, write)
    assert https_info.read_offset == _pt_load_offset(https_bin, read)
    # non-PIE: the text segment is mapped at 0x400000 from offset 0, so offset != vaddr
    assert https_info.read_offset != https_info.read_vaddr
    itab = next(syms[n][0] for n in goelf.TCPCONN_ITAB_SYMBOLS if n in syms)
    assert https_info.tcpconn_itab_vaddr == itab


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump (apt-get install binutils)")
def test_read_returns_match_objdump(https_bin: Path, https_info: GoTlsInfo) -> None:
    start, size = _nm(https_bin)[goelf.READ_SYMBOL]
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={start:#x}",
                          f"--stop-address={start + size:#x}", str(https_bin)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rets = [int(m.group(1), 16) for m in re.finditer(r"^\s*([0-9a-f]+):\s+ret[qw]?\b", out, re.M)]
    assert len(rets) >= 2, out[-3000:]   # Read returns on several paths (7 with go1.19)
    assert list(https_info.read_ret_vaddrs) == rets
    assert list(https_info.read_ret_offsets) == [_pt_load_offset(https_bin, a) for a in rets]
    assert all(start <= a < start + size for a in https_info.read_ret_vaddrs)


def test_read_returns_match_go_tool_objdump(https_bin: Path, https_info: GoTlsInfo) -> None:
    assert list(https_info.read_ret_vaddrs) == _go_objdump_rets(https_bin, goelf.READ_SYMBOL)


def test_write_returns_and_handshake_entry(https_bin: Path, https_info: GoTlsInfo) -> None:
    """Write is probed at its returns too (an entry probe fires twice when the goroutine's stack grows),
    and every handshake starts in handshakeContext: both found the way the Read probes are."""
    rets = _go_objdump_rets(https_bin, goelf.WRITE_SYMBOL)
    assert rets and list(https_info.write_ret_vaddrs) == rets
    assert list(https_info.write_ret_offsets) == [_pt_load_offset(https_bin, a) for a in rets]
    syms = _nm(https_bin)
    hs = syms["crypto/tls.(*Conn).handshakeContext"][0]
    assert https_info.handshake_vaddr == hs and https_info.handshake_offset == _pt_load_offset(https_bin, hs)
    assert https_info.link_base == 0x400000    # non-PIE amd64/arm64: text from offset 0 at 0x400000


def test_struct_offsets_from_dwarf_match_reflect_and_table(https_info: GoTlsInfo, layout: dict[str, Any],
                                                           go_version: str) -> None:
    assert https_info.offsets_source == "dwarf"
    assert layout["types"] == ["net.Conn", "net.conn", "*net.netFD", "poll.FD", "int"]
    assert https_info.offsets == _expected_layout(layout)
    assert https_info.offsets == GoStructOffsets(tls_conn_conn=0, iface_data=8, tcpconn_conn_fd=0,
                                                 netfd_pfd=0, fd_sysfd=16)
    minor = goelf.go_minor(go_version)
    assert minor is not None
    if (1, minor) in goelf.KNOWN_OFFSETS:   # the table's claim, checked against this toolchain's DWARF
        assert goelf.KNOWN_OFFSETS[(1, minor)] == https_info.offsets


def test_describe_is_one_line(https_info: GoTlsInfo) -> None:
    line = goelf.describe(https_info)
    assert "\n" not in line
    assert https_info.go_version is not None and https_info.go_version in line
    assert f"+ {len(https_info.read_ret_offsets)} return instructions" in line
    assert f"Read {https_info.read_offset:#x}" in line and "(dwarf)" in line


def test_bcc_resolves_the_same_offsets(https_bin: Path, https_info: GoTlsInfo) -> None:
    """bcc's attach_uprobe(addr=) takes the virtual address and maps it to the file offset goelf gives."""
    try:
        from bcc import BPF
    except ImportError:
        pytest.skip("bcc is not importable (apt-get install python3-bpfcc; scripts/setup.sh does)")
    path = str(https_bin).encode()
    for sym, vaddr, offset in ((goelf.READ_SYMBOL, https_info.read_vaddr, https_info.read_offset),
                               (goelf.WRITE_SYMBOL, https_info.write_vaddr, https_info.write_offset)):
        assert BPF._check_path_symbol(path, sym.encode(), None, -1)[1] == offset
        assert BPF._check_path_symbol(path, b"", vaddr, -1)[1] == offset


# --- other builds ------------------------------------------------------------------------------------------

def test_stripped_binary_says_why(build: Callable[..., Path], go_version: str) -> None:
    binary = build("https_stripped", HTTPS_SRC, "-ldflags=-s -w")
    proc = subprocess.run([GO or "go", "tool", "nm", str(binary)], capture_output=True, text=True)
    assert "crypto/tls" not in proc.stdout   # the premise: no symbol table left
    info = goelf.analyze(str(binary))
    assert info is not None
    assert info.why_not == goelf.STRIPPED and "stripped" in info.why_not and not info.traceable
    assert info.stripped is True and info.has_dwarf is False
    assert info.go_version == go_version   # .go.buildinfo survives -s -w
    assert info.read_offset is None and info.write_offset is None and info.read_ret_offsets == ()
    assert info.offsets is None
    assert goelf.STRIPPED in goelf.describe(info)


def test_no_dwarf_uses_the_table(build: Callable[..., Path], go_version: str, layout: dict[str, Any]) -> None:
    binary = build("https_nodwarf", HTTPS_SRC, "-ldflags=-w")
    info = goelf.analyze(str(binary))
    assert info is not None and info.stripped is False and info.has_dwarf is False
    minor = goelf.go_minor(go_version)
    assert minor is not None
    if (1, minor) not in goelf.KNOWN_OFFSETS:
        assert info.why_not is not None and info.why_not.startswith("struct offsets unknown")
        return
    assert info.why_not is None
    assert info.offsets_source == f"table:go1.{minor}"
    assert info.offsets == _expected_layout(layout)   # what the same program's reflect reports
    syms = _nm(binary)
    assert info.read_offset == _pt_load_offset(binary, syms[goelf.READ_SYMBOL][0])
    assert list(info.read_ret_vaddrs) == _go_objdump_rets(binary, goelf.READ_SYMBOL)


def test_go_binary_without_tls(build: Callable[..., Path], go_version: str) -> None:
    binary = build("plain", PLAIN_SRC)
    assert not any(n.startswith("crypto/tls.") for n in _nm(binary))   # the premise
    info = goelf.analyze(str(binary))
    assert info is not None
    assert info.why_not == goelf.NO_TLS
    assert info.go_version == go_version and info.stripped is False
    assert info.read_offset is None and info.offsets is None


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SHADOWTEST_GO_CROSS"),
                    reason="cross-building Go's standard library takes ~45 s: set SHADOWTEST_GO_CROSS=1 to run it")
def test_other_arch_binary(build: Callable[..., Path], host_goarch: str, layout: dict[str, Any]) -> None:
    """The same program cross-built for the other architecture (aarch64 RET on an x86_64 host)."""
    goarch = OTHER_GOARCH[host_goarch]
    binary = build(f"https_{goarch}", HTTPS_SRC, goarch=goarch)
    info = goelf.analyze(str(binary))
    assert info is not None and info.why_not is None, info
    assert info.arch == ELF_ARCH[goarch] and info.register_abi is True
    syms = _nm(binary)
    assert info.read_vaddr == syms[goelf.READ_SYMBOL][0]
    assert info.write_offset == _pt_load_offset(binary, syms[goelf.WRITE_SYMBOL][0])
    rets = _go_objdump_rets(binary, goelf.READ_SYMBOL)
    assert len(rets) >= 2 and list(info.read_ret_vaddrs) == rets
    assert list(info.read_ret_offsets) == [_pt_load_offset(binary, a) for a in rets]
    assert info.offsets_source == "dwarf" and info.offsets == _expected_layout(layout)   # both 64-bit


# --- not Go, or not an ELF that can be read ---------------------------------------------------------------

def test_non_go_elf_is_none() -> None:
    true = shutil.which("true") or "/bin/true"
    assert goelf.analyze(os.path.realpath(true)) is None


def _one_line_error(path: Path) -> str:
    with pytest.raises(GoElfError) as exc:
        goelf.analyze(str(path))
    msg = str(exc.value)
    assert msg and "\n" not in msg and str(path) in msg
    return msg


def test_truncated_copies_raise_one_line(https_bin: Path, tmp_path: Path) -> None:
    data = https_bin.read_bytes()
    for cut in (0, 10, 63, 1000, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}"
        path.write_bytes(data[:cut])
        msg = _one_line_error(path)
        if cut >= 1000:   # the headers are intact: a section past the end is what is reported
            assert "runs past the end of the file" in msg


def test_random_bytes_raise_one_line(tmp_path: Path) -> None:
    rng = random.Random(24)
    noise = tmp_path / "noise"
    noise.write_bytes(rng.randbytes(1 << 16))
    assert "not an ELF file" in _one_line_error(noise)
    elfish = tmp_path / "elfish"   # a valid ELF identification, then noise
    elfish.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(9) + rng.randbytes(1 << 16))
    _one_line_error(elfish)
    _one_line_error(tmp_path / "missing")


def _sections(binary: Path) -> dict[str, tuple[int, int, int]]:
    """name -> (index, sh_offset, header offset) through pyelftools."""
    from elftools.elf.elffile import ELFFile

    with open(binary, "rb") as f:
        elf = ELFFile(f)
        shoff, shentsize = elf["e_shoff"], elf["e_shentsize"]
        return {s.name: (i, s["sh_offset"], shoff + i * shentsize) for i, s in enumerate(elf.iter_sections())}


def _patched(binary: Path, tmp_path: Path, name: str, at: int, value: bytes) -> Path:
    data = bytearray(binary.read_bytes())
    data[at:at + len(value)] = value
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


def test_absurd_sizes_are_bounded(https_bin: Path, tmp_path: Path, go_version: str) -> None:
    secs = _sections(https_bin)
    # a section header claiming 2**60 bytes (Elf64_Shdr.sh_size is at +32)
    _, _, hdr = secs[".gopclntab"]
    huge_section = _patched(https_bin, tmp_path, "huge_section", hdr + 32, struct.pack("<Q", 1 << 60))
    assert "runs past the end of the file" in _one_line_error(huge_section)

    # crypto/tls.(*Conn).Read's symbol claiming 1 TiB: never read, never disassembled
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    with open(https_bin, "rb") as f:
        symtab = ELFFile(f).get_section_by_name(".symtab")
        assert isinstance(symtab, SymbolTableSection)
        index = next(i for i, s in enumerate(symtab.iter_symbols()) if s.name == goelf.READ_SYMBOL)
        sym_at = symtab["sh_offset"] + index * symtab["sh_entsize"]
    huge_func = _patched(https_bin, tmp_path, "huge_func", sym_at + 16, struct.pack("<Q", 1 << 40))
    assert "claims" in _one_line_error(huge_func)

    # compressed .debug_info claiming 1 TiB once inflated (Elf64_Chdr.ch_size at +8): DWARF is not read,
    # the table answers (a zlib bomb costs nothing)
    _, info_off, _ = secs[".debug_info"]
    bomb = _patched(https_bin, tmp_path, "dwarf_bomb", info_off + 8, struct.pack("<Q", 1 << 40))
    info = goelf.analyze(str(bomb))
    assert info is not None and info.has_dwarf is True
    minor = goelf.go_minor(go_version)
    assert minor is not None
    if (1, minor) in goelf.KNOWN_OFFSETS:
        assert info.why_not is None and info.offsets_source == f"table:go1.{minor}"


def _zlib_bomb(inflated: int) -> bytes:
    c = zlib.compressobj(9)
    chunk = bytes(1 << 20)
    return b"".join([c.compress(chunk) for _ in range(inflated >> 20)] + [c.flush()])


def test_dwarf_zlib_bomb_is_bounded(https_bin: Path, tmp_path: Path, go_version: str) -> None:
    """.debug_info replaced by 300 MiB of zeros deflated to a few hundred KiB: never inflated in full."""
    _, info_off, hdr = _sections(https_bin)[".debug_info"]
    sh_size = struct.unpack_from("<Q", https_bin.read_bytes(), hdr + 32)[0]
    bomb = _zlib_bomb(300 << 20)
    assert 24 + len(bomb) <= sh_size
    minor = goelf.go_minor(go_version)
    assert minor is not None
    # declared as it inflates (300 MiB: over the cap, not read), then as 1 MiB (inflation stops there)
    for declared in (300 << 20, 1 << 20):
        chdr = struct.pack("<IIQQ", 1, 0, declared, 1)
        path = _patched(https_bin, tmp_path, f"bomb{declared}", info_off, chdr + bomb)
        tracemalloc.start()
        try:
            info = goelf.analyze(str(path))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, f"analyze() allocated {peak >> 20} MiB"
        assert info is not None and info.has_dwarf is True
        if (1, minor) in goelf.KNOWN_OFFSETS:
            assert info.why_not is None and info.offsets_source == f"table:go1.{minor}"


def _with_version(binary: Path, tmp_path: Path, name: str, version: str) -> Path:
    """A copy whose .go.buildinfo (1.18+ inline format) records `version` (same length as the real one)."""
    _, off, _ = _sections(binary)[".go.buildinfo"]
    head = binary.read_bytes()[off:off + 64]
    assert head[:14] == b"\xff Go buildinf:" and head[15] & 2
    n = head[32]
    assert len(version) == n, (version, head[33:33 + n])
    return _patched(binary, tmp_path, name, off + 33, version.encode())


def test_version_gates(https_bin: Path, build: Callable[..., Path], tmp_path: Path) -> None:
    """Real binaries whose recorded version is rewritten: the version decides, nothing is guessed."""
    old = goelf.analyze(str(_with_version(https_bin, tmp_path, "old", "go1.16.5")))
    assert old is not None and old.go_version == "go1.16.5"
    assert old.register_abi is False and old.why_not is not None and "stack ABI" in old.why_not
    assert old.read_offset is None
    unknown = goelf.analyze(str(_with_version(https_bin, tmp_path, "unknown", "devel +x")))
    assert unknown is not None and unknown.why_not is not None and "version unknown" in unknown.why_not
    # a future version without DWARF: its struct layout is not assumed
    nodwarf = build("https_nodwarf", HTTPS_SRC, "-ldflags=-w")
    future = goelf.analyze(str(_with_version(nodwarf, tmp_path, "future", "go1.99.0")))
    assert future is not None and future.why_not is not None
    assert future.why_not.startswith("struct offsets unknown") and future.offsets is None
    # ... while with DWARF the binary itself says
    future_dwarf = goelf.analyze(str(_with_version(https_bin, tmp_path, "future_dwarf", "go1.99.0")))
    assert future_dwarf is not None and future_dwarf.why_not is None and future_dwarf.offsets_source == "dwarf"


def test_pre_118_buildinfo_and_symbol_fallback(https_bin: Path, tmp_path: Path, go_version: str) -> None:
    """The pre-1.18 .go.buildinfo (a pointer to runtime.buildVersion), and no .go.buildinfo at all."""
    _, off, _ = _sections(https_bin)[".go.buildinfo"]
    build_version = _nm(https_bin)["runtime.buildVersion"][0]   # a Go string header in .data
    # flags 0 (pointers, little-endian), then the pointer to runtime.buildVersion and one to modinfo
    old_format = struct.pack("<BB", 8, 0) + struct.pack("<QQ", build_version, build_version)
    n = https_bin.read_bytes()[off + 32]
    old_format += bytes(1 + n)   # and no inline version left to find
    info = goelf.analyze(str(_patched(https_bin, tmp_path, "pre118", off + 14, old_format)))
    assert info is not None and info.go_version == go_version and info.why_not is None
    no_magic = goelf.analyze(str(_patched(https_bin, tmp_path, "nomagic", off, b"\0" * 16)))
    assert no_magic is not None and no_magic.go_version == go_version and no_magic.why_not is None


def test_damaged_headers_never_crash(https_bin: Path, tmp_path: Path) -> None:
    """Random damage to the ELF, program and section headers: a result or a GoElfError, never another error."""
    rng = random.Random(2024)
    data = https_bin.read_bytes()
    _, _, first_hdr = _sections(https_bin)[""]
    region = max(first_hdr + 64 * 40, 0x400)
    path = tmp_path / "damaged"
    outcomes = {"result": 0, "error": 0}
    deadline = time.monotonic() + 60
    for _ in range(40):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(16, region)
            damaged[at:at + 8] = rng.randbytes(8) if rng.random() < 0.5 else b"\xff" * 8
        path.write_bytes(bytes(damaged))
        try:
            goelf.analyze(str(path))
            outcomes["result"] += 1
        except GoElfError as exc:
            assert "\n" not in str(exc)
            outcomes["error"] += 1
        assert time.monotonic() < deadline, "a damaged file took too long"
    assert outcomes["error"] > 0, outcomes


def test_a_running_go_process_is_named_with_what_its_binary_holds(https_bin: Path, build: Callable[..., Path],
                                                                   go_version: str) -> None:
    """What `record --list-tls` and a flow's reason say of a Go process: its version and the analysis,
    and for a stripped build the reason it cannot be read."""
    from capture.ebpf.tlslibs import Inspector

    stripped = build("https_stripped_running", HTTPS_SRC, "-ldflags=-s -w")
    verdicts = {}
    for name, binary in (("full", https_bin), ("stripped", stripped)):
        proc = spawn([str(binary), "stay"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().startswith("hello over go tls")
            verdicts[name] = Inspector().process(proc.pid)
        finally:
            proc.kill()
            proc.wait(10)
    full = verdicts["full"]
    assert [f.kind for f in full.files] == ["go"] and full.files[0].readable
    assert full.verdict() == f"read: go {https_bin} ({go_version})", full.verdict()
    assert full.files[0].go is not None and full.files[0].go.offsets_source == "dwarf"
    detail = cast(list[dict[str, Any]], full.as_dict()["files"])[0]["detail"]
    assert "return instructions" in detail and "(dwarf)" in detail
    assert verdicts["stripped"].verdict() == f"not read: Go binary {stripped} ({go_version}): {goelf.STRIPPED}"
