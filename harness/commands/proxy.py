"""`shadowtest proxy serve`: the Toxiproxy-compatible proxy and its HTTP API."""

from __future__ import annotations

import json
import sys

import click

from harness.outputs import stamped


@click.group("proxy")
def command() -> None:
    """The Toxiproxy-compatible fault proxy (Toxiproxy 2.x HTTP API, plus gRPC call toxics).

    \b
    Examples:
      shadowtest proxy serve                               API on 127.0.0.1:8474
      shadowtest proxy serve --port 0 --seed 7             any free port, reproducible jitter
      shadowtest proxy serve --config proxies.json         create proxies at start (like toxiproxy -config)
    """


@command.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="API listen address")
@click.option("--port", default=8474, show_default=True, type=int, help="API port (0: any free port)")
@click.option("--seed", default=0, show_default=True, type=int, help="seed for jitter, toxicity and call shares")
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False),
              help="JSON list of proxies to create at start (Toxiproxy's /populate format)")
@click.option("--json", "as_json", is_flag=True, help="announce the listening address as one JSON line")
def serve(host: str, port: int, seed: int, config: str | None, as_json: bool) -> None:
    """Serve the proxy API until Ctrl-C or SIGTERM; every proxy and toxic goes away with it.

    \b
    Examples:
      shadowtest proxy serve --port 8474 &
      curl -s -XPOST localhost:8474/proxies -d '{"name":"agent","listen":"127.0.0.1:26379","upstream":"127.0.0.1:50051"}'
      curl -s -XPOST localhost:8474/proxies/agent/toxics -d '{"type":"latency","attributes":{"latency":50}}'
      curl -s -XPOST localhost:8474/proxies/agent/toxics -d '{"type":"grpc_error","attributes":{"share":0.1,"status":14}}'
    """
    import asyncio
    import signal

    from faults.errors import ProxyUnavailableError
    from faults.proxy.server import start_api

    body = None
    if config:
        try:
            with open(config) as f:
                body = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise click.BadParameter(f"cannot read {config}: {exc}", param_hint="--config") from exc

    async def run() -> None:
        try:
            server, collection = await start_api(host, port, seed)
        except OSError as exc:
            raise ProxyUnavailableError(f"cannot listen on {host}:{port}: {exc} (use --port 0 or stop "
                                        "what holds the port)") from exc
        if body is not None:
            await collection.populate(body)
        bound = server.sockets[0].getsockname()
        url = f"http://{bound[0]}:{bound[1]}"
        click.echo(json.dumps(stamped("proxy", {"listening": url, "seed": seed})) if as_json else f"listening {url} (seed {seed})")
        sys.stdout.flush()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()
        await collection.close()

    asyncio.run(run())
