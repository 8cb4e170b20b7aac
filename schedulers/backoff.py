"""Back-off between failed dispatcher rounds."""

from __future__ import annotations


class Backoff:
    """Waits after a failed round: ``first_s``, doubling up to ``max_s``; ``reset`` on success."""

    def __init__(self, first_s: float = 0.5, max_s: float = 5.0) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._next_s = first_s

    def next_s(self) -> float:
        wait_s = self._next_s
        self._next_s = min(self.max_s, wait_s * 2)
        return wait_s

    def reset(self) -> None:
        self._next_s = self.first_s
