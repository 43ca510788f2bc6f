"""Alerts as deployed: a real Prometheus server scraping the target, evaluating the scenario's rule files.

    scenario.yaml                                  runner
      prometheus:                                    PrometheusServer (the `prometheus` binary, a child
        rules: [../deploy/prometheus/alerts-ci.yml]    process in its own session; config and TSDB in a
        interval: 1s                                   private temp folder; 127.0.0.1:<free port>)
                                                     scrapes the target's /metrics every `interval`,
                                                     evaluates the rules every `interval`
      expect:                                      after the run: query_range ALERTS{alertstate="firing"}
        - alert_fires: {phase: fault, source: prometheus}   -> Timeline.outside["prometheus"]

So the rules that page someone are what a run verifies, not the service's own idea of its alert.
Prometheus is ended by its PID (SIGTERM, then SIGKILL) and its folder removed, whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from harness.childserver import ChildServer
from harness.errors import RunError
from harness.scenario import PrometheusSpec
from harness.yamlnodes import Node

MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 1.0
MAX_RULE_FILES = 32
_READY_TIMEOUT_S = 60.0


def parse_prometheus(node: Node, base: Path) -> PrometheusSpec:
    """The scenario's `prometheus:` mapping: `rules` (files, relative to the scenario; each must exist)
    and `interval` (scrape and evaluation, 0.1 to 1 s, default 1s). Raises ScenarioError at its line."""
    entries = node.mapping("prometheus")
    unknown = sorted(set(entries) - {"rules", "interval"})
    if unknown:
        node.fail(f"prometheus: unknown key {unknown[0]!r}; expected rules, interval")
    if "rules" not in entries:
        node.fail("prometheus: missing 'rules' (a list of Prometheus rule files, relative to the scenario)")
    rules_node = entries["rules"]
    files = rules_node.strings("prometheus.rules")
    if not files or len(files) > MAX_RULE_FILES:
        rules_node.fail(f"prometheus.rules: expected 1 to {MAX_RULE_FILES} rule files, got {len(files)}")
    paths = []
    for item, name in zip(rules_node.sequence("prometheus.rules"), files, strict=True):
        path = (base / name).resolve()
        if not path.is_file():
            item.fail(f"prometheus.rules: no rule file {name!r} (looked for {path})")
        paths.append(str(path))
    interval = 1.0
    if "interval" in entries:
        interval = entries["interval"].duration("prometheus.interval")
        if not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:
            entries["interval"].fail(f"prometheus.interval {entries['interval'].text} must be between 100ms "
                                     "and 1s (scrape and evaluation; a run judges seconds)")
    return PrometheusSpec(rules=tuple(paths), interval_s=interval)


def find_binary() -> str | None:
    return shutil.which("prometheus")



def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


class PrometheusServer(ChildServer):
    """A private Prometheus for one run. `with PrometheusServer(spec, "http://127.0.0.1:9464/metrics"):`

    Raises RunError (one line, with the tail of its log) when it cannot start or never scrapes the target.
    """

    prefix, name, log_name, ready_timeout_s = "shadowtest-prom-", "Prometheus", "prometheus.log", _READY_TIMEOUT_S
    in_use = "address already in use"

    def __init__(self, spec: PrometheusSpec, metrics_url: str, binary: str | None = None) -> None:
        super().__init__(binary or find_binary())
        self.spec, self.metrics_url = spec, metrics_url
        self.url = ""

    def missing(self) -> str:
        return ("the scenario names Prometheus rules but no `prometheus` binary is on PATH "
                "(Debian: apt-get install prometheus; scripts/setup.sh installs it)")

    def _config(self) -> str:
        target = urllib.parse.urlsplit(self.metrics_url)
        every = _duration(self.spec.interval_s)
        config = {
            "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
            "rule_files": list(self.spec.rules),
            "scrape_configs": [{"job_name": "shadowtest-target", "metrics_path": target.path or "/metrics",
                                "scheme": target.scheme or "http",
                                "static_configs": [{"targets": [target.netloc]}]}],
        }
        return json.dumps(config)          # JSON is YAML

    def _prepare(self) -> None:
        Path(self.folder, "prometheus.yml").write_text(self._config())

    def _argv(self, port: int) -> list[str]:
        assert self.binary is not None
        folder = Path(self.folder)
        return [self.binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"]

    def _ready(self, port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1.0) as resp:  # noqa: S310
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _started(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_first_scrape()

    def _wait_first_scrape(self, timeout_s: float = 15.0) -> None:
        """Until the target has been scraped once (`up` == 1), so the run's first periods are seen."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                result = self.query("up")
                if any(float(r["value"][1]) == 1.0 for r in result):
                    return
            time.sleep(0.2)
        raise RunError(f"Prometheus at {self.url} never scraped {self.metrics_url} (up != 1 after "
                       f"{timeout_s:g}s)")

    def _api(self, path: str, params: dict[str, str]) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10.0) as resp:  # noqa: S310 -- loopback
            body = json.loads(resp.read().decode("utf-8", "replace"))
        if body.get("status") != "success":
            raise ValueError(f"Prometheus query failed: {body.get('error', body)}")
        return body["data"]["result"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self._api("query", {"query": expr}))

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """Matrix result of `expr` over [start, end] (unix seconds), at most 11,000 points per series."""
        step = max(step, (end - start) / 10_000)
        return list(self._api("query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                              "step": f"{step:.3f}"}))

    def firing(self, start_wall: float, end_wall: float, wall_at_t0: float) -> dict[str, Any]:
        """ALERTS{alertstate="firing"} over the run: {"alerts": {name: [[start_s, end_s|None], ...]},
        "step_s", "url", "rules"} with times in run seconds."""
        step = self.spec.interval_s
        rows = self.query_range('ALERTS{alertstate="firing"}', start_wall, end_wall, step)
        by_name: dict[str, set[float]] = {}
        for row in rows:
            name = str(row.get("metric", {}).get("alertname", ""))
            times = by_name.setdefault(name, set())
            for ts, value in row.get("values", []):
                if float(value) >= 1:
                    times.add(round(float(ts), 3))
        alerts = {name: _intervals(sorted(ts), step, end_wall, wall_at_t0) for name, ts in by_name.items()}
        return {"alerts": alerts, "step_s": step, "url": self.url, "rules": list(self.spec.rules)}


def _intervals(times: list[float], step: float, end_wall: float, wall_at_t0: float) -> list[list[float | None]]:
    """Consecutive firing samples (at most 1.5 steps apart) as [start, end] in run seconds; end None
    when still firing at the last step."""
    out: list[list[float | None]] = []
    for ts in times:
        if out and out[-1][1] is not None and ts - (out[-1][1] + wall_at_t0) <= step * 1.5 + 1e-6:
            out[-1][1] = round(ts - wall_at_t0, 3)
        else:
            out.append([round(ts - wall_at_t0, 3), round(ts - wall_at_t0, 3)])
    for iv in out:
        end = iv[1]
        if end is not None and end + wall_at_t0 >= end_wall - step * 1.5:
            iv[1] = None
        elif end is not None:
            iv[1] = round(end + step, 3)     # it stopped firing by the next evaluation
    return out


