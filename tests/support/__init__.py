"""What the test folders share: the test Redis and the corpora (``testenv``), one ``wait_until``
(``waiting``), the real-fleet harness (``fleet_harness``), and the helpers and fixtures more than
one test module uses. Test modules import from here, never from each other; the fixtures of
``worker_runtime`` are loaded for every folder by the root conftest (``pytest_plugins``)."""
