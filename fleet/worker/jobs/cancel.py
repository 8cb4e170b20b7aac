"""The cancel task's work (``fleet.cancel``, queue fleet.<project>, kwargs project, job_id; sent by
fleet.Client.cancel): act only on a cancel request signed by the project (``{p}cancel:{<ref>}``),
publish E_CANCELLED for a job not running yet and take it out of the dispatcher (``end_unleased``,
fleet/worker/jobs/common.py); a running job is left to its lease keeper, a final one stays final.

Failure cases: a cancel with no request signed by the project is refused (one WARNING); Redis
errors go up to the task.
"""

from __future__ import annotations

import logging

from fleet.core.codes import Code
from fleet.core.keys import job_ref
from fleet.worker.jobs.common import cancel_requested, end_unleased
from fleet.worker.runtime import Runtime

log = logging.getLogger(__name__)


def cancel_job(rt: Runtime, project: str, job_id: str) -> str:
    ref = job_ref(str(project), str(job_id))
    if not cancel_requested(rt, ref):
        log.warning("cancel of job=%s refused: no request signed by project %s", ref, project)
        return "refused"
    state = rt.results.job_record(ref).get("state", "")
    if state in ("running", "final"):
        return state  # a running job's lease keeper sees the request; a final one stays final
    if state in ("pending", "submitted"):
        # "submitted": not prepared yet; its prep task sees the request and stops anyway
        end_unleased(rt, ref, Code.E_CANCELLED, "cancelled while queued")
    return "cancelled"
