"""Replay a recording open-loop with its original timing and measure how well it did."""
