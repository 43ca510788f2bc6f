"""Running the proxy: in-process on its own thread and loop, or as a subprocess.

    with EmbeddedToxiproxy(seed=7) as tp:                    # API on 127.0.0.1:<port 0>
        p = tp.create_proxy("agent", upstream="127.0.0.1:50051")   # p["listen"] is 127.0.0.1:<port>
        applied = tp.add_toxic("agent", "latency", {"latency": 50, "jitter": 10})
        ...                                                  # applied.applied_at: time.monotonic() when live
        tp.remove_toxic("agent", applied.name)

The same server answers Toxiproxy's HTTP API at `tp.url`, so `toxiproxy-python` (or any Toxiproxy
client) can drive it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from faults.errors import ProxyApiError, ProxyUnavailableError
from faults.proxy.api import serve_connection
from faults.proxy.collection import ProxyCollection
from faults.proxy.model import ApiError
from faults.state import FaultRegistry, default_registry
from wire.process import end_child, spawn

T = TypeVar("T")


@dataclass(frozen=True)
class ToxicApplied:
    """A toxic change that has taken effect on every live connection at `applied_at` (time.monotonic())."""

    proxy: str
    name: str
    toxic: dict[str, Any] | None
    applied_at: float


async def start_api(host: str, port: int, seed: int) -> tuple[asyncio.Server, ProxyCollection]:
    """Start the HTTP API on the running loop; returns the server and its proxy collection."""
    collection = ProxyCollection(seed)

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve_connection(collection, reader, writer)
        except asyncio.CancelledError:
            # Shutting down. Ending normally (not "cancelled") keeps 3.11's stream callback quiet.
            writer.close()

    server = await asyncio.start_server(on_client, host, port, reuse_address=True)
    return server, collection


def _stamped(fn: Callable[[ProxyCollection], Awaitable[T]]
             ) -> Callable[[ProxyCollection], Coroutine[Any, Any, tuple[T, float]]]:
    """Run `fn` and read `applied_at` in the same loop step, so a concurrent change cannot slip between."""

    async def run(c: ProxyCollection) -> tuple[T, float]:
        result = await fn(c)
        return result, c.applied_at

    return run


class EmbeddedToxiproxy:
    """The proxy and its API in this process, on a daemon thread with its own event loop."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, seed: int = 0) -> None:
        self.host, self.port, self.seed = host, port, seed
        self.loop: asyncio.AbstractEventLoop | None = None
        self.collection: ProxyCollection | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EmbeddedToxiproxy:
        """Start the loop thread and the API; raises ProxyUnavailableError when the port is taken."""
        ready: threading.Event = threading.Event()
        failure: list[BaseException] = []
        self.loop = asyncio.new_event_loop()

        async def boot() -> None:
            try:
                self._server, self.collection = await start_api(self.host, self.port, self.seed)
                self.port = self._server.sockets[0].getsockname()[1]
            except OSError as exc:
                failure.append(exc)
            ready.set()

        def run() -> None:
            assert self.loop is not None
            asyncio.set_event_loop(self.loop)
            self.loop.create_task(boot())
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="shadowtest-proxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            self.stop()
            raise ProxyUnavailableError(f"cannot listen on {self.host}:{self.port}: {failure[0]} "
                                        "(pick another --port or stop what holds it)") from failure[0]
        return self

    def stop(self) -> None:
        """Close every proxy, connection and the API; idempotent."""
        loop, self.loop = self.loop, None
        if loop is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            if self.collection is not None:
                await self.collection.close()
            # API handlers and link tasks: end them here so none is destroyed pending with the loop
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        if loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        loop.close()

    def __enter__(self) -> EmbeddedToxiproxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, fn: Callable[[ProxyCollection], Coroutine[Any, Any, T]], timeout: float = 30) -> T:
        """Run `fn(collection)` on the proxy's loop; API errors become ProxyApiError."""
        if self.loop is None or self.collection is None:
            raise ProxyUnavailableError("the embedded proxy is not running (call start() first)")
        collection = self.collection
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(
            fn(collection), self.loop)
        try:
            return future.result(timeout)
        except ApiError as exc:
            raise ProxyApiError(exc.message, exc.status) from exc

    async def acall(self, fn: Callable[[ProxyCollection], Coroutine[Any, Any, T]], timeout: float = 30) -> T:
        """`call` for asyncio callers: awaits without blocking the caller's own event loop."""
        if self.loop is None or self.collection is None:
            raise ProxyUnavailableError("the embedded proxy is not running (call start() first)")
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(
            fn(self.collection), self.loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except ApiError as exc:
            raise ProxyApiError(exc.message, exc.status) from exc

    # --- the Python API (same semantics as the HTTP API) ------------------------------------
    def create_proxy(self, name: str, upstream: str, listen: str = "127.0.0.1:0",
                     enabled: bool = True) -> dict[str, Any]:
        body = {"name": name, "upstream": upstream, "listen": listen, "enabled": enabled}

        async def run(c: ProxyCollection) -> dict[str, Any]:
            return (await c.create(body)).to_json()

        return self.call(run)

    def delete_proxy(self, name: str) -> None:
        self.call(lambda c: c.delete(name))

    def proxies(self) -> dict[str, dict[str, Any]]:
        async def run(c: ProxyCollection) -> dict[str, dict[str, Any]]:
            return {n: p.to_json() for n, p in c.proxies.items()}

        return self.call(run)

    def set_enabled(self, name: str, enabled: bool) -> float:
        """Enable or disable a proxy (disable closes its connections); returns when it took effect."""
        return self.call(_stamped(lambda c: c.update(name, {"enabled": enabled})))[1]

    def add_toxic(self, proxy: str, type: str, attributes: dict[str, Any] | None = None,
                  stream: str = "downstream", toxicity: float = 1.0, name: str | None = None) -> ToxicApplied:
        """Add a toxic; returns once every live connection runs it (`applied_at`)."""
        body = {"type": type, "stream": stream, "toxicity": toxicity, "attributes": attributes or {},
                "name": name or f"{type}_{stream}"}
        toxic, at = self.call(_stamped(lambda c: c.add_toxic(proxy, body)))
        return ToxicApplied(proxy, toxic["name"], toxic, at)

    async def aadd_toxic(self, proxy: str, type: str, attributes: dict[str, Any] | None = None,
                         stream: str = "downstream", toxicity: float = 1.0, name: str | None = None) -> ToxicApplied:
        """`add_toxic` for asyncio callers."""
        body = {"type": type, "stream": stream, "toxicity": toxicity, "attributes": attributes or {},
                "name": name or f"{type}_{stream}"}
        toxic, at = await self.acall(_stamped(lambda c: c.add_toxic(proxy, body)))
        return ToxicApplied(proxy, toxic["name"], toxic, at)

    async def aremove_toxic(self, proxy: str, name: str) -> ToxicApplied:
        """`remove_toxic` for asyncio callers."""
        _, at = await self.acall(_stamped(lambda c: c.remove_toxic(proxy, name)))
        return ToxicApplied(proxy, name, None, at)

    @contextlib.contextmanager
    def toxic(self, proxy: str, type: str, attributes: dict[str, Any] | None = None, stream: str = "downstream",
              toxicity: float = 1.0, name: str | None = None,
              registry: FaultRegistry | None = None) -> Iterator[ToxicApplied]:
        """A toxic for the duration of the block, recorded in the fault state file before it is added."""
        reg = registry or default_registry()
        toxic_name = name or f"{type}_{stream}"

        def undo(_entry: dict[str, Any]) -> None:
            with contextlib.suppress(ProxyUnavailableError):
                try:
                    self.remove_toxic(proxy, toxic_name)
                except ProxyApiError as exc:
                    if exc.status != 404:
                        raise

        with reg.hold("toxic", undo, api=self.url, proxy=proxy, toxic=toxic_name):
            yield self.add_toxic(proxy, type, attributes, stream=stream, toxicity=toxicity, name=toxic_name)

    def update_toxic(self, proxy: str, name: str, attributes: dict[str, Any] | None = None,
                     toxicity: float | None = None) -> ToxicApplied:
        body: dict[str, Any] = {"attributes": attributes or {}}
        if toxicity is not None:
            body["toxicity"] = toxicity
        toxic, at = self.call(_stamped(lambda c: c.update_toxic(proxy, name, body)))
        return ToxicApplied(proxy, name, toxic, at)

    def remove_toxic(self, proxy: str, name: str) -> ToxicApplied:
        """Remove a toxic; what it held is passed on in order. Returns when it is gone everywhere."""
        _, at = self.call(_stamped(lambda c: c.remove_toxic(proxy, name)))
        return ToxicApplied(proxy, name, None, at)

    def reset(self) -> float:
        """Enable all proxies and remove all toxics (POST /reset); returns `applied_at`."""
        return self.call(_stamped(lambda c: c.reset()))[1]

    def call_stats(self, proxy: str) -> dict[str, int]:
        """Connections and the calls seen, delayed, failed and cut short (a delay released early) by
        call-level toxics on the proxy's HTTP connections since it was created (closed ones included)."""

        async def run(c: ProxyCollection) -> dict[str, int]:
            p = c.get(proxy)
            out = dict(p.closed_totals)
            for conn in p.connections:
                for key, value in conn.call_counts().items():
                    out[key] += value
            return out

        return self.call(run)

    def flows(self, proxy: str) -> dict[str, Any]:
        """How the proxy's connections move bytes: per live connection and direction the way its last
        read went ("fast": straight from socket to socket; "chunk": through the tap and toxics), the
        bytes each way and the switches; the closed connections' counts summed (`Proxy.flow_stats`)."""

        async def run(c: ProxyCollection) -> dict[str, Any]:
            return c.get(proxy).flow_stats()

        return self.call(run)


class ProxyProcess:
    """A proxy API server in a child process (`python -m faults.proxy.main`)."""

    def __init__(self, proc: subprocess.Popen[str], host: str, port: int) -> None:
        self.proc, self.host, self.port = proc, host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 5) -> None:
        end_child(self.proc, term_s=timeout)

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_proxy_server(host: str = "127.0.0.1", port: int = 0, seed: int = 0, timeout: float = 15) -> ProxyProcess:
    """Start the proxy API in a subprocess and wait until it listens.

    Raises ProxyUnavailableError when it exits or does not report its port within `timeout`.
    """
    cmd = [sys.executable, "-m", "faults.proxy.main", "--host", host, "--port", str(port), "--seed", str(seed)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = spawn(cmd, stdout=subprocess.PIPE, text=True, env=env)   # never outlives the run that started it
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "listening http://HOST:PORT"
    if not line.startswith("listening "):
        proc.kill()
        proc.wait()
        raise ProxyUnavailableError(f"proxy subprocess failed to start on {host}:{port} (is the port free?)")
    bound = line.split("//", 1)[1].strip()
    return ProxyProcess(proc, bound.rpartition(":")[0], int(bound.rpartition(":")[2]))
