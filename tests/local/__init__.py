"""Tests of fleet/local: local process groups (``fleet up``) and their signals."""
