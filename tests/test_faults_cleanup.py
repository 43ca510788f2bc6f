"""Nothing left behind: faults undo themselves on exit and SIGTERM; after a SIGKILL,
`shadowtest faults clear` removes every toxic, cgroup limit and stress process, and never signals a
process whose PID was reused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from faults.cleanup import check_leftovers, clear_leftovers
from faults.errors import StateError
from faults.process import OwnedProcess, pause_for, paused
from faults.proxy import ProxyProcess, spawn_proxy_server
from faults.state import FaultRegistry, proc_start_time
from faults.testing import EchoServer
from wire.process import spawn

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

HOLDER = textwrap.dedent("""
    import sys, time
    from faults.network import NetworkFaults
    from faults.cpu import cpu_contention, cpu_quota
    from faults.process import paused
    from faults.state import handle_signals
    api, quota_pid, pause_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    nf = NetworkFaults(url=api).start()
    with handle_signals(), nf.toxic("p", "latency", {"latency": 100}), \\
            cpu_contention(workers=1, load_pct=50, cpus=[0], max_seconds=60) as c, \\
            cpu_quota(quota_pid, cpus=0.3) as q, paused(pause_pid):
        print("ready", " ".join(map(str, c.pids)), q.path, flush=True)
        time.sleep(60)
""")


def state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    try:
        return state_of(pid) != "Z"
    except OSError:
        return False


@pytest.fixture
def proxy_server() -> Iterator[ProxyProcess]:
    with EchoServer() as echo, spawn_proxy_server() as server:
        req = urllib.request.Request(server.url + "/proxies", method="POST",
                                     data=json.dumps({"name": "p", "upstream": echo.addr}).encode())
        urllib.request.urlopen(req, timeout=5).close()
        yield server


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [spawn(["sleep", "120"]) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def toxics(server: ProxyProcess) -> list[dict]:
    with urllib.request.urlopen(server.url + "/proxies/p/toxics", timeout=5) as r:
        return json.loads(r.read())


def start_holder(tmp_path: Path, server: ProxyProcess, sleepers: list[subprocess.Popen[bytes]],
                 state_dir: Path) -> tuple[subprocess.Popen[str], list[int], str]:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    env = dict(os.environ, SHADOWTEST_STATE_DIR=str(state_dir), PYTHONPATH=str(ROOT))
    holder = spawn([PY, str(script), server.url, str(sleepers[0].pid), str(sleepers[1].pid)],
                   stdout=subprocess.PIPE, stderr=None, text=True, env=env)
    assert holder.stdout is not None
    words = holder.stdout.readline().split()
    assert words and words[0] == "ready", "holder failed to apply its faults"
    return holder, [int(w) for w in words[1:-1]], words[-1]


@pytest.mark.root
def test_sigkill_then_faults_clear_leaves_nothing(tmp_path: Path, state_dir: Path, proxy_server: ProxyProcess,
                                                  sleepers: list[subprocess.Popen[bytes]]) -> None:
    quota_pid, pause_pid = sleepers[0].pid, sleepers[1].pid
    cgroup_before = Path(f"/proc/{quota_pid}/cgroup").read_text()
    holder, stress_pids, cg = start_holder(tmp_path, proxy_server, sleepers, state_dir)
    assert [t["name"] for t in toxics(proxy_server)] == ["latency_downstream"]
    assert state_of(pause_pid) == "T" and Path(cg).is_dir()
    holder.send_signal(signal.SIGKILL)
    holder.wait()

    left = check_leftovers(state_dir)
    assert sorted(x.entry["kind"] for x in left) == ["cgroup", "paused", "process", "toxic"]
    out = subprocess.run([PY, "-m", "harness.cli", "faults", "clear", "--json"], capture_output=True, text=True,
                         env=dict(os.environ, SHADOWTEST_STATE_DIR=str(state_dir)), cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["cleared"]) == 4
    assert toxics(proxy_server) == []  # toxic gone (through the API's reset)
    assert Path(f"/proc/{quota_pid}/cgroup").read_text() == cgroup_before and not Path(cg).exists()
    assert state_of(pause_pid) != "T"  # resumed
    time.sleep(0.2)
    assert not any(alive(p) for p in stress_pids)  # no stress process remains
    assert check_leftovers(state_dir) == [] and list(state_dir.glob("holder-*.json")) == []


@pytest.mark.root
def test_sigterm_undoes_everything_without_clear(tmp_path: Path, state_dir: Path, proxy_server: ProxyProcess,
                                                 sleepers: list[subprocess.Popen[bytes]]) -> None:
    cgroup_before = Path(f"/proc/{sleepers[0].pid}/cgroup").read_text()
    holder, stress_pids, cg = start_holder(tmp_path, proxy_server, sleepers, state_dir)
    holder.send_signal(signal.SIGTERM)
    assert holder.wait(timeout=30) == 128 + signal.SIGTERM
    assert toxics(proxy_server) == []
    assert Path(f"/proc/{sleepers[0].pid}/cgroup").read_text() == cgroup_before and not Path(cg).exists()
    assert state_of(sleepers[1].pid) != "T"
    time.sleep(0.2)
    assert not any(alive(p) for p in stress_pids)
    assert list(state_dir.glob("holder-*.json")) == []


def test_reused_pid_is_never_killed(state_dir: Path) -> None:
    victim = spawn(["sleep", "30"])
    try:
        start = proc_start_time(victim.pid)
        assert start is not None
        state_dir.mkdir(parents=True, mode=0o700)
        # A dead run recorded this PID with another start time: the PID now belongs to someone else.
        (state_dir / "holder-999999-1.json").write_text(json.dumps({
            "holder": {"pid": 999999, "start": 1},
            "entries": {"process-1": {"kind": "process", "procs": [{"pid": victim.pid, "start": start + 1,
                                                                    "group": True, "comm": "sleep"}]}}}))
        result = clear_leftovers(state_dir)
        assert result.ok and len(result.cleared) == 1
        assert victim.poll() is None  # still running
        assert list(state_dir.glob("holder-*.json")) == []
    finally:
        victim.kill()
        victim.wait()


def test_live_runs_are_not_leftovers(state_dir: Path) -> None:
    reg = FaultRegistry(state_dir)
    with reg.hold("paused", lambda e: None, pid=1, start=0):
        assert reg.path.exists() and oct(reg.path.stat().st_mode & 0o777) == "0o600"
        assert check_leftovers(state_dir) == []  # this process is alive: its faults are not leftovers
    assert not reg.path.exists()


def test_pause_resumes_after_duration_and_on_exit(state_dir: Path) -> None:
    p = spawn(["sleep", "30"])
    try:
        with paused(p.pid, duration_s=0.3) as info:
            assert state_of(p.pid) == "T"
            time.sleep(0.6)
            assert state_of(p.pid) != "T" and info.resumed_at is not None
            assert 0.28 <= info.resumed_at - info.paused_at <= 0.5  # 0.3 s (timer tolerance)
        info = pause_for(p.pid, 0.1)
        assert state_of(p.pid) != "T" and info.resumed_at is not None
        with pytest.raises(KeyboardInterrupt):
            with paused(p.pid):
                raise KeyboardInterrupt  # what SIGINT raises: the process must still be resumed
        assert state_of(p.pid) != "T"
    finally:
        p.kill()
        p.wait()


def test_owned_process_kill_and_restart(state_dir: Path) -> None:
    reg = FaultRegistry(state_dir)
    with OwnedProcess(["sleep", "30"], registry=reg) as proc:
        first = proc.pid
        proc.restart(downtime_s=0.1)
        assert proc.pid != first and proc.restarts == 1 and alive(proc.pid or 0)
        recorded = json.loads(reg.path.read_text())["entries"]
        assert [p["pid"] for e in recorded.values() for p in e["procs"]] == [proc.pid]
    assert not alive(proc.pid or 0) and not reg.path.exists()


# ---- the state directory is private, and what it holds is never trusted blindly -------------------

def _cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "harness.cli", "faults", *args], capture_output=True, text=True,
                          env=dict(os.environ, SHADOWTEST_STATE_DIR=str(state_dir)), cwd=ROOT, timeout=60)


def _one_line_refusal(out: subprocess.CompletedProcess[str], words: str) -> None:
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], out.stderr


def test_state_dir_is_created_private_whatever_the_umask(state_dir: Path) -> None:
    old = os.umask(0)
    try:
        reg = FaultRegistry(state_dir)
        with reg.hold("paused", lambda e: None, pid=1, start=0):
            assert oct(state_dir.stat().st_mode & 0o777) == "0o700" and state_dir.stat().st_uid == os.geteuid()
            assert oct(reg.path.stat().st_mode & 0o777) == "0o600"
    finally:
        os.umask(old)


@pytest.mark.parametrize("how", ["mode 0777", "symlink", "other owner"])
def test_an_unsafe_state_dir_is_refused_with_one_line(tmp_path: Path, state_dir: Path, how: str) -> None:
    if how == "other owner" and os.geteuid() != 0:
        pytest.skip("needs root to give the directory away")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    if how == "mode 0777":
        state_dir.mkdir()
        state_dir.chmod(0o777)
    elif how == "symlink":
        state_dir.symlink_to(real)
    else:
        state_dir.mkdir(mode=0o700)
        os.chown(state_dir, 65534, 65534)
    words = {"mode 0777": "has mode 0777; it must be private (0700)", "symlink": "is a symlink",
             "other owner": "is owned by uid 65534"}[how]
    with pytest.raises(StateError, match=words.replace("(", r"\(").replace(")", r"\)")):
        FaultRegistry(state_dir).register("paused", pid=1, start=0)
    for command in ("clear", "list"):
        _one_line_refusal(_cli(state_dir, command), words)
    assert list(real.iterdir()) == [] and list(Path(state_dir).iterdir() if not state_dir.is_symlink() else []) == []


def test_symlinks_in_the_state_dir_are_never_followed(tmp_path: Path, state_dir: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    reg = FaultRegistry(state_dir)
    state_dir.mkdir(mode=0o700)
    (state_dir / f".{reg.name}.tmp").symlink_to(victim)          # planted where the atomic write starts
    with reg.hold("paused", lambda e: None, pid=1, start=0):
        assert json.loads(reg.path.read_text())["entries"]   # written, through a fresh file
    assert victim.read_text() == "precious\n"
    (state_dir / "holder-999999-1.json").symlink_to(victim)
    with pytest.raises(StateError, match="is a symlink; refusing to follow it"):
        check_leftovers(state_dir)
    _one_line_refusal(_cli(state_dir, "clear"), "is a symlink")
    assert victim.read_text() == "precious\n"


def _plant(state_dir: Path, entries: dict[str, dict], holder_start: int = 1) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / f"holder-999999-{holder_start}.json"
    path.write_text(json.dumps({"holder": {"pid": 999999, "start": holder_start}, "entries": entries}))
    return path


@pytest.mark.root
def test_planted_entries_naming_foreign_paths_or_pids_are_refused(tmp_path: Path, state_dir: Path) -> None:
    victim, victim_dir = tmp_path / "victim", tmp_path / "victim-dir"
    victim.write_text("precious\n")
    victim_dir.mkdir()
    older = spawn(["sleep", "30"])                                  # ours, but older than the "run"
    # Popen, not spawn: another user's process (user=65534), which spawn has no parameter for
    foreign = subprocess.Popen(["sleep", "30"], user=65534)
    try:
        os.kill(foreign.pid, signal.SIGSTOP)
        older_start, foreign_start = proc_start_time(older.pid), proc_start_time(foreign.pid)
        assert older_start is not None and foreign_start is not None
        planted = _plant(state_dir, {
            "cgroup-0": {"kind": "cgroup", "version": 2, "files": [{"path": str(victim), "original": "max"}]},
            "cgroup-1": {"kind": "cgroup", "version": 2,
                         "files": [{"path": "/sys/fs/cgroup/cgroup.subtree_control", "original": "max"}]},
            "cgroup-2": {"kind": "cgroup", "version": 2, "created": str(victim_dir)},
            "cgroup-3": {"kind": "cgroup", "version": 2, "created": "/sys/fs/cgroup/../../" + str(victim_dir)},
            "cgroup-4": {"kind": "cgroup", "version": 2, "created": "/sys/fs/cgroup/system.slice"},
            "cgroup-5": {"kind": "cgroup", "version": 2,
                         "moves": [{"pid": older.pid, "start": older_start, "back": "/sys/fs/cgroup/cpu.max"}]},
            "process-6": {"kind": "process", "procs": [{"pid": older.pid, "start": older_start}]},
            "process-7": {"kind": "process", "procs": [{"pid": 1, "start": proc_start_time(1)}]},
            "paused-8": {"kind": "paused", "pid": foreign.pid, "start": foreign_start},
            "toxic-9": {"kind": "toxic", "api": f"file://{victim}", "proxy": "p", "toxic": "t"},
        }, holder_start=older_start + 1)
        before = planted.read_text()
        result = clear_leftovers(state_dir)
        assert result.cleared == [] and len(result.failed) == 10
        assert all("refused, nothing touched" in why for _, why in result.failed), result.failed
        reasons = " | ".join(why for _, why in result.failed)
        for words in ("is not a CPU limit file", "is not named shadowtest-999999-N", "not inside the cgroup mount",
                      "is not a cgroup.procs file", "started before the run", "PID 1 is not",
                      "belongs to uid 65534", "is not an http(s) URL"):
            assert words in reasons, (words, reasons)
        assert victim.read_text() == "precious\n" and victim_dir.is_dir()
        assert Path("/sys/fs/cgroup/system.slice").is_dir() or not Path("/sys/fs/cgroup/cgroup.controllers").exists()
        assert older.poll() is None and foreign.poll() is None
        assert Path(f"/proc/{foreign.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"  # not resumed
        assert json.loads(planted.read_text()) == json.loads(before)   # kept for a human to look at
        out = _cli(state_dir, "clear")
        assert out.returncode == 1 and "could NOT undo" in out.stdout and "refused" in out.stdout
    finally:
        for p in (older, foreign):
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def test_cgroup_paths_resolve_inside_the_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # cgroup v1 often mounts cpu at cpu,cpuacct with a `cpu` link: ours through the link is accepted;
    # a link that leads out of the mount is not.
    from faults import cpu
    from faults.cleanup import Leftover, refusal

    root, outside = tmp_path / "cgroup", tmp_path / "outside"
    (root / "cpu,cpuacct").mkdir(parents=True)
    outside.mkdir()
    (root / "cpu").symlink_to(root / "cpu,cpuacct")
    (root / "evil").symlink_to(outside)
    monkeypatch.setattr(cpu, "CGROUP_ROOT", root)

    def why(created: str) -> str | None:
        return refusal(Leftover(tmp_path / "h.json", 4242, "cgroup-1", {"kind": "cgroup", "created": created}))

    assert why(f"{root}/cpu/shadowtest-4242-1") is None
    assert why(f"{root}/cpu/shadowtest-4243-1") == (f"cgroup {root}/cpu/shadowtest-4243-1 is not named "
                                                   "shadowtest-4242-N (the run's own prefix)")
    assert "is not inside the cgroup mount" in str(why(f"{root}/evil/shadowtest-4242-1"))
    assert "is not inside the cgroup mount" in str(why(f"{root}/cpu/../../outside/shadowtest-4242-1"))
