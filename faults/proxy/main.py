"""`python -m faults.proxy.main --host 127.0.0.1 --port 8474`: serve the API until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal

from faults.proxy.server import start_api


async def serve(host: str, port: int, seed: int, announce: bool = True) -> None:
    """Serve until a termination signal; then close every proxy and connection."""
    server, collection = await start_api(host, port, seed)
    bound = server.sockets[0].getsockname()
    if announce:
        print(f"listening http://{bound[0]}:{bound[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    await collection.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8474)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    asyncio.run(serve(args.host, args.port, args.seed))


if __name__ == "__main__":
    main()
