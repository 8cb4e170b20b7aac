from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.worker.queues import INFER_TASK, PREP_TASK, UNROUTED_QUEUE, make_router


def route(name, **kwargs):
    return make_router(load_settings(EXAMPLE_CONFIG, env={}))(name, (), kwargs, {})


def test_ready_jobs_collect_jobs_and_strangers_go_to_their_own_queues():
    ready = {"job": {"messages": [{"role": "user", "content": "x"}]}}
    collecting = {"job": {"sources": [{"type": "url", "url": "http://x"}]}}
    assert route(PREP_TASK, project="triage", signed=ready) == {"queue": "fleet.triage"}
    assert route(PREP_TASK, project="triage", signed=collecting) == {"queue": "fleet.triage.collect"}
    assert route(PREP_TASK, project="ghost", signed=ready) == {"queue": UNROUTED_QUEUE}
    assert route(PREP_TASK, project="triage", signed="garbage") == {"queue": "fleet.triage"}
    assert route(INFER_TASK, job_id="j", project="triage", fence=1) == {"queue": "fleet.infer"}
