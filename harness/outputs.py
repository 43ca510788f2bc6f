"""Every JSON document shadowtest writes says what it is and which shadowtest wrote it.

    {"schema": "shadowtest.<kind>/v<N>", "shadowtest_version": "0.1.0", ...the document...}

`kind` names the output (docs/outputs.md lists them); N goes up when a field changes meaning or goes
away (a field added does not change it), so a consumer can refuse what it was not written for.

Each kind has a JSON Schema, harness/schemas/KIND.json (installed with the package): the fields every
document of that kind has and their types. With SHADOWTEST_CHECK_OUTPUTS set (the test suite sets it, so
every command a test runs checks what it writes), `stamped` validates each document against it.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness import __version__

# Exit codes (k6's convention): a run that ran and judged, but failed a check or threshold, exits 99; a run
# that could not run or be judged (an error, an interruption, lost accounting) exits 1; a usage error 2.
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_THRESHOLDS = 0, 1, 2, 99

VERSIONS = {"results": 1, "replay": 1, "record": 1, "record-finish": 1, "list-tls": 1, "inspect": 1, "import": 1,
            "export": 1, "merge": 1, "redact": 1, "infer": 1, "doctor": 1, "faults": 1, "traffic": 1,
            "capacity": 1, "validate": 1, "proxy": 1, "locust": 1}


def verdict_exit(passed: bool, broken: bool) -> int:
    """0 when it passed; 1 when the run itself broke (interrupted, accounting lost); else 99: it ran and
    a check or threshold failed."""
    return EXIT_OK if passed else EXIT_ERROR if broken else EXIT_THRESHOLDS


SCHEMAS = Path(__file__).resolve().parent / "schemas"
CHECK_ENV = "SHADOWTEST_CHECK_OUTPUTS"


class OutputSchemaError(ValueError):
    """A JSON document does not match its kind's schema (one line: which field, what is wrong)."""


def schema(kind: str) -> str:
    return f"shadowtest.{kind}/v{VERSIONS[kind]}"


def schema_file(kind: str) -> Path:
    return SCHEMAS / f"{kind}.json"


@functools.cache
def _validator(kind: str) -> Any:
    """The kind's schema, read and compiled once per process."""
    import jsonschema

    return jsonschema.Draft202012Validator(json.loads(schema_file(kind).read_text()))


def check_output(doc: Mapping[str, Any]) -> None:
    """Validate a stamped document against the JSON Schema of its `schema` (needs jsonschema, a dev
    dependency); OutputSchemaError naming the first field that does not match."""
    import jsonschema

    kind = str(doc.get("schema", "")).removeprefix("shadowtest.").rsplit("/", 1)[0]
    if kind not in VERSIONS:
        raise OutputSchemaError(f"output schema {doc.get('schema')!r} is not one of shadowtest's outputs")
    plain = json.loads(json.dumps(doc, default=str))   # as a consumer reads it (tuples are lists)
    error = jsonschema.exceptions.best_match(_validator(kind).iter_errors(plain))
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path) or "(top)"
        raise OutputSchemaError(f"output {doc['schema']} does not match {schema_file(kind).name} at {where}: "
                                f"{' '.join(error.message.split())[:300]}")


def stamped(kind: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """`doc` with `schema` and `shadowtest_version` first (a key of `doc` by those names is replaced)."""
    out = {"schema": schema(kind), "shadowtest_version": __version__,
           **{k: v for k, v in doc.items() if k not in ("schema", "shadowtest_version")}}
    if os.environ.get(CHECK_ENV):
        check_output(out)
    return out
