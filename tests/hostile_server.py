"""A LeanServer with a raw-bytes test service, in its own process, for the hostile-client tests.

    python tests/hostile_server.py [--max-receive-message-length N] [--handshake-timeout-s 1] ...

Binds 127.0.0.1 port 0, prints the port as one line on stdout, logs to stderr (asyncio's
"Exception in callback" and "Fatal error" reports, tracebacks included, land there). Only the
options given on the command line are passed to LeanServer, so the script works with server versions
that lack some of them (an option the server lacks: exit status 2 and one log line). It exits on
SIGTERM/SIGINT, when stdin (a pipe or tty) reaches EOF (the test process went away) or after
--max-lifetime-s.

The service (`test.Bytes`), all handlers taking and returning bytes:
    Echo        unary: the request back; trailer `seen-blob-repr` = repr() of the `x-blob-bin` value the
                handler saw in invocation_metadata (when the call carried one)
    Len         unary: the request's length as decimal text (a gzip bomb that got through costs no reply)
    BinHeaders  unary: sends initial metadata `init-blob-bin: b'\\x00\\xff'`, answers b"ok"
    Count       client streaming: reads every message, answers "<messages> <bytes>"
    Hold        client streaming: never reads a message; sleeps until cancelled
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent_under_test.h2server import LeanServer  # noqa: E402

SERVICE = "test.Bytes"
BLOB = b"\x00\xff"
log = logging.getLogger("hostile_server")

# flag -> (LeanServer keyword, type)
OPTIONS: dict[str, tuple[str, type]] = {
    "--max-receive-message-length": ("max_receive_message_length", int),
    "--header-table-size": ("header_table_size", int),
    "--max-connection-age-s": ("max_connection_age_s", float),
    "--grace-s": ("grace_s", float),
    "--handshake-timeout-s": ("handshake_timeout_s", float),
    "--idle-timeout-s": ("idle_timeout_s", float),
    "--max-header-list-size": ("max_header_list_size", int),
}


async def echo(request: bytes, ctx: Any) -> bytes:
    seen = dict(ctx.invocation_metadata())
    if "x-blob-bin" in seen:
        ctx.set_trailing_metadata((("seen-blob-repr", repr(seen["x-blob-bin"])),))
    return request


async def length(request: bytes, ctx: Any) -> bytes:
    return str(len(request)).encode()


async def bin_headers(request: bytes, ctx: Any) -> bytes:
    await ctx.send_initial_metadata((("init-blob-bin", BLOB),))
    return b"ok"


async def count(requests: AsyncIterator[bytes], ctx: Any) -> bytes:
    n = total = 0
    async for r in requests:
        n, total = n + 1, total + len(r)
    return f"{n} {total}".encode()


async def hold(requests: AsyncIterator[bytes], ctx: Any) -> bytes:
    await asyncio.sleep(3600)  # never reads: whatever the client pushes must be held back by flow control
    return b"held"


def register(server: LeanServer) -> None:
    server.add_registered_method_handlers(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Len": grpc.unary_unary_rpc_method_handler(length),
        "BinHeaders": grpc.unary_unary_rpc_method_handler(bin_headers),
        "Count": grpc.stream_unary_rpc_method_handler(count),
        "Hold": grpc.stream_unary_rpc_method_handler(hold),
    })


def parse(argv: list[str] | None = None) -> tuple[dict[str, Any], float]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, (dest, kind) in OPTIONS.items():
        parser.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS,
                            help=f"LeanServer({dest}=...); not passed unless given")
    parser.add_argument("--max-lifetime-s", type=float, default=600.0,
                        help="exit after this long whatever happens (a safety bound for tests)")
    args = vars(parser.parse_args(argv))
    lifetime = args.pop("max_lifetime_s")
    return args, lifetime


async def serve(options: dict[str, Any], lifetime: float) -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)

    def stdin_readable() -> None:  # the test process closed our stdin or died: leave
        try:
            if os.read(0, 4096):
                return
        except OSError:
            pass
        loop.remove_reader(0)
        done.set()

    try:
        loop.add_reader(0, stdin_readable)
    except (OSError, ValueError):  # stdin is a file or /dev/null: only signals and the lifetime stop us
        pass
    try:
        server = LeanServer(**options)
    except TypeError as exc:  # an option this version of the server does not have
        log.error("LeanServer does not accept these options: %s", exc)
        raise SystemExit(2) from None
    register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    log.info("serving on 127.0.0.1:%d with %s", port, options)
    print(port, flush=True)
    try:
        await asyncio.wait_for(done.wait(), lifetime)
    except TimeoutError:
        log.warning("max lifetime of %.0f s reached", lifetime)
    await server.stop(None)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    options, lifetime = parse(argv)
    asyncio.run(serve(options, lifetime))
    return 0


if __name__ == "__main__":
    sys.exit(main())
