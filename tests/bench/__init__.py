"""Tests of fleet/bench: the benchmarks, shortened, and what a bench run leaves on the machine."""
