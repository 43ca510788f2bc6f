"""Parse link, IP and TCP headers straight from bytes (no per-packet scapy dissection: too slow).

Link types: Ethernet (1, with VLAN tags), BSD loopback (0, 108), raw IP (101, 228, 229),
Linux cooked SLL (113) and SLL2 (276). IPv4 and IPv6 (no extension headers but hop-by-hop skipping).
"""

from __future__ import annotations

import ipaddress
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


def _ip_offset(linktype: int, pkt: bytes) -> tuple[int, int] | None:
    """(offset of the IP header, IP version) or None for non-IP frames."""
    if linktype == 1:
        off, etype = 14, struct.unpack_from(">H", pkt, 12)[0]
        while etype in (0x8100, 0x88A8) and len(pkt) >= off + 4:
            etype = struct.unpack_from(">H", pkt, off + 2)[0]
            off += 4
        return (off, 4) if etype == 0x0800 else (off, 6) if etype == 0x86DD else None
    if linktype in (0, 108):
        return (4, (pkt[4] >> 4)) if len(pkt) > 4 else None
    if linktype in (101, 228, 229, 12, 14):
        return (0, pkt[0] >> 4) if pkt else None
    if linktype == 113:
        etype = struct.unpack_from(">H", pkt, 14)[0]
        return (16, 4) if etype == 0x0800 else (16, 6) if etype == 0x86DD else None
    if linktype == 276:
        etype = struct.unpack_from(">H", pkt, 0)[0]
        return (20, 4) if etype == 0x0800 else (20, 6) if etype == 0x86DD else None
    return None


def parse(linktype: int, pkt: bytes) -> Segment | None:
    """The TCP segment in one captured frame, or None (not TCP, or cut short by the snap length)."""
    try:
        where = _ip_offset(linktype, pkt)
        if where is None:
            return None
        off, version = where
        if version == 4:
            ihl = (pkt[off] & 0x0F) * 4
            if pkt[off + 9] != 6:
                return None
            total = struct.unpack_from(">H", pkt, off + 2)[0]
            src_ip = str(ipaddress.IPv4Address(pkt[off + 12:off + 16]))
            dst_ip = str(ipaddress.IPv4Address(pkt[off + 16:off + 20]))
            tcp, end = off + ihl, off + (total or len(pkt) - off)
        elif version == 6:
            nxt, tcp = pkt[off + 6], off + 40
            end = tcp + struct.unpack_from(">H", pkt, off + 4)[0]
            while nxt in (0, 43, 60):                      # hop-by-hop, routing, destination options
                nxt, tcp = pkt[tcp], tcp + 8 + pkt[tcp + 1] * 8
            if nxt != 6:
                return None
            src_ip = _v6(pkt[off + 8:off + 24])
            dst_ip = _v6(pkt[off + 24:off + 40])
        else:
            return None
        sport, dport, seq, ack, data_off, flags = struct.unpack_from(">HHIIBB", pkt, tcp)
        payload = pkt[tcp + (data_off >> 4) * 4:min(end, len(pkt))]
        return Segment((src_ip, sport), (dst_ip, dport), seq, ack, flags, payload)
    except (IndexError, struct.error, ValueError):
        return None      # truncated frame: counted by the caller as unparsable


def _v6(raw: bytes) -> str:
    ip = ipaddress.IPv6Address(raw)
    return str(ip.ipv4_mapped or ip)
