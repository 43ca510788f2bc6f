"""`shadowtest redact`: apply redaction rules to an existing recording."""

from __future__ import annotations

import json

import click

from harness.console import progress
from harness.outputs import stamped


@click.command("redact")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="write a redacted copy here")
@click.option("--in-place", is_flag=True, help="replace FILE with its redacted copy")
@click.option("--redact", "--rule", "rules", multiple=True, metavar="RULE",
              help="header:NAME[,NAME] (globs ok), body-regex:PATTERN, json-field:PATH")
@click.option("--default-redaction", "--defaults", "defaults", is_flag=True,
              help="also apply the default credential rules")
@click.option("--force", is_flag=True, help="replace OUTPUT if it exists")
@click.option("--json", "as_json", is_flag=True)
@click.option("--salvage", is_flag=True,
              help="copy the intact part of a damaged recording (with -o; the copy's meta states the calls lost)")
def command(file: str, output: str | None, in_place: bool, rules: tuple[str, ...], defaults: bool, force: bool,
            as_json: bool, salvage: bool) -> None:
    """Redact headers, body patterns or JSON fields in a recording (calls and raw chunks).

    The recording's meta lists every rule applied (at record time and here). The rules the file
    already lists are applied again first, on each flow's reassembled stream, so a file stored by an
    older version (which masked chunk by chunk) comes out without a credential split over chunks.

    A damaged recording is refused (exit 1, nothing written) unless --salvage (with -o): the copy then
    holds the intact part, and says in its meta how many calls were lost (inspect and replay see it).
    OUTPUT appears whole or not at all.

    \b
    Examples:
      shadowtest redact prod.rec -o safe.rec --rule header:x-session,x-user
      shadowtest redact prod.rec --in-place --rule 'body-regex:\\d{16}' --rule json-field:user.ssn
    """
    from capture.record import build_redactor
    from capture.redact_file import redact_in_place, redact_recording

    if bool(output) == in_place:
        raise click.UsageError("give exactly one of -o OUTPUT or --in-place")
    if not rules and not defaults:
        raise click.UsageError("no rules: add --redact RULE (repeatable) and/or --default-redaction")
    if in_place and salvage:
        raise click.UsageError("--salvage writes a copy: use -o OUTPUT (in place, the damaged original would be gone)")
    from capture.integrity import loss_text

    redactor = build_redactor(defaults, list(rules))
    with progress(f"redacting {file}", "chunks") as update:
        counts = redact_in_place(file, redactor, update) if in_place else redact_recording(
            file, output or "", redactor, overwrite=force, salvage=salvage, progress=update)
    if as_json:
        click.echo(json.dumps(stamped("redact", counts | {"rules": redactor.specs}), indent=2))
    else:
        lost = f" (salvaged: {loss_text(counts['calls_lost'])})" if counts["problems"] else ""
        click.echo(f"redacted {counts['calls_changed']} of {counts['calls']} calls, {counts['chunks']} chunks "
                   f"with {', '.join(redactor.specs)} -> {output or file}{lost}")
        for p in counts["problems"]:
            click.echo(f"problem: {p}", err=True)
