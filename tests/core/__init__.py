"""Tests of fleet/core: configuration, codes, records and results, signing, limits, the Lua
scripts, the broker's persistence contract."""
