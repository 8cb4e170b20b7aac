"""Tests of fleet/cli: the operator's commands (acl, demo, plan, top, tail, outages) as an operator
meets them."""
