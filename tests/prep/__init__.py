"""Tests of fleet/prep: collection, trimming, token counts, the prepared prompt, the prep watchdog
and the uncached-token estimate."""
