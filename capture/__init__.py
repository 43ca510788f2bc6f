"""Record TCP traffic (eBPF, pcap, proxy), decode it, and keep it in one recording file."""
