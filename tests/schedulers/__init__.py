"""Tests of schedulers: the admission store (both stores), fair share, the backend gate and the
dispatcher loop and processes."""
