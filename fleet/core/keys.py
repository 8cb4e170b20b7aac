"""Every Redis key the fleet uses, in one place. All keys start with the configured prefix
(``key_prefix``, default ``fleet:``), so tests and several fleets can share one Redis database.

Hash tags: every key a Lua script touches is declared in its KEYS, and the keys of one script
share a hash tag (the part in braces), so they live in one Redis Cluster slot:
  - per-job keys carry the job id as tag (``{p}result:{<id>}``): PUBLISH touches the job's keys;
  - prep claims and the watchdog's zset carry ``{prep}``: RENEW/RELEASE touch a claim and the zset;
  - every dispatcher key carries ``{d}``: admission is one serialisation point anyway, and ADMIT,
    REAP, REQUEUE... touch the shared counters together with per-job items and leases.
The prefix comes first so that ``SCAN MATCH {p}*`` still finds every key of a fleet; a prefix
must not contain braces (its tag would then put every key in one slot). Two keys are not tagged
with their script's slot: ``{p}results:<project>`` and ``{p}stats:codes``, which PUBLISH also
writes (fleet/core/lua/publish.lua explains what a Cluster move would need). The Celery
broker's keys are kombu's and are left as kombu names them.

Jobs and results (fleet/core/results.py, fleet/client.py)
  {p}job:{<id>}               hash   project, kind, state, submitted_at, job (prepared job JSON),
                                     plan (token plan JSON), custom fields; TTL result_ttl_s once final
  {p}result:{<id>}            string final Envelope JSON; TTL result_ttl_s; written exactly once
                                     (SET NX), which is what makes "one final Envelope" hold
  {p}events:{<id>}            stream per-job events (queued, admitted, attempt, delta, retry, final);
                                     TTL events_ttl_s. Client.result blocks on it with XREAD BLOCK
  {p}results:<project>        stream final Envelopes of one project, for consumer groups
  {p}rejected:<nonce>         string E_AUTH Envelope of a message that failed verification, keyed by
                                     the message's nonce (never by the job id it claims, so a forged
                                     message cannot hide a real job's result); TTL result_ttl_s
  {p}rejections               stream operator-facing log of E_AUTH rejections (reason, claimed
                                     project, job id; never the secret or the payload)
  {p}idem:<project>:<key>     string job id of the first submission with that idempotency key
  {p}nonce:<project>:<nonce>  string set NX when a signed job is verified; TTL nonce_ttl_s
  {p}cancel:{<id>}            string set by ``fleet cancel``; running attempts watch it
  {p}{prep}:claim:<id>        string the prep worker preparing the job; TTL prep_lease_s
  {p}{prep}:prepping          zset   jobs not yet handed over, score = when the prep watchdog
                                     looks at them (fleet/prep/watchdog.py)
  {p}attempts:{<id>}          list   attempt history (JSON) kept for carry-over between attempts
  {p}retry_budget:<project>   hash   sliding counters of first attempts and retries (retry budget)
  {p}tokcache:<sha256>        string cached /tokenize count for a piece of content
  {p}stats:codes              hash   final results counted by "<project>|<code>" (for /metrics)
  {p}metrics:leader           string the dispatcher exporting the fleet-wide metrics (redis-py
                                     Lock token; PX 15 s, extended by its owner)
  {p}gwgrants:<gateway>       list   grants (JSON: job id, fence, lease expiry) of one gateway process's
                                     requests, pushed by the dispatcher instead of a Celery task when
                                     the job hash has origin=gateway and gateway=<its id>; TTL
                                     lease_ttl_s; the gateway BLPOPs it (fleet/gateway/admission.py)

Broker (kombu, fleet/worker/app.py)
  {p}q:*                      Celery's queues, unacked sets and bindings (kombu global_keyprefix)

Dispatcher (schedulers/store/redis_store.py; its docstring repeats this part with the scripts;
D = ``{p}{d}:``, one hash tag for all)
  D pending:<project>:<band>:<size>
                              zset   pending job ids; band interactive|batch, size short|long
                                     (prompt over backend.long_prompt_tokens); score =
                                     enqueued_at - priority * aging_s, in ms (fixed at submission:
                                     an expired lease puts the job back at its original place)
  D item:<id>                 hash   admission facts of a pending/in-flight job: project band size
                                     prompt max_new kv long enq score pending(1|0) deadline
  D projects                  set    projects that may have pending work
  D vtime                     hash   per-project finish tag (token-weighted fair queuing)
  D leases                    zset   in-flight job ids, score = lease expiry (unix seconds)
  D lease:<id>                hash   fence, kv tokens, long flag, expires, admitted_at, project,
                                     owner (set by the first claim; another owner is refused)
  D deadlines                 zset   pending job ids with a deadline, score = deadline (unix s);
                                     removed at admission, cancel or expiry
  D state                     hash   in_flight, kv, long (sums over live leases), queued (pending
                                     jobs), bucket, bucket_at, last_admit, blocked_job,
                                     blocked_since, vtime
  D fence                     string monotonically increasing fencing token counter
  D wake                      list   pushed on submit/release/expiry (capped at 100);
                                     dispatchers BLPOP it (no polling)
  D backend                   hash   last /metrics + /health scrape: scraped_at, hold, figures
  D stats                     hash   admissions, hold:<reason>
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "fleet:"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}job:{{{job_id}}}"

    def result(self, job_id: str) -> str:
        return f"{self.prefix}result:{{{job_id}}}"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}events:{{{job_id}}}"

    def results(self, project: str) -> str:
        return f"{self.prefix}results:{project}"

    def rejected(self, nonce: str) -> str:
        return f"{self.prefix}rejected:{nonce}"

    @property
    def rejections(self) -> str:
        return f"{self.prefix}rejections"

    def idem(self, project: str, key: str) -> str:
        return f"{self.prefix}idem:{project}:{key}"

    def nonce(self, project: str, nonce: str) -> str:
        return f"{self.prefix}nonce:{project}:{nonce}"

    def cancel(self, job_id: str) -> str:
        return f"{self.prefix}cancel:{{{job_id}}}"

    def prep(self, job_id: str) -> str:
        return f"{self.prefix}{{prep}}:claim:{job_id}"

    @property
    def prepping(self) -> str:
        return f"{self.prefix}{{prep}}:prepping"

    def attempts(self, job_id: str) -> str:
        return f"{self.prefix}attempts:{{{job_id}}}"

    def retry_budget(self, project: str) -> str:
        return f"{self.prefix}retry_budget:{project}"

    def tokcache(self, digest: str) -> str:
        return f"{self.prefix}tokcache:{digest}"

    def gateway_grants(self, gateway: str) -> str:
        return f"{self.prefix}gwgrants:{gateway}"

    @property
    def code_counts(self) -> str:
        return f"{self.prefix}stats:codes"

    @property
    def metrics_leader(self) -> str:
        return f"{self.prefix}metrics:leader"

    # -- dispatcher -------------------------------------------------------------------------
    @property
    def dispatch(self) -> str:
        """Prefix of every dispatcher key (``{p}{d}:``: one hash tag, one Cluster slot)."""
        return f"{self.prefix}{{d}}:"
