"""``fleet sim``: a vLLM OpenAI-compatible server simulator (docs/deployment.md's server).

Modules: ``profiles`` (deployment numbers, decode curve), ``tokenizer`` and ``template`` (token
counts), ``kvcache`` (block pool, prefix cache), ``engine`` (scheduler in simulated time),
``textgen``/``jsongen``/``plan`` (what a request generates), ``scenarios`` (test markers),
``validate``/``responses``/``app`` (HTTP), ``metrics`` (Prometheus), ``server`` (options, process
helper, CLI). docs/simulator.md documents it.
"""

from fleet.sim.server import SimOptions, SimProcess, free_port, serve, start_sim_process

__all__ = ["SimOptions", "SimProcess", "free_port", "serve", "start_sim_process"]
