"""Fault injection: a Toxiproxy-compatible proxy, CPU contention, process and GPU faults.

Every fault is a context manager recorded in a crash-safe state file before it takes effect
(`faults.state`); `faults.cleanup.check_leftovers()` / `clear_leftovers()` undo what a killed run
left. Public entry points:

    faults.proxy.EmbeddedToxiproxy, faults.proxy.spawn_proxy_server     the proxy and its API
    faults.network.NetworkFaults                                        toxiproxy-python driver
    faults.cpu.cpu_contention, faults.cpu.cpu_quota                     CPU faults
    faults.process.paused, faults.process.pause_for, OwnedProcess       process faults
    faults.gpu.gpu_contention                                           GPU fault (CUDA only)
    faults.state.handle_signals, faults.state.FaultRegistry             nothing left behind
"""
