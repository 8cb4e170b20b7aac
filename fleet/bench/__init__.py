"""Benchmarks of the fleet and its simulator; each module exposes a plain function returning rows
and printing a rich table (registered as ``fleet bench <name>`` by the CLI)."""
