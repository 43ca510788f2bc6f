"""`shadowtest record`: capture live traffic into one recording file."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import click

from capture.backends import BACKENDS
from harness.console import progress
from harness.outputs import stamped
from wire.clicktypes import Seconds

if TYPE_CHECKING:   # capture loads when a command runs, keeping `shadowtest --help` fast
    from capture.backends import RecordOptions
    from capture.record import Recorder
    from capture.sink import SinkStats
    from harness.infer import Source

_DEFERRED_CALLS = {"at-stop": "at stop", "later": "by --finish"}   # what the live line shows for calls


def _live_line(stats: SinkStats, elapsed: float, decode: str = "live") -> str:
    s = stats
    calls = _DEFERRED_CALLS.get(decode, s.calls)
    return (f"{elapsed:6.1f}s  flows {s.flows} (joined {s.joined_flows})  calls {calls}  "
            f"bytes {s.bytes:,}  lost {s.lost_events}  truncated {s.truncated_events}  "
            f"unknown-method {s.unknown_method_calls}")


@click.command("record")
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="service port to record (0: any)")
@click.option("--pid", type=int, default=None, help="only this process (eBPF)")
@click.option("--cgroup", type=click.Path(exists=True, file_okay=False), default=None,
              help="only processes in this cgroup directory (v2 id, or v1 cgroup.procs)")
@click.option("--duration", type=Seconds(0, low_open=True), default=None,
              help="stop after this long (seconds, or 90s, 5m)")
@click.option("--max-bytes", type=click.IntRange(1, 64 << 20), default=8 << 20, show_default=True,
              help="payload bytes kept per syscall (eBPF; up to 64 MiB): the default keeps a 4 MiB gRPC message "
                   "or HTTP body written at once; more is recorded up to it and counted as truncated")
@click.option("--side", type=click.Choice(["server", "client"]), default="server", show_default=True,
              help="which end's syscalls to record (eBPF); server avoids recording loopback twice")
@click.option("--backend", type=click.Choice(BACKENDS.names()), default="ebpf", show_default=True)
@click.option("--interface", default="lo", show_default=True, help="network interface (pcap backend)")
@click.option("--listen-port", type=click.IntRange(0, 65535), default=0,
              help="proxy backend: where clients connect (it forwards to --port)")
@click.option("--redact", "redact", multiple=True, metavar="RULE",
              help="extra rule: header:NAME[,NAME], body-regex:PATTERN, json-field:PATH")
@click.option("--default-redaction/--no-default-redaction", default=True, show_default=True,
              help="mask credentials (authorization, cookies, ...); --no-default-redaction keeps them")
@click.option("--decode", type=click.Choice(["live", "at-stop", "later"]), default="live", show_default=True,
              help="decode calls while recording; or store masked chunks only and decode them at stop; or "
                   "store masked chunks only and decode them later with --finish, on any machine "
                   "(least CPU on the recorded host)")
@click.option("--finish", is_flag=True,
              help="decode the calls of OUTPUT (a --decode later recording, or an at-stop one whose recorder "
                   "was killed) and exit; needs no root or bcc")
@click.option("--descriptors", "descriptors", default=None, metavar="SRC",
              help="at stop, name the methods of calls on joined connections from this source too "
                   "(FILE.protoset, module names or reflection=HOST:PORT); the recorded server's own "
                   "reflection is tried first")
@click.option("--tls", "tls", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="TLS plaintext from uprobes on the system libssl (eBPF): auto = on where it works, else "
                   "recorded without it and the reason printed; on = fail if it cannot work; off")
@click.option("--print-bpf", is_flag=True, help="print the generated eBPF program and exit")
@click.option("--list-tls", is_flag=True,
              help="list, per process the recording would target (--pid, --cgroup, --port; else all), the TLS "
                   "library it runs, whether its plaintext will be read and why not, then exit")
@click.option("--sample", "sample_pct", type=click.FloatRange(0, 100, min_open=True), default=100.0,
              metavar="PCT", help="keep this share of connections, whole, chosen by a hash of the 4-tuple and "
                                  "--sample-seed (the same seed keeps the same connections on every host)")
@click.option("--sample-seed", type=int, default=0, show_default=True, help="seed of --sample's hash")
@click.option("--max-file-mb", type=click.FloatRange(0, min_open=True), default=None, metavar="MB",
              help="stop at this file size: what came before is complete, the summary says the cap was hit")
@click.option("--max-cpu-pct", type=click.FloatRange(0, min_open=True), default=None, metavar="PCT",
              help="CPU budget (% of one core, this process, over each second): above it new connections are "
                   "not recorded, whole, until it is back under 80 %% of it; counted and said")
@click.option("--rotate-mb", type=click.FloatRange(0, min_open=True), default=None, metavar="MB",
              help="OUTPUT becomes a directory of numbered files, the next one started at this size (tcpdump -C); "
                   "inspect, replay, export and infer read the directory as one recording")
@click.option("--rotate-s", type=click.FloatRange(0, min_open=True), default=None, metavar="S",
              help="... or at this age (tcpdump -G)")
@click.option("--ring", "ring", default=None, metavar="WINDOW",
              help="flight recorder: keep only the last WINDOW (90s, 10m, 1h) and write it to OUTPUT/<time>-<name>.rec "
                   "on SIGUSR1 or an Alertmanager webhook (--trigger-listen); OUTPUT is a directory")
@click.option("--ring-mb", type=click.FloatRange(0, min_open=True), default=None, metavar="MB",
              help="and the ring's files hold at most this much")
@click.option("--trigger-listen", default=None, metavar="HOST:PORT",
              help="with --ring: accept Alertmanager webhooks here (loopback unless you name another address)")
@click.option("-o", "--output", type=click.Path(), default=None,
              help="recording file to create (a directory with --rotate-mb/--rotate-s)")
@click.option("--force", is_flag=True, help="replace OUTPUT if it exists")
@click.option("--json", "as_json", is_flag=True, help="print the final stats as JSON")
def command(port: int, pid: int | None, cgroup: str | None, duration: float | None, max_bytes: int, side: str,
            backend: str, interface: str, listen_port: int, redact: tuple[str, ...], default_redaction: bool,
            decode: str, finish: bool, descriptors: str | None, tls: str, print_bpf: bool, list_tls: bool,
            sample_pct: float, sample_seed: int, max_file_mb: float | None, rotate_mb: float | None,
            rotate_s: float | None, ring: str | None, ring_mb: float | None, trigger_listen: str | None,
            max_cpu_pct: float | None, output: str | None, force: bool, as_json: bool) -> None:
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
      shadowtest record --port 50051 --descriptors api.protoset -o prod.rec
      shadowtest record --port 50051 --print-bpf
      shadowtest record --port 8443 --tls off -o https.rec   (TLS flows as ciphertext only)
      shadowtest record --port 8443 --list-tls               (what each process's TLS is, read or why not)
      shadowtest record --port 50051 --sample 10 --max-file-mb 500 -o prod.rec   (10 % of connections, <= 500 MB)
      shadowtest record --port 50051 --rotate-mb 100 -o prod/    (prod/000001.rec, 000002.rec, ...: one recording)
      shadowtest record --port 50051 --ring 10m --trigger-listen 127.0.0.1:9099 -o incidents/   (flight recorder)
    """
    from capture.backends import RecordOptions

    opts = RecordOptions(output=output or "", backend=backend, port=port, pid=pid, cgroup=cgroup, side=side,
                         max_bytes=max_bytes, interface=interface, listen_port=listen_port, redact=list(redact),
                         default_redaction=default_redaction, overwrite=force, decode=decode, tls=tls,
                         sample_pct=sample_pct, sample_seed=sample_seed, max_file_mb=max_file_mb,
                         rotate_mb=rotate_mb, rotate_s=rotate_s,
                         ring_s=_ring_window(ring) if ring else None, ring_mb=ring_mb, trigger_listen=trigger_listen,
                         max_cpu_pct=max_cpu_pct)
    if finish:
        from capture.record import finish_recording

        if not output:
            raise click.UsageError("--finish needs -o/--output FILE: the recording to finish")
        with progress(f"decoding {output}", "flows") as update:
            done = finish_recording(output, update)
        # The recorded server may be on another host now: only the descriptors given, no reflection.
        done |= _name_methods(output, descriptors, reflection=False)
        click.echo(json.dumps(stamped("record-finish", done), indent=2) if as_json else f"decoded {done['calls']} calls -> {output}")
        _print_methods(done, output, as_json)
        return
    if list_tls:
        _list_tls(port, pid, cgroup, as_json)
        return
    if print_bpf:
        from capture.ebpf.loader import cgroup_filter, render_program

        cg_id, tgid_map, _ = cgroup_filter(cgroup)
        click.echo(render_program(opts, cg_id, tgid_map))
        if tls != "off":
            from capture.ebpf.tls import render_program as render_tls

            click.echo("/* ---- and beside it, the TLS plaintext program (capture/ebpf/tls.bpf.c) ---- */")
            click.echo(render_tls(opts, cg_id))
        return
    if not output:
        raise click.UsageError("-o/--output FILE is required (or --print-bpf)")
    _check_descriptors(descriptors)
    if os.path.isdir(output) and not (rotate_mb or rotate_s or ring):
        raise click.UsageError(f"{output} is a directory: a rotated recording needs --rotate-mb or --rotate-s")
    result = _run(opts, duration, as_json)
    if "finish" not in result and not (rotate_mb or rotate_s or ring):
        result |= _name_methods(output, descriptors, reflection=True)
    if as_json:
        click.echo(json.dumps(stamped("record", result), indent=2))
    else:
        calls = "calls not decoded yet" if "finish" in result else f"{result['calls']} calls"
        click.echo(f"recorded {calls} on {result['flows']} flows, {result['bytes']:,} bytes, "
                   f"lost {result['lost_events']}, truncated {result['truncated_events']} -> {output}")
        _print_tls(result)
        if dropped := int(cast(int, result.get("sampled_out_flows") or 0)):
            kept = int(cast(int, result["flows"]))
            click.echo(f"sampled: kept {kept} of {kept + dropped} connections ({sample_pct:g} %, seed {sample_seed})")
        if result.get("capped"):
            click.echo(f"stopped at the file size cap (--max-file-mb {max_file_mb:g}): everything before it is "
                       f"complete; {result['bytes_after_cap']:,} bytes and {result['flows_after_cap']} new "
                       "connections after it were not recorded")
        if budget := cast(dict[str, object], result.get("cpu_budget") or {}):
            click.echo(f"CPU budget {max_cpu_pct:g} %: {budget['shed_flows']} connections not recorded while over it "
                       f"({budget['shedding_s']} s in all, peak {budget['peak_cpu_pct']} %)")
        for d in cast(list[dict[str, object]], result.get("dumps") or []):
            click.echo(f"dump for {d['name']}: {d['file'] or 'not written: ' + str(d.get('error'))}")
        if result.get("files"):
            click.echo(f"rotated: {result['files']} files in {output} (read the directory as one recording)")
        if "finish" in result:   # --decode later: the user must know the file is not replayable yet
            click.echo(f"to decode its calls, run `{result['finish']}` on any machine (no root or bcc needed)")
        _print_methods(result, output, as_json)


def _run(opts: RecordOptions, duration: float | None, quiet: bool) -> dict[str, object]:
    from capture.record import Recorder

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    rec = Recorder(opts)
    if opts.ring_s:
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda *_: _dump_now(rec, quiet))
    try:
        rec.start()
        tls = _tls_status(rec)
        if tls.get("capture") == "off" and tls.get("reason") != "--tls off" and not quiet:
            click.echo(f"TLS capture is off: {tls.get('reason')} (TLS flows are recorded as ciphertext)", err=True)
        proxy_addr = getattr(rec.backend, "address", None)
        if proxy_addr and not quiet:
            click.echo(f"proxy listening on {proxy_addr[0]}:{proxy_addr[1]}: point clients there", err=True)
        _wait(rec, stop, duration, quiet)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        result = rec.stop()
    if tls := _tls_status(rec):
        result["tls"] = tls
    return result


def _ring_window(text: str) -> float:
    from capture.errors import CaptureError
    from capture.ring import parse_window

    try:
        return parse_window(text)
    except CaptureError as exc:
        raise click.BadParameter(str(exc), param_hint="--ring") from exc


def _dump_now(rec: Recorder, quiet: bool) -> None:
    """SIGUSR1 with --ring: dump the last window (in the recorder's own thread: never in the handler)."""
    from capture.errors import CaptureError

    try:
        rec.dump("sigusr1")
    except CaptureError as exc:
        if not quiet:
            click.echo(f"dump refused: {exc}", err=True)


def _tls_status(rec: Recorder) -> dict[str, object]:
    """TLS capture on or off (and why), and after stop its counters (capture/ebpf/tls.py)."""
    status = getattr(rec.backend, "status", None)
    if not isinstance(status, dict):
        return {}
    flows = getattr(rec.backend, "flow_report", None)
    return dict(status) | ({"flows": flows} if flows else {})


def _print_tls(result: dict[str, object]) -> None:
    tls = result.get("tls")
    if not isinstance(tls, dict):
        return
    if tls.get("capture") == "on":
        click.echo(f"TLS: {tls.get('plaintext_flows', 0)} flows as plaintext, "
                   f"{tls.get('encrypted_flows', 0)} encrypted")
    else:
        click.echo(f"TLS capture was off ({tls.get('reason')}): {tls.get('encrypted_flows', 0)} TLS flows "
                   "recorded as ciphertext")
    for flow_id, _state, reason, _n in [r for r in tls.get("flows") or [] if r[1] == "encrypted"][:10]:
        click.echo(f"  flow {flow_id}: {reason}")


def _wait(rec: Recorder, stop: threading.Event, duration: float | None, quiet: bool) -> None:
    t0 = time.monotonic()
    tty = sys.stderr.isatty()
    last_print = 0.0
    # Wake-ups cost the recorded host CPU: 5 a second for a terminal's live line, else one.
    period = 0.2 if tty and not quiet else 1.0
    while not stop.wait(period if duration is None else max(0.01, min(period, duration - (time.monotonic() - t0)))):
        elapsed = time.monotonic() - t0
        if (duration is not None and elapsed >= duration) or rec.capped.is_set():
            break
        if quiet:
            continue
        line = _live_line(rec.stats, elapsed, rec.options.decode)
        if tty:
            click.echo("\r" + line, nl=False, err=True)
        elif elapsed - last_print >= 5:   # plain lines, not a flood, when not on a terminal
            click.echo(line, err=True)
            last_print = elapsed
    if tty and not quiet:
        click.echo(err=True)


# -- naming the methods of calls on joined connections (harness/infer.py) ------------------------------

_REFLECTION_TIMEOUT_S = 2.0   # per reflection call: stop must not hang on a server that never answers
_MAX_SERVERS = 4              # distinct recorded servers whose reflection stop asks (each up to ~2 s)
_SHOWN_GROUPS = 10


def _check_descriptors(spec: str | None) -> None:
    """A protoset or modules that cannot be loaded is a usage error now, not a note after recording."""
    if spec and not spec.startswith("reflection="):
        from harness.infer import load_source
        from replay.errors import ReplayError

        try:
            load_source(spec)
        except ReplayError as exc:
            raise click.BadParameter(str(exc), param_hint="--descriptors") from exc


def _name_methods(path: str, spec: str | None, reflection: bool) -> dict[str, object]:
    """Infer the methods of the recording's unknown groups and write what fits into it: the recorded
    servers' reflection first (read-only), then `spec`. Never fails the recording: problems are notes.
    Returns {"method_inference": {...}} for the result, or {} when no call's method is unknown."""
    from capture.recording import Recording, set_group_methods
    from harness.infer import describe, resolve_groups

    notes: list[str] = []
    rec = Recording(path)
    try:
        groups = [g for g in rec.method_groups() if g.method is None]
        if not groups:
            return {}
        by_flow = _reflection_sources(rec, {g.flow_id for g in groups}, notes) if reflection else {}
        extra = _spec_sources(spec, notes)
        states = resolve_groups(groups, lambda g: rec.group_calls(g.flow_id, g.ref),
                                lambda g: by_flow.get(g.flow_id, []) + extra)
    finally:
        rec.close()
    if changed := [(s.flow_id, s.ref, s.method, s.how) for s in states if s.changed and s.method and s.how]:
        set_group_methods(path, changed)
    if not reflection and not spec:
        notes.append("no descriptors given (--descriptors SRC)")
    rows = [s.as_json() | {"line": describe(s)} for s in states]
    return {"method_inference": {"groups": len(states), "inferred": [r for r in rows if r["method"]],
                        "unknown": [r for r in rows if not r["method"]], "notes": notes}}


def _reflection_sources(rec: Any, flow_ids: set[int], notes: list[str]) -> dict[int, list[Source]]:
    """The reflection of each flow's server (its recorded address), asked once per server."""
    from harness.infer import load_source
    from replay.errors import ReplayError

    loaded: dict[str, list[Source]] = {}
    out: dict[int, list[Source]] = {}
    for fid in sorted(flow_ids):
        flow = rec.flow(fid)
        if flow is None or not flow.dst[1]:
            continue
        host = flow.dst[0]
        target = f"[{host}]:{flow.dst[1]}" if ":" in host else f"{host}:{flow.dst[1]}"
        if target not in loaded:
            loaded[target] = []
            if len(loaded) > _MAX_SERVERS:
                notes.append(f"reflection not tried at {target}: more than {_MAX_SERVERS} servers")
                continue
            try:
                loaded[target] = [load_source(f"reflection={target}", _own_address(host), _REFLECTION_TIMEOUT_S)]
            except ReplayError as exc:
                notes.append(f"reflection not available at {target}: {exc}")
        out[fid] = loaded[target]
    return out


def _own_address(host: str) -> list[str]:
    """[host] when it is an address of this host: the recorded server runs here, so reading its
    reflection (read-only) needs no allowlist entry. Another host's address still does."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError:
        return []
    return [host]


def _spec_sources(spec: str | None, notes: list[str]) -> list[Source]:
    from harness.infer import load_source
    from replay.errors import ReplayError

    if not spec:
        return []
    try:
        return [load_source(spec, timeout_s=_REFLECTION_TIMEOUT_S)]
    except ReplayError as exc:
        notes.append(f"--descriptors {spec}: {exc}")
        return []


def _print_methods(result: dict[str, object], output: str | None, as_json: bool) -> None:
    info = result.get("method_inference")
    if as_json or not isinstance(info, dict):
        return
    for note in info["notes"]:
        click.echo(f"methods: {note}")
    rows = info["inferred"] + info["unknown"]
    for g in rows[:_SHOWN_GROUPS]:
        click.echo(f"methods: {g['line']}")
    if len(rows) > _SHOWN_GROUPS:
        click.echo(f"methods: ... {len(rows) - _SHOWN_GROUPS} more groups (shadowtest inspect {output})")
    click.echo(f"methods: {len(info['inferred'])} of {info['groups']} groups of unknown calls named")
    if info["unknown"]:
        click.echo(f"methods: name the rest with `shadowtest infer {output} --descriptors SRC` "
                   f"(FILE.protoset or reflection=HOST:PORT) or --method-map FLOW:REF=/package.Service/Method")


def _list_tls(port: int, pid: int | None, cgroup: str | None, as_json: bool) -> None:
    """`record --list-tls`: the processes the recording would target and what their TLS is."""
    from capture.ebpf import tlslibs

    pids = tlslibs.target_pids(pid, cgroup, port)
    scope = (f"process {pid}" if pid else f"the processes of {cgroup}" if cgroup else
             f"the processes with a TCP socket on port {port}" if port else "every process")
    rows = [p.as_dict() for p in tlslibs.inspect_all(pids) if p.files or p.error or pid]
    if as_json:
        click.echo(json.dumps(stamped("list-tls", {"scope": scope, "processes": rows}), indent=2))
        return
    if not rows:
        click.echo(f"no TLS library in {scope}" + ("" if pids else " (none found)"))
        return
    click.echo(f"TLS in {scope}:")
    for r in rows:
        click.echo(f"  {r['pid']:>7} {str(r['comm'])[:15]:15} {r['verdict']}")
