"""Fault injection: a Toxiproxy-compatible proxy, CPU contention, process and GPU faults."""
