"""Tests of fleet/infer: the attempt loop against ``fleet sim``, budgets, the loop watcher, carry-
over, output checks, tools, the vLLM client."""
