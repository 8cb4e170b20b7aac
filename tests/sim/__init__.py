"""Tests of fleet/sim: the simulator's engine, tokenizer, scenarios and API (a real ``fleet sim``
process)."""
