"""End to end: the whole fleet as real processes (``fleet sim``, dispatchers, Celery workers, the
gateway, Redis). Every test that starts the fleet is marked slow."""
