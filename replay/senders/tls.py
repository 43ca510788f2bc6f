"""TLS for every sender: one picklable config, the `ssl.SSLContext` (or grpcio credentials) built from it,
and TLS failures in one line.

    TlsConfig(ca=..., cert=..., key=..., insecure=False, server_name=None)
      .check()                -> raises TlsConfigError (one line) for a missing/unreadable/bad file
      .context(alpn=("h2",))  -> ssl.SSLContext: the system CAs or `ca`, the client certificate for mTLS
      .grpc_credentials()     -> grpc.ChannelCredentials (+ .grpc_options(): the name verified)

A TLS failure met while connecting becomes a call's detail through `describe` ("TLS: certificate verify
failed for NAME: ..."), so it is counted as a call error with its reason, never a traceback.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.errors import SenderError

_MAX_PEM = 1 << 20  # a CA bundle, certificate or key file: a few KiB; the system bundle ~200 KiB


class TlsConfigError(SenderError):
    """A TLS option cannot be used: a file missing, unreadable, not PEM, or a key that does not fit."""


@dataclass(frozen=True)
class TlsConfig:
    """How a sender speaks TLS to the target.

    ca: PEM file of the CAs to trust (default: the system CAs). cert/key: the client certificate and
    its key (mTLS; key defaults to cert when the PEM holds both). insecure: skip verification (no CA
    check, no name check). server_name: the name sent as SNI and verified (default: the target's host).
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    insecure: bool = False
    server_name: str | None = None

    @classmethod
    def from_options(cls, tls: bool = False, ca: str | None = None, cert: str | None = None, key: str | None = None,
                     insecure: bool = False, server_name: str | None = None, sender: str = "auto") -> TlsConfig | None:
        """The config of the command-line TLS options (any of them turns TLS on), checked; None without them.

        Raises TlsConfigError (one line) for a bad file, name or combination."""
        if not (tls or ca or cert or key or insecure or server_name):
            return None
        if server_name is not None and (not server_name or len(server_name) > 253
                                        or any(c.isspace() for c in server_name)):
            raise TlsConfigError(f"--server-name {server_name!r}: not a host name")
        if insecure and ca:
            raise TlsConfigError("--insecure skips verification: --ca would not be used; give one of them")
        if insecure and sender == "grpc":
            raise TlsConfigError("--insecure is not possible with --sender grpc (grpcio always verifies); "
                                 "use --sender h2 or give the CA with --ca")
        config = cls(ca=ca, cert=cert, key=key, insecure=insecure, server_name=server_name)
        config.check()
        return config

    def name_for(self, host: str) -> str:
        return self.server_name or host

    def check(self) -> None:
        """Build a context once, so a bad file is a one-line error before anything is sent."""
        if self.key and not self.cert:
            raise TlsConfigError("--key needs --cert (the client certificate it belongs to)")
        for label, path in (("--ca", self.ca), ("--cert", self.cert), ("--key", self.key)):
            if path is not None:
                _read(label, path)
        self.context()

    def context(self, alpn: tuple[str, ...] = ()) -> ssl.SSLContext:
        """The client context: TLS 1.2+, the CAs (system or --ca), the client certificate, ALPN."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the name by default
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            if self.ca:  # only these CAs, not the system's as well
                ctx.load_verify_locations(cadata=_read("--ca", self.ca).decode("ascii", "replace"))
            else:
                ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key or None)
        except ssl.SSLError as exc:
            raise TlsConfigError(f"TLS files: {_ssl_reason(exc)} (--ca {self.ca}, --cert {self.cert}, "
                                 f"--key {self.key or self.cert})") from exc
        except OSError as exc:
            raise TlsConfigError(f"TLS files: {exc.strerror or exc}") from exc
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if alpn:
            ctx.set_alpn_protocols(list(alpn))
        return ctx

    def grpc_credentials(self) -> Any:
        """grpcio's channel credentials (grpcio cannot skip verification: `insecure` is refused)."""
        import grpc

        if self.insecure:
            raise TlsConfigError("--insecure is not possible with --sender grpc (grpcio always verifies); "
                                 "use --sender h2 or give the CA with --ca")
        root = _read("--ca", self.ca) if self.ca else None
        chain = _read("--cert", self.cert) if self.cert else None
        key = _read("--key", self.key or self.cert) if self.cert else None
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)

    def grpc_options(self) -> list[tuple[str, Any]]:
        """The name verified (and sent as SNI) when --server-name is given."""
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name), ("grpc.default_authority", self.server_name)]


def _read(label: str, path: str) -> bytes:
    p = Path(path)
    try:
        if not p.is_file():
            raise TlsConfigError(f"{label} {path}: no such file")
        if p.stat().st_size > _MAX_PEM:
            raise TlsConfigError(f"{label} {path}: larger than {_MAX_PEM} bytes, not a PEM file")
        data = p.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{label} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{label} {path}: not a PEM file (no -----BEGIN line)")
    return data


_NOISE = re.compile(r"\[SSL(: [A-Z0-9_]+)?\]|\(_ssl\.c:\d+\)")


def _ssl_reason(exc: ssl.SSLError) -> str:
    reason = getattr(exc, "verify_message", None) or exc.reason or _NOISE.sub("", str(exc))
    return " ".join(str(reason).replace("_", " ").lower().split()) or type(exc).__name__


def describe(exc: BaseException, name: str, alpn: str = "") -> str:
    """A TLS failure met while connecting, in one line that says what failed and for which name."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: certificate verify failed for {name}: {exc.verify_message or _ssl_reason(exc)}"
    if isinstance(exc, ssl.SSLError):
        reason = _ssl_reason(exc)
        if alpn and "no application protocol" in reason:
            return f"TLS: {name} did not negotiate ALPN {alpn} (it answered: {reason})"
        return f"TLS: handshake failure with {name}: {reason}"
    return f"TLS: {' '.join(str(exc).split()) or type(exc).__name__}"


def is_tls_error(exc: BaseException) -> bool:
    return isinstance(exc, ssl.SSLError)


ALPN_NOT_H2 = "TLS: {name} did not negotiate ALPN h2 (it chose {got}): it does not speak HTTP/2 on this port"
