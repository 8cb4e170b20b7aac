"""What a worker or dispatcher imports before it takes any work.

The task code imports its heavy modules on first use (fleet/worker/runtime.py), so a worker
installed without them would start, take jobs and end every one of them E_INTERNAL. ``check``
imports them at start-up instead: a missing module stops the process with one line that names the
module and the extra that installs it.
"""

from __future__ import annotations

import importlib

from fleet.core.errors import DependencyMissing

EXTRA = "worker"

# The third-party modules each role loads on first use, then the fleet modules it runs. The order
# matters for the message: lxml.html.clean re-raises a missing lxml_html_clean without its name, so
# lxml_html_clean is tried before trafilatura (which needs it through jusText).
_PREP = ("lxml_html_clean", "charset_normalizer", "trafilatura", "httpx",
         "fleet.prep.prepare", "fleet.prep.collect", "fleet.prep.tokens")
_INFER = ("httpx", "fleet.infer.attempts", "fleet.infer.vllm", "fleet.infer.validate")
NEEDS: dict[str, tuple[str, ...]] = {
    "prep": _PREP,
    "collect": _PREP,
    "infer": _INFER,
    "tools": ("fleet.infer.tools",),
    "all": (*_PREP, *_INFER, "fleet.infer.tools"),
    "dispatcher": ("prometheus_client", "httpx", "schedulers.dispatcher", "schedulers.metrics", "schedulers.scrape"),
}


def check(role: str) -> None:
    """Import everything ``role`` needs; raise DependencyMissing for the first that fails."""
    for module in NEEDS[role]:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing = exc.name or module
            reason = " ".join(str(exc).split())  # some ImportErrors span lines; the message is one
            raise DependencyMissing(
                f"{role} cannot start: importing {module} failed on module {missing!r} ({reason}); "
                f"install the {EXTRA!r} extra: pip install 'fleet[{EXTRA}]'") from exc
