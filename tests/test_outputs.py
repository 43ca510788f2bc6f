"""Every JSON document a command prints or writes carries `schema` and `shadowtest_version`
(harness/outputs.py), and none is written without them."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

import harness
from harness.cli import cli
from harness.outputs import CHECK_ENV, SCHEMAS, VERSIONS, OutputSchemaError, schema, schema_file, stamped

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "scenarios" / "http-faults.rec"


def _json(args: list[str]) -> dict[str, object]:
    out = CliRunner().invoke(cli, args)
    assert out.exit_code in (0, 1), out.output
    doc = json.loads(out.output)
    assert isinstance(doc, dict), doc
    return doc


def test_the_commands_json_says_what_it_is_and_which_version_wrote_it(tmp_path: Path) -> None:
    rec = tmp_path / "small.rec"
    shutil.copy2(SMALL, rec)
    docs = {
        "inspect": _json(["inspect", str(rec), "--json"]),
        "validate": _json(["chaos", "validate", "--json", str(ROOT / "scenarios" / "baseline.yaml")]),
        "redact": _json(["redact", str(rec), "--default-redaction", "--redact", "header:user-agent", "-o",
                         str(tmp_path / "r.rec"), "--json"]),
        # --json alone is stdout, as on every command (--json-out FILE writes a file)
        "replay": _json(["replay", str(rec), "--target", "127.0.0.1:1", "--dry-run", "--json"]),
        "export": _json(["export", str(rec), "-o", str(tmp_path / "x.pcapng"), "--json"]),
    }
    for kind, doc in docs.items():
        assert (doc["schema"], doc["shadowtest_version"]) == (f"shadowtest.{kind}/v1", harness.__version__), doc
        assert list(doc)[:2] == ["schema", "shadowtest_version"]
    assert docs["inspect"]["calls"] and docs["validate"]["scenarios"]
    assert "header:user-agent" in docs["redact"]["rules"]
    out = tmp_path / "plan.json"
    done = CliRunner().invoke(cli, ["replay", str(rec), "--target", "127.0.0.1:1", "--dry-run", "--json-out", str(out)])
    assert done.exit_code == 0 and json.loads(out.read_text())["schema"] == "shadowtest.replay/v1", done.output


def test_stamped_replaces_a_documents_own_fields_and_names_only_known_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CHECK_ENV)   # a partial document, on purpose
    doc = stamped("replay", {"schema": "old", "sent": 3})
    assert doc == {"schema": "shadowtest.replay/v1", "shadowtest_version": harness.__version__, "sent": 3}
    assert schema("results") == "shadowtest.results/v1"
    try:
        schema("nonsense")
    except KeyError:
        pass
    else:
        raise AssertionError("an unknown output kind must not get a schema")


def test_no_json_output_is_written_without_its_stamp() -> None:
    """Each json.dumps of a whole output in the commands and reports goes through stamped() (capacity's
    as_dict stamps itself)."""
    unstamped = []
    for path in [*(ROOT / "harness" / "commands").glob("*.py"), ROOT / "harness" / "session.py",
                 ROOT / "harness" / "report" / "write.py", ROOT / "replay" / "locust_user.py"]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(echo|print|_write|write_text)\(.*json\.dumps\((?!stamped\()", line):
                unstamped.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not unstamped, unstamped
    assert set(VERSIONS) >= {"results", "replay", "record", "inspect", "doctor", "capacity", "locust"}


def test_every_output_has_a_json_schema_that_names_it() -> None:
    assert {p.stem for p in SCHEMAS.glob("*.json")} == set(VERSIONS)
    for kind in VERSIONS:
        rules = json.loads(schema_file(kind).read_text())
        jsonschema.Draft202012Validator.check_schema(rules)           # a valid JSON Schema
        variants = rules.get("anyOf", [rules])
        assert all(v["properties"]["schema"] == {"const": schema(kind)} for v in variants), kind
        assert all({"schema", "shadowtest_version"} <= set(v["required"]) for v in variants), kind


def test_a_document_that_breaks_its_schema_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    good = {"target": "127.0.0.1:1", "pattern": "poisson", "seed": 0, "rate": 5.0, "duration_s": 1.0, "sent": 5,
            "ok": 5, "achieved_rate": 5.0, "p50_ms": 1.0, "p95_ms": 2.0, "p99_ms": None, "send_lag_p99_ms": 0.1,
            "errors": {}, "by_method": {"Decide": 5}}
    monkeypatch.setenv(CHECK_ENV, "1")
    assert stamped("traffic", good)["sent"] == 5          # passes (a P99 of no calls is null)
    with pytest.raises(OutputSchemaError, match=r"^output shadowtest.traffic/v1 does not match traffic.json at "
                                                r"\(top\): 'sent' is a required property$"):
        stamped("traffic", {k: v for k, v in good.items() if k != "sent"})
    with pytest.raises(OutputSchemaError, match=r"at \.by_method\.Decide: 'five' is not of type"):
        stamped("traffic", {**good, "by_method": {"Decide": "five"}})
    monkeypatch.delenv(CHECK_ENV)
    assert "sent" not in stamped("traffic", {"rate": 1})   # not checked unless asked: a user's run never fails on it


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_long_commands_show_progress_on_a_terminal_only() -> None:
    from harness.console import progress

    tty, pipe = _Tty(), io.StringIO()
    with progress("exporting prod.rec", "chunks", stream=tty) as update:
        assert update is not None
        update(1024, 4096)
    with progress("exporting prod.rec", "chunks", stream=pipe) as off:
        assert off is None                # no callback: the command counts nothing for a bar nobody sees
    assert "exporting prod.rec" in tty.getvalue() and "chunks" in tty.getvalue()
    assert pipe.getvalue() == ""          # a pipe, a log, CI: what scripts read stays as it was


def test_export_and_redact_report_their_progress_against_the_whole(tmp_path: Path) -> None:
    from capture.pcap_export import export_file
    from capture.recording import Chunk, Flow, RecordingWriter
    from capture.redact import Redactor
    from capture.redact_file import redact_recording

    rec = tmp_path / "many.rec"
    with RecordingWriter(rec, meta={"started_wall_ns": 0, "started_mono_ns": 0}) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 80), opened_ns=1, protocol="tcp"))
        for i in range(3000):
            w.add_chunk(Chunk(fid, "c2s" if i % 2 else "s2c", 1000 + i, b"x" * 16))
    for run in (lambda p: export_file(str(rec), str(tmp_path / "o.pcapng"), progress=p),
                lambda p: redact_recording(str(rec), str(tmp_path / "r.rec"), Redactor([]), progress=p)):
        seen: list[tuple[int, int]] = []

        def note(done: int, total: int, into: list[tuple[int, int]] = seen) -> None:
            into.append((done, total))
        run(note)
        assert seen == [(1024, 3000), (2048, 3000)], seen
