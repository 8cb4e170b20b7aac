"""The Grafana dashboard (deploy/grafana/fleet.json) and the Prometheus alerting rules
(deploy/prometheus/alerts.yml) proven against the code: one fleet (``fleet sim``, a dispatcher, an
inference worker, a gateway) runs a few jobs and a gateway request, holds one job in line, and its
``/metrics`` are scraped once; every metric, label matcher, ``by``/``without``/``on``/``ignoring``
label, legend ``{{label}}`` and alert ``{{ $labels.x }}`` the dashboard and the rules use must be
in that exposition.

PromQL is parsed by ``promql-parser`` (the Rust parser of the Prometheus ecosystem, with Python
bindings), never by a regular expression: an expression it cannot parse fails the test, as it
would fail in Prometheus. Labels that Prometheus adds at scrape time (``instance``, ``job``) are
the only ones allowed without being in the exposition. A ``code`` matcher's value must name (or,
as a regular expression, match) a message code of fleet/core/codes.py.

``promtool check rules`` runs on the rules when promtool is installed (Debian's ``prometheus``
package ships it: ``apt-get install prometheus``); without it that one test is skipped, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import promql_parser as promql
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleet.core.codes import Code
from fleet.local.embedded import free_port
from tests.support.fleet_harness import FleetProbe, Harness
from tests.support.gateway_support import METRICS_AUTH, config_with_keys
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "fleet.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
OPERATIONS = ROOT / "docs" / "operations.md"
TARGET_LABELS = frozenset({"instance", "job"})  # added by Prometheus when it scrapes a target
CODES = [code.value for code in Code]

Exported = dict[str, frozenset[str]]  # sample name -> the label names its series carry


# -- what the processes export -------------------------------------------------------------------
def scrape(port: int | str, path: str = "/metrics") -> list[Any]:
    # the gateway's /metrics needs its metrics key; the others ignore the header
    text = httpx.get(f"http://127.0.0.1:{port}{path}", headers=METRICS_AUTH, timeout=10).text
    return list(text_string_to_metric_families(text))


def exported_by(families: list[Any]) -> Exported:
    """Sample names (``fleet_results_total``, ``..._bucket``) with the labels seen on them."""
    found: dict[str, set[str]] = {}
    for family in families:
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in found.items()}


# -- what an expression uses -----------------------------------------------------------------------
@dataclass
class Check:
    exported: Exported
    problems: list[str] = field(default_factory=list)

    def selectors(self, node: Any) -> list[Any]:
        found: list[Any] = []
        promql.walk(node, pre_visit=lambda n: found.append(n) if isinstance(n, promql.VectorSelector) else None)
        return found

    def labels_of(self, selector: Any) -> frozenset[str]:
        return self.exported.get(metric_name(selector), frozenset()) | TARGET_LABELS

    def need_labels(self, labels: list[str], node: Any, where: str) -> None:
        """Every series that ``node`` selects carries each of ``labels``."""
        for selector in self.selectors(node):
            for label in labels:
                if label not in self.labels_of(selector):
                    self.problems.append(f"{where}: {metric_name(selector)} has no label {label!r}")

    def visit(self, node: Any) -> None:
        if isinstance(node, promql.VectorSelector):
            name = metric_name(node)
            if name not in self.exported:
                self.problems.append(f"metric {name!r} is not exported")
                return
            for matcher in [*node.matchers.matchers, *(m for ms in node.matchers.or_matchers for m in ms)]:
                if matcher.name == "__name__":
                    continue
                if matcher.name not in self.labels_of(node):
                    self.problems.append(f"{name}{{{matcher.name}...}}: no label {matcher.name!r}")
                elif matcher.name == "code" and not code_matches(matcher):
                    self.problems.append(f"{name}{{code {matcher.op} {matcher.value!r}}}: no such message code")
        elif isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            self.need_labels(list(node.modifier.labels), node.expr, f"{node.op} {node.modifier}")
        elif isinstance(node, promql.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None and matching.labels:
                for side in (node.lhs, node.rhs):
                    self.need_labels(list(matching.labels), side, str(matching))
            one_side = node.rhs if "ManyToOne" in str(node.modifier.card) else node.lhs
            if node.modifier.group_labels:
                self.need_labels(list(node.modifier.group_labels), one_side, "group labels")

    def expression(self, expr: str, shown_labels: set[str], where: str) -> None:
        """Check ``expr``, and that the labels its legend or annotations show are on its result."""
        before = len(self.problems)
        try:
            tree = promql.parse(expr)
        except Exception as exc:  # the parser's own error type is not exported
            self.problems.append(f"{where}: does not parse ({exc})")
            return
        promql.walk(tree, pre_visit=self.visit)
        self.problems[before:] = [f"{where}: {p}" for p in self.problems[before:]]
        result = self.result_labels(tree)
        for label in sorted(shown_labels - result):
            self.problems.append(f"{where}: shows {{{{{label}}}}}, which its result does not carry")

    def result_labels(self, node: Any) -> set[str]:
        """The labels an expression's result series carry (enough of PromQL for what is used)."""
        if isinstance(node, promql.VectorSelector):
            return set(self.labels_of(node))
        if isinstance(node, promql.MatrixSelector):
            return self.result_labels(node.vector_selector)
        if isinstance(node, promql.ParenExpr | promql.UnaryExpr | promql.SubqueryExpr):
            return self.result_labels(node.expr)
        if isinstance(node, promql.AggregateExpr):
            return self.aggregate_labels(node)
        if isinstance(node, promql.Call):
            return self.call_labels(node)
        if isinstance(node, promql.BinaryExpr):
            return self.binary_labels(node)
        return set()  # a number or a string

    def aggregate_labels(self, node: Any) -> set[str]:
        if node.modifier is None:
            return set()
        labels = set(node.modifier.labels)
        if node.modifier.type == promql.AggModifierType.By:
            return labels
        return self.result_labels(node.expr) - labels

    def call_labels(self, node: Any) -> set[str]:
        name = node.func.name
        if name == "absent":
            return set()
        vectors = [a for a in node.args if not isinstance(a, promql.NumberLiteral | promql.StringLiteral)]
        labels = self.result_labels(vectors[0]) if vectors else set()
        return labels - {"le"} if name == "histogram_quantile" else labels

    def binary_labels(self, node: Any) -> set[str]:
        if isinstance(node.lhs, promql.NumberLiteral):
            return self.result_labels(node.rhs)
        matching = node.modifier.matching if node.modifier is not None else None
        if matching is not None and "Include" in str(matching.type) and str(node.op) not in ("and", "or", "unless"):
            return set(matching.labels) | set(node.modifier.group_labels or [])
        return self.result_labels(node.lhs)


def metric_name(selector: Any) -> str:
    if selector.name:
        return str(selector.name)
    return next(m.value for m in selector.matchers.matchers if m.name == "__name__")


def code_matches(matcher: Any) -> bool:
    op, value = str(matcher.op), matcher.value
    if "Re" in op:  # Re, NotRe: anchored, as Prometheus anchors them
        return any(re.fullmatch(value, code) for code in CODES)
    return value in CODES


# -- what the dashboard and the rules say -----------------------------------------------------------
def dashboard_queries() -> list[tuple[str, str, set[str]]]:
    """(panel title, expression, labels its legend shows) of every query, rows' panels included."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in items:
            yield item
            yield from panels(item.get("panels", []))

    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [(panel["title"], target["expr"], set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))))
            for panel in panels(dashboard["panels"]) for target in panel.get("targets", [])]


def alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule for group in rules["groups"] for rule in group["rules"]]


def shown_in_annotations(rule: dict[str, Any]) -> set[str]:
    text = " ".join(str(v) for v in rule.get("annotations", {}).values())
    return set(re.findall(r"\$labels\.(\w+)", text))


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in markdown.splitlines() if line.startswith("#")}


# -- the fleet, scraped once -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """Everything a dispatcher (the metrics leader), an inference worker, a gateway and the backend
    export after jobs ended with several codes, a gateway request, and one job waiting in line."""
    config, keys = config_with_keys(tmp_path_factory.mktemp("dashboard"),
                                    backend={"max_num_seqs": 1},
                                    admission={"metrics_port": free_port()})
    harness = Harness(config, sim_speed=100, sim_args=["--max-num-seqs", "1"], gateway=True)
    worker_port = free_port()
    harness.fleet.extra_env["FLEET_WORKER_METRICS_PORT"] = str(worker_port)
    with harness:
        client, settings = harness.client, harness.settings
        gateway = f"http://127.0.0.1:{settings.gateway.port}"
        done = [client.submit({"project": "triage", "messages": [{"role": "user", "content":
                               "[sim:think=30] [sim:answer=10] fine"}]}),
                client.submit_raw({"id": "bad1", "project": "triage", "messages": "not a list"},
                                  project="triage", job_id="bad1")]
        assert {client.result(j, timeout=120).code for j in done} == {Code.OK, Code.E_INPUT_INVALID}
        reply = httpx.post(f"{gateway}/v1/chat/completions", timeout=120,
                           headers={"Authorization": f"Bearer {keys['assistant']}"},
                           json={"model": "local", "messages": [
                               {"role": "user", "content": "Hi. [sim:think=20] [sim:answer=5]"}]})
        assert reply.status_code == 200, reply.text
        # one job takes the only slot, the next waits in line: the queue's gauges have series
        staller = client.submit({"project": "reports", "messages": [
            {"role": "user", "content": "[sim:stall=100000] wait"}]})
        wait_until(lambda: client.status(staller).get("state") == "running", 60, "the staller to run")
        waiting = client.submit({"project": "research", "messages": [{"role": "user", "content": "next"}]})
        probe = FleetProbe(harness)
        wait_until(lambda: probe.snapshot().pending.get("research"), 60, "a job waiting in line")

        def scraped() -> Exported | None:
            try:
                families = [*scrape(settings.admission.metrics_port), *scrape(worker_port),
                            *scrape(settings.gateway.port), *scrape(harness.backend_url.rsplit(":", 1)[1])]
            except httpx.HTTPError:
                return None  # a process still starting
            found = exported_by(families)
            leader = any(s.value == 1 for f in families if f.name == "fleet_metrics_leader" for s in f.samples)
            # the leader's fleet-wide figures, the backend scraped once, the waiting job
            ready = (leader and "fleet_backend_scrape_age_seconds" in found
                     and "fleet_dispatch_oldest_pending_seconds" in found)
            return found if ready else None

        found = wait_until(scraped, 60, "the metrics leader's figures with the backend scraped and a job in line")
        for job in (staller, waiting):
            client.cancel(job)
        return found


@pytest.mark.slow
def test_the_dashboard_queries_only_what_the_processes_export(exported: Exported) -> None:
    check = Check(exported)
    queries = dashboard_queries()
    for title, expr, legend in queries:
        check.expression(expr, legend, f"panel {title!r}")
    assert len(queries) > 20 and check.problems == []
    # the gateway's, the workers', the dispatchers' and the backend's figures are all on it
    used = " ".join(expr for _, expr, _ in queries)
    assert all(f in used for f in ("fleet_gateway_", "fleet_worker_", "fleet_dispatch_", "vllm:"))


@pytest.mark.slow
def test_the_alert_rules_use_only_what_the_processes_export(exported: Exported) -> None:
    check = Check(exported)
    for rule in alert_rules():
        check.expression(rule["expr"], shown_in_annotations(rule), f"alert {rule['alert']}")
    assert check.problems == []


@pytest.mark.slow
def test_the_checks_catch_a_metric_or_label_that_is_not_exported(exported: Exported) -> None:
    """The checks above cannot pass by finding nothing: names and labels that are not exported,
    a code that does not exist and a legend label the result lacks are each reported."""
    check = Check(exported)
    check.expression("sum(rate(fleet_dispatch_admitted_total[1m]))", set(), "a")  # a name once in a draft
    check.expression("sum by (queue) (fleet_dispatch_pending)", set(), "b")
    check.expression('sum(rate(fleet_results_total{code="E_TIMEOUT"}[5m]))', set(), "c")
    check.expression('max(fleet_worker_ttft_seconds_bucket{model="x"})', set(), "d")
    check.expression("sum by (project) (fleet_dispatch_pending)", {"band"}, "e")
    check.expression("sum(fleet_dispatch_pending", set(), "f")
    assert [p.split(":")[0] for p in check.problems] == ["a", "b", "c", "d", "e", "f"], check.problems
    fine = Check(exported)
    fine.expression("sum by (project, band) (fleet_dispatch_pending)", {"project", "band"}, "ok")
    assert fine.problems == []


def test_every_alert_says_what_it_means_and_where_its_runbook_is() -> None:
    rules = alert_rules()
    names = {rule["alert"] for rule in rules}
    assert {"FleetBackendDown", "FleetBackendHeld", "FleetNoInferenceWorkers", "FleetQueueAgeGrowing",
            "FleetThinkLoopRateHigh", "FleetErrorRateHigh", "FleetBrokerUnsafe"} <= names
    headings = anchors(OPERATIONS.read_text(encoding="utf-8"))
    for rule in rules:
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        assert annotations["runbook"] == f"docs/operations.md#{rule['alert'].lower()}", rule["alert"]
        assert rule["alert"].lower() in headings, f"docs/operations.md has no heading {rule['alert']}"
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus ships it); "
                    "the rules' metrics and labels are still checked against the processes")
    out = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


# -- the figures the alerts read, read right ------------------------------------------------------------
def families_of(collector: Any) -> dict[str, Any]:
    return {f.name: f for f in collector.collect()}


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_the_alert_figures_say_what_they_mean(kind: str, redis_client: Any, key_prefix: str) -> None:
    """The oldest pending job per project (the head of its queues, across bands and sizes), the
    backend's state and the broker's settings, as the dispatcher's collectors export them."""
    import time

    from fleet.core.config import Settings
    from schedulers.metrics import BrokerPersistenceCollector, StoreCollector
    from schedulers.store import make_store
    from schedulers.store.base import PendingItem, StoreConfig
    from schedulers.store.memory_store import MemoryStore

    settings = Settings(key_prefix=key_prefix)
    store = MemoryStore(StoreConfig.from_settings(settings)) if kind == "memory" else make_store(settings, redis_client)
    now = time.time()
    for job_id, project, band, age in (("a", "triage", "batch", 50), ("b", "triage", "interactive", 300),
                                       ("c", "triage", "batch", 10), ("d", "reports", "batch", 20)):
        store.add_pending(PendingItem(job_id=job_id, project=project, prompt_tokens=100, max_new_tokens=100,
                                      band=band, priority=0, enqueued_at=now - age, deadline=None))
    store.record_backend(now, "kv", {"healthy": "1"})
    found = families_of(StoreCollector(store))
    oldest = {s.labels["project"]: s.value for s in found["fleet_dispatch_oldest_pending_seconds"].samples}
    assert oldest["triage"] == pytest.approx(300, abs=60) and oldest["reports"] == pytest.approx(20, abs=60)
    assert oldest["triage"] > oldest["reports"]
    assert [found[n].samples[0].value for n in ("fleet_backend_up", "fleet_backend_held")] == [1, 1]
    store.record_backend(now - 3600, "", {"healthy": "0"})  # a scraper that stopped an hour ago
    found = families_of(StoreCollector(store))
    assert [found[n].samples[0].value for n in ("fleet_backend_up", "fleet_backend_held")] == [0, 1]
    assert found["fleet_backend_scrape_age_seconds"].samples[0].value >= 3600

    class Info:
        def __init__(self, aof: int, policy: str) -> None:
            self.sections = {"persistence": {"aof_enabled": aof}, "memory": {"maxmemory_policy": policy}}

        def info(self, section: str) -> dict[str, Any]:
            return self.sections[section]

    for aof, policy, unsafe in ((1, "noeviction", {}), (0, "allkeys-lru", {"appendonly": 1, "maxmemory-policy": 1})):
        broker = families_of(BrokerPersistenceCollector(Info(aof, policy)))  # type: ignore[arg-type]
        values = {s.labels["setting"]: s.value for s in broker["fleet_broker_unsafe"].samples}
        assert values == {"appendonly": 0, "maxmemory-policy": 0, **unsafe}
