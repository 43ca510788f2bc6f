"""`shadowtest record`: capture live traffic into one recording file."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import click

_DEFERRED_CALLS = {"at-stop": "at stop", "later": "by --finish"}   # what the live line shows for calls


def _live_line(stats: object, elapsed: float, decode: str = "live") -> str:
    s = stats
    calls = _DEFERRED_CALLS.get(decode, s.calls)  # type: ignore[attr-defined]
    return (f"{elapsed:6.1f}s  flows {s.flows} (joined {s.joined_flows})  calls {calls}  "  # type: ignore[attr-defined]
            f"bytes {s.bytes:,}  lost {s.lost_events}  truncated {s.truncated_events}  "  # type: ignore[attr-defined]
            f"unknown-method {s.unknown_method_calls}")  # type: ignore[attr-defined]


@click.command("record")
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="service port to record (0: any)")
@click.option("--pid", type=int, default=None, help="only this process (eBPF)")
@click.option("--cgroup", type=click.Path(exists=True, file_okay=False), default=None,
              help="only processes in this cgroup directory (v2 id, or v1 cgroup.procs)")
@click.option("--duration", type=float, default=None, help="stop after this many seconds")
@click.option("--max-bytes", type=click.IntRange(1, 1 << 18), default=16384, show_default=True,
              help="payload bytes kept per syscall (eBPF); more is counted as truncated")
@click.option("--side", type=click.Choice(["server", "client"]), default="server", show_default=True,
              help="which end's syscalls to record (eBPF); server avoids recording loopback twice")
@click.option("--backend", type=click.Choice(["ebpf", "pcap", "proxy"]), default="ebpf", show_default=True)
@click.option("--interface", default="lo", show_default=True, help="network interface (pcap backend)")
@click.option("--listen-port", type=click.IntRange(0, 65535), default=0,
              help="proxy backend: where clients connect (it forwards to --port)")
@click.option("--redact", "redact", multiple=True, metavar="RULE",
              help="extra rule: header:NAME[,NAME], body-regex:PATTERN, json-field:PATH")
@click.option("--no-default-redaction", is_flag=True, help="keep credentials (authorization, cookies, ...)")
@click.option("--decode", type=click.Choice(["live", "at-stop", "later"]), default="live", show_default=True,
              help="decode calls while recording; or store masked chunks only and decode them at stop; or "
                   "store masked chunks only and decode them later with --finish, on any machine "
                   "(least CPU on the recorded host)")
@click.option("--finish", is_flag=True,
              help="decode the calls of OUTPUT (a --decode later recording, or an at-stop one whose recorder "
                   "was killed) and exit; needs no root or bcc")
@click.option("--print-bpf", is_flag=True, help="print the generated eBPF program and exit")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="recording file to create")
@click.option("--force", is_flag=True, help="replace OUTPUT if it exists")
@click.option("--json", "as_json", is_flag=True, help="print the final stats as JSON")
def command(port: int, pid: int | None, cgroup: str | None, duration: float | None, max_bytes: int, side: str,
            backend: str, interface: str, listen_port: int, redact: tuple[str, ...], no_default_redaction: bool,
            decode: str, finish: bool, print_bpf: bool, output: str | None, force: bool, as_json: bool) -> None:
    """Record TCP traffic of a service into one recording file (SQLite, mode 0600).

    Stops cleanly on Ctrl-C / SIGTERM or after --duration, then prints flows, calls, bytes and loss.
    Backends: ebpf (root; syscall tracepoints, outside the request path), pcap (root; live capture on
    --interface), proxy (unprivileged; a TCP proxy IN the request path on --listen-port).

    \b
    Examples:
      shadowtest record --port 50051 --duration 30 -o prod.rec
      shadowtest record --port 50051 --pid 4242 --max-bytes 65536 -o prod.rec
      shadowtest record --port 50051 --backend proxy --listen-port 6000 -o prod.rec
      shadowtest record --port 50051 --redact header:x-session --redact json-field:user.ssn -o prod.rec
      shadowtest record --port 50051 --decode at-stop -o prod.rec
      shadowtest record --port 50051 --decode later -o prod.rec
      shadowtest record --finish -o prod.rec          (later, on any machine)
      shadowtest record --port 50051 --print-bpf
    """
    from capture.backends import RecordOptions

    opts = RecordOptions(output=output or "", backend=backend, port=port, pid=pid, cgroup=cgroup, side=side,
                         max_bytes=max_bytes, interface=interface, listen_port=listen_port, redact=list(redact),
                         default_redaction=not no_default_redaction, overwrite=force, decode=decode)
    if finish:
        from capture.record import finish_recording

        if not output:
            raise click.UsageError("--finish needs -o/--output FILE: the recording to finish")
        done = finish_recording(output)
        click.echo(json.dumps(done, indent=2) if as_json else f"decoded {done['calls']} calls -> {output}")
        return
    if print_bpf:
        from capture.ebpf.loader import cgroup_filter, render_program

        cg_id, tgid_map, _ = cgroup_filter(cgroup)
        click.echo(render_program(opts, cg_id, tgid_map))
        return
    if not output:
        raise click.UsageError("-o/--output FILE is required (or --print-bpf)")
    result = _run(opts, duration, as_json)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        calls = "calls not decoded yet" if "finish" in result else f"{result['calls']} calls"
        click.echo(f"recorded {calls} on {result['flows']} flows, {result['bytes']:,} bytes, "
                   f"lost {result['lost_events']}, truncated {result['truncated_events']} -> {output}")
        if "finish" in result:   # --decode later: the user must know the file is not replayable yet
            click.echo(f"to decode its calls, run `{result['finish']}` on any machine (no root or bcc needed)")


def _run(opts: object, duration: float | None, quiet: bool) -> dict[str, object]:
    from capture.record import Recorder

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    rec = Recorder(opts)  # type: ignore[arg-type]
    try:
        rec.start()
        proxy_addr = getattr(rec.backend, "address", None)
        if proxy_addr and not quiet:
            click.echo(f"proxy listening on {proxy_addr[0]}:{proxy_addr[1]}: point clients there", err=True)
        _wait(rec, stop, duration, quiet)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        result = rec.stop()
    return result


def _wait(rec: object, stop: threading.Event, duration: float | None, quiet: bool) -> None:
    t0 = time.monotonic()
    tty = sys.stderr.isatty()
    last_print = 0.0
    # Wake-ups cost the recorded host CPU: 5 a second for a terminal's live line, else one.
    period = 0.2 if tty and not quiet else 1.0
    while not stop.wait(period if duration is None else max(0.01, min(period, duration - (time.monotonic() - t0)))):
        elapsed = time.monotonic() - t0
        if duration is not None and elapsed >= duration:
            break
        if quiet:
            continue
        line = _live_line(rec.stats, elapsed, rec.options.decode)  # type: ignore[attr-defined]
        if tty:
            click.echo("\r" + line, nl=False, err=True)
        elif elapsed - last_print >= 5:   # plain lines, not a flood, when not on a terminal
            click.echo(line, err=True)
            last_print = elapsed
    if tty and not quiet:
        click.echo(err=True)
