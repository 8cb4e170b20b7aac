"""What the fleet's tasks (fleet/worker/tasks.py) do to a job, one module per task: ``prep``,
``cancel``, ``infer`` and ``tool``, and what they share in ``common``. Each takes the worker's
``Runtime`` (fleet/worker/runtime.py) and returns what became of the job, as the task's outcome.
"""
