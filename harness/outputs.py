"""Every JSON document shadowtest writes says what it is and which shadowtest wrote it.

    {"schema": "shadowtest.<kind>/v<N>", "shadowtest_version": "0.1.0", ...the document...}

`kind` names the output (docs/conventions.md lists them); N goes up when a field changes meaning or goes
away (a field added does not change it), so a consumer can refuse what it was not written for.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def schema(kind: str) -> str:
    return f"shadowtest.{kind}/v{VERSIONS[kind]}"


def stamped(kind: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """`doc` with `schema` and `shadowtest_version` first (a key of `doc` by those names is replaced)."""
    return {"schema": schema(kind), "shadowtest_version": __version__,
            **{k: v for k, v in doc.items() if k not in ("schema", "shadowtest_version")}}
