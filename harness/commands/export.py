"""`shadowtest export`: a recording -> pcapng for Wireshark/tshark."""

from __future__ import annotations

import json
import sys

import click

from harness.console import progress
from harness.outputs import stamped


@click.command("export")
@click.argument("file", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="pcapng file to write")
@click.option("--force", is_flag=True, help="replace OUTPUT if it exists")
@click.option("--json", "as_json", is_flag=True)
@click.option("--salvage", is_flag=True, help="export the intact part of a damaged recording (the loss is stated)")
def command(file: str, output: str, force: bool, as_json: bool, salvage: bool) -> None:
    """Export a recording as pcapng with synthesized TCP/IP framing and the original timestamps.

    Wireshark decodes gRPC on a non-standard port once told it is HTTP/2 ("Decode As"). Bytes the
    recording does not hold (gaps) show as "previous segment not captured", with a packet comment
    saying how many bytes are missing. The file's redaction rules are applied once more.

    A damaged recording is refused (exit 1, nothing written) unless --salvage: then its intact part is
    exported, the calls lost to damage are stated, and the exit is 0. OUTPUT appears whole or not at all.

    \b
    Examples:
      shadowtest export prod.rec -o prod.pcapng
      tshark -r prod.pcapng -d tcp.port==50051,http2 -Y grpc
    """
    from capture.integrity import loss_text
    from capture.pcap_export import export_file
    from capture.rotate import as_one

    with progress(f"exporting {file}", "chunks") as update:
        counts = export_file(as_one(file, salvage), output, overwrite=force, salvage=salvage,   # a set: as one
                             progress=update)
    if as_json:
        click.echo(json.dumps(stamped("export", counts), indent=2))
    else:
        gaps = f", {counts['gaps_marked']} gap(s) marked" if counts.get("gaps_marked") else ""
        lost = f" (salvaged: {loss_text(counts['calls_lost'])})" if counts["problems"] else ""
        click.echo(f"exported {counts['flows']} flows, {counts['chunks']} chunks as {counts['packets']} packets"
                   f"{gaps} -> {output}{lost}")
        for p in counts["problems"]:
            click.echo(f"problem: {p}", err=True)
    # without --salvage a damaged file was refused above; with it, the loss is stated and accepted
    sys.exit(0)
