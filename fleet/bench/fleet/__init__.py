"""``fleet bench dispatch`` (whole-fleet part): the dispatcher benchmarks that need every process of
the fleet, every figure next to its baseline measured in the same run, against one ``fleet sim``.

Scenarios (``suite.fleet_bench(only=...)``, rows of scenario / figure / value / target / verdict),
one module each:
  fairness      one project submits 10x the others: token shares while all are backlogged, Jain's
                index, a small project's p95 wait vs the same run without the big project
  saturation    N short jobs: mean in-flight / cap, the simulator's peak, tok/s vs an ideal closed
                loop of ``cap`` streams, and five independent clients x 16 straight at the sim
  long_prompts  10% real 60K-token prompts: long in-flight, short-job p95 with / without them, with
                the default and a paced prefill bucket; a 32-thread FIFO and five clients x 16
  mix           the same 10%-long jobs as batch only, interactive beside batch and the deployment's
                mix: in-flight / cap, output tok/s and makespan against one FIFO, short-job p95
                (interactive where there are any) against the short jobs alone
  crash         kill -9 of one of two workers five times (a replacement started each time):
                exactly one Envelope per job, time from kill to the backend back at cap
  idle          one tiny job at a time through ``fleet.Client`` on an idle fleet: the time of each
                hop (``IDLE_HOPS``) and the latency the fleet adds to the backend's own

The parts they share: ``workload`` (job specs, mixes, the long document, jobs and request bodies),
``harness`` (``FleetBench``: the fleet as real processes, a dispatcher per phase; ``FleetRun``),
``direct`` (the in-bench clients that send the same bodies straight at the simulator),
``sampler`` (``/sim/stats`` every 50 ms), ``render`` (rows, their cells, table and markdown);
percentiles and CPU come from fleet/bench/measure.py.

Measuring:
  * mean in-flight over a window is the simulator's own time integral (``running_seconds`` over
    ``sim_time``), tokens per second its ``generation_tokens`` over real time.
  * the busy period is the first to the last admission (fleet: an infer task starting, from the
    envelopes' timings; direct clients: the first and last request sent): the backlog was
    non-empty all along.
  * latency "service" = admitted (fleet) / sent (direct) -> final; "e2e" = phase start -> final.
  * CPU: each child process's utime+stime from /proc and the whole machine's busy share over
    the phase, so a CPU-bound shortfall shows as such.
"""
