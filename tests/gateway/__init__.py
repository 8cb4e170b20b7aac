"""Tests of fleet/gateway: admission, keys, wire shapes, files and batches, and a lone ``fleet
gateway`` process."""
