"""Tests of fleet/worker: the task functions driven in one process, routing, the queue stamp,
heartbeats and what a worker shows."""
