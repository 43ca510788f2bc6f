"""What the eBPF recorder needs from the kernel, as capabilities, and which of them this process lacks.

Root is not required. Found by trying each on this kernel (6.x, bcc 0.26, tracefs mode 0700) as an
unprivileged user given capabilities with `setpriv --ambient-caps`:

    CAP_BPF             load the programs, create the maps
    CAP_PERFMON         attach them to tracepoints and uprobes in every process (perf_event_paranoid 2)
    CAP_DAC_READ_SEARCH read tracefs (root-only): the tracepoints' ids
    CAP_SYS_PTRACE      read other users' /proc/PID/{fd,maps,root}: open connections, TLS libraries
  and for TLS plaintext (uprobes on OpenSSL):
    CAP_DAC_OVERRIDE    bcc adds the uprobes through tracefs' uprobe_events (the perf uprobe PMU
                        wants CAP_SYS_ADMIN, which the recorder does not ask for)

`setcap cap_bpf,cap_perfmon,cap_dac_read_search,cap_sys_ptrace,cap_dac_override+eip` on a copy of the
interpreter, or a pod's securityContext.capabilities.add, gives exactly these.
"""

from __future__ import annotations

from pathlib import Path

CAPS = {"CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21,
        "CAP_PERFMON": 38, "CAP_BPF": 39}
RECORDER = ("CAP_BPF", "CAP_PERFMON", "CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE")
TLS = ("CAP_DAC_OVERRIDE",)


def effective(status: str | None = None) -> int:
    """This process's effective capability set (from /proc/self/status, or `status` text)."""
    text = status if status is not None else Path("/proc/self/status").read_text()
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def missing(needed: tuple[str, ...], have: int | None = None) -> list[str]:
    """The capabilities of `needed` not in the effective set (`have`: this process's unless given)."""
    have = effective() if have is None else have
    return [name for name in needed if not have >> CAPS[name] & 1]


def refusal(what: str, lacking: list[str], needed: tuple[str, ...]) -> str:
    """One line: what cannot run, which capabilities are missing, how to get them."""
    return (f"{what} needs {' + '.join(needed)}; this process lacks {', '.join(lacking)}: run as root, or grant "
            f"them (setcap {','.join(c.lower() for c in needed)}+eip on the interpreter, or a pod's "
            "securityContext.capabilities.add)")
