"""`shadowtest import`: a pcap/pcapng capture -> a recording."""

from __future__ import annotations

import json
import sys

import click

from harness.console import progress
from harness.outputs import stamped


@click.command("import")
@click.argument("capture_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="recording to create")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="keep only connections on this service port (also says which side is the server)")
@click.option("--redact", "redact", multiple=True, metavar="RULE", help="header:..., body-regex:..., json-field:...")
@click.option("--default-redaction/--no-default-redaction", default=True, show_default=True)
@click.option("--force", is_flag=True, help="replace OUTPUT if it exists")
@click.option("--json", "as_json", is_flag=True)
@click.option("--salvage", is_flag=True,
              help="keep what a damaged (cut, corrupt) capture holds before the damage; the recording says it is partial")
def command(capture_file: str, output: str, port: int | None, redact: tuple[str, ...], default_redaction: bool,
            force: bool, as_json: bool, salvage: bool) -> None:
    """Import a tcpdump/Wireshark capture (pcap or pcapng) with TCP reassembly.

    Out-of-order segments and retransmissions are handled; holes are reported as gaps (the recording
    is written and says so; exit 1). A truncated or damaged capture writes nothing (exit 1, saying
    where it is damaged) unless --salvage: then it is imported up to the damage, the recording's meta
    says so (inspect and replay see it), and the exit is 0 unless there are gaps too. OUTPUT appears
    whole or not at all.

    \b
    Examples:
      tcpdump -i lo -w prod.pcap 'tcp port 50051' ; shadowtest import prod.pcap -o prod.rec
      shadowtest import trace.pcapng --port 8080 -o web.rec --json
    """
    from capture.pcap_import import import_capture
    from capture.record import build_redactor

    with progress(f"importing {capture_file}", "bytes") as update:
        imported = import_capture(capture_file, output, port=port, overwrite=force, strict=not salvage,
                                  redactor=build_redactor(default_redaction, list(redact)), progress=update)
    result = imported.as_dict()
    if as_json:
        click.echo(json.dumps(stamped("import", result), indent=2))
    else:
        click.echo(f"imported {result['packets']} packets: {result['flows']} flows, {result['calls']} calls, "
                   f"{result['retransmitted']} retransmitted, {result['out_of_order']} out of order, "
                   f"{result['gaps']} gaps ({result['gap_bytes']} bytes) -> {output}")
        for p in imported.all_problems:
            click.echo(f"problem: {p}", err=True)
        if imported.problems:
            click.echo(f"salvaged: the capture is damaged; {output} holds the {result['packets']} packets before "
                       "the damage and says it is partial", err=True)
    # damage was refused above or accepted with --salvage; gaps in the traffic still fail the import
    sys.exit(1 if imported.reassembly.problems else 0)
