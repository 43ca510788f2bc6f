"""Parse link, IP and TCP headers straight from bytes (no per-packet scapy dissection: too slow).

Link types: Ethernet (1, with VLAN tags), BSD loopback (0, 108), raw IP (101, 228, 229),
Linux cooked SLL (113) and SLL2 (276). IPv4 and IPv6 (no extension headers but hop-by-hop skipping).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

FIN, SYN, RST, ACK = 0x01, 0x02, 0x04, 0x10


@dataclass(frozen=True)
class Segment:
    src: tuple[str, int]
    dst: tuple[str, int]
    seq: int
    ack: int
    flags: int
    payload: bytes


_U16 = struct.Struct(">H").unpack_from
_IPV4 = struct.Struct(">BxH5xB").unpack_from          # version/IHL, total length, protocol
_TCP = struct.Struct(">HHIIBB").unpack_from           # ports, seq, ack, data offset, flags
_VLAN = (0x8100, 0x88A8)
_RAW_IP = frozenset((101, 228, 229, 12, 14))          # raw IP link types: the version nibble says which
_EXT6 = (0, 43, 60)                                   # hop-by-hop, routing, destination options
_ADDRS: dict[bytes, tuple[str, str]] = {}             # raw source+destination address -> their text
_ADDRS_MAX = 4096                                     # cleared when full (a scan: many addresses)
_new = object.__new__


def _ip_offset(linktype: int, pkt: bytes) -> tuple[int, int] | None:
    """(offset of the IP header, IP version) or None for non-IP frames."""
    if linktype == 1:
        off, etype = 14, _U16(pkt, 12)[0]
        while etype in _VLAN and len(pkt) >= off + 4:
            etype = _U16(pkt, off + 2)[0]
            off += 4
        return (off, 4) if etype == 0x0800 else (off, 6) if etype == 0x86DD else None
    if linktype in (0, 108):
        return (4, (pkt[4] >> 4)) if len(pkt) > 4 else None
    if linktype in _RAW_IP:
        return (0, pkt[0] >> 4) if pkt else None
    if linktype == 113:
        etype = _U16(pkt, 14)[0]
        return (16, 4) if etype == 0x0800 else (16, 6) if etype == 0x86DD else None
    if linktype == 276:
        etype = _U16(pkt, 0)[0]
        return (20, 4) if etype == 0x0800 else (20, 6) if etype == 0x86DD else None
    return None


def parse(linktype: int, pkt: bytes) -> Segment | None:
    """The TCP segment in one captured frame, or None (not TCP, or cut short by the snap length).

    Per packet: a few precompiled struct reads, the addresses' text from a cache, one copy (the
    payload), and the Segment's fields set directly (a frozen dataclass's __init__ costs more than
    the rest of the parse)."""
    try:
        if linktype == 1 and _U16(pkt, 12)[0] == 0x0800:      # untagged Ethernet, IPv4: the usual
            off, version = 14, 4
        elif linktype in _RAW_IP:
            off, version = 0, pkt[0] >> 4
        else:
            where = _ip_offset(linktype, pkt)
            if where is None:
                return None
            off, version = where
        if version == 4:
            vihl, total, proto = _IPV4(pkt, off)
            if proto != 6:
                return None
            raw = pkt[off + 12:off + 20]
            ips = _ADDRS.get(raw)
            if ips is None:
                if len(raw) != 8:
                    return None
                ips = _remember(raw, socket.inet_ntoa(raw[:4]), socket.inet_ntoa(raw[4:]))
            tcp, end = off + (vihl & 0x0F) * 4, off + (total or len(pkt) - off)
        elif version == 6:
            nxt, tcp = pkt[off + 6], off + 40
            end = tcp + _U16(pkt, off + 4)[0]
            while nxt in _EXT6:
                nxt, tcp = pkt[tcp], tcp + 8 + pkt[tcp + 1] * 8
            if nxt != 6:
                return None
            raw = pkt[off + 8:off + 40]
            ips = _ADDRS.get(raw)
            if ips is None:
                if len(raw) != 32:
                    return None
                ips = _remember(raw, _v6(raw[:16]), _v6(raw[16:]))
        else:
            return None
        sport, dport, seq, ack, data_off, flags = _TCP(pkt, tcp)
        n = len(pkt)
        seg = _new(Segment)
        d = seg.__dict__                      # what Segment(...) would set, field by field
        d["src"] = (ips[0], sport)
        d["dst"] = (ips[1], dport)
        d["seq"] = seq
        d["ack"] = ack
        d["flags"] = flags
        d["payload"] = pkt[tcp + (data_off >> 4) * 4:end if end < n else n]
        return seg
    except (IndexError, struct.error, ValueError):
        return None      # truncated frame: counted by the caller as unparsable


def _remember(raw: bytes, src: str, dst: str) -> tuple[str, str]:
    if len(_ADDRS) >= _ADDRS_MAX:
        _ADDRS.clear()
    ips = _ADDRS[raw] = (src, dst)
    return ips


def _v6(raw: bytes) -> str:
    ip = ipaddress.IPv6Address(raw)
    return str(ip.ipv4_mapped or ip)
