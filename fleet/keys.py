"""Every Redis key the fleet uses, in one place. All keys start with the configured prefix
(``key_prefix``, default ``fleet:``), so tests and several fleets can share one Redis database.

Jobs and results (fleet/results.py, fleet/client.py)
  {p}job:<id>                 hash   project, kind, state, submitted_at, job (prepared job JSON),
                                     plan (token plan JSON), custom fields; TTL result_ttl_s once final
  {p}result:<id>              string final Envelope JSON; TTL result_ttl_s; written exactly once
                                     (SET NX), which is what makes "one final Envelope" hold
  {p}events:<id>              stream per-job events (queued, admitted, attempt, delta, retry, final);
                                     TTL events_ttl_s. Client.result blocks on it with XREAD BLOCK
  {p}results:<project>        stream final Envelopes of one project, for consumer groups
  {p}rejected:<id>            string E_AUTH Envelope of a job that failed verification (kept apart
                                     from the claimed project's results); TTL result_ttl_s
  {p}rejections               stream operator-facing log of E_AUTH rejections (reason, claimed
                                     project, job id; never the secret or the payload)
  {p}idem:<project>:<key>     string job id of the first submission with that idempotency key
  {p}nonce:<project>:<nonce>  string set NX when a signed job is verified; TTL nonce_ttl_s
  {p}cancel:<id>              string set by ``fleet cancel``; running attempts watch it
  {p}attempts:<id>            list   attempt history (JSON) kept for carry-over between attempts
  {p}retry_budget:<project>   hash   sliding counters of first attempts and retries (retry budget)
  {p}tokcache:<sha256>        string cached /tokenize count for a piece of content

Dispatcher (schedulers/redis_store.py; its Lua scripts repeat this part of the schema)
  {p}d:pending:<project>      zset   pending job ids of a project, score = band/priority/seq order
  {p}d:item:<id>              hash   admission facts of a pending/in-flight job (tokens, band, ...)
  {p}d:projects               set    projects that have pending work
  {p}d:vtime                  hash   per-project virtual time (token-weighted fair queuing)
  {p}d:leases                 zset   in-flight job ids, score = lease expiry (unix ms)
  {p}d:lease:<id>             hash   fence, prompt tokens, kv tokens, long flag, admitted_at
  {p}d:state                  hash   in-flight count, reserved kv, long in-flight, bucket, last admit
  {p}d:fence                  string monotonically increasing fencing token counter
  {p}d:seq                    string arrival counter (original place in line)
  {p}d:wake                   list   pushed on release/submit; dispatchers BLPOP it (no polling)
  {p}d:backend                hash   last /metrics scrape of the backend (saturation gate)
  {p}d:stats                  hash   admissions and holds by reason
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "fleet:"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}"

    def result(self, job_id: str) -> str:
        return f"{self.prefix}result:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}events:{job_id}"

    def results(self, project: str) -> str:
        return f"{self.prefix}results:{project}"

    def rejected(self, job_id: str) -> str:
        return f"{self.prefix}rejected:{job_id}"

    @property
    def rejections(self) -> str:
        return f"{self.prefix}rejections"

    def idem(self, project: str, key: str) -> str:
        return f"{self.prefix}idem:{project}:{key}"

    def nonce(self, project: str, nonce: str) -> str:
        return f"{self.prefix}nonce:{project}:{nonce}"

    def cancel(self, job_id: str) -> str:
        return f"{self.prefix}cancel:{job_id}"

    def attempts(self, job_id: str) -> str:
        return f"{self.prefix}attempts:{job_id}"

    def retry_budget(self, project: str) -> str:
        return f"{self.prefix}retry_budget:{project}"

    def tokcache(self, digest: str) -> str:
        return f"{self.prefix}tokcache:{digest}"

    # -- dispatcher -------------------------------------------------------------------------
    @property
    def dispatch(self) -> str:
        """Prefix of every dispatcher key (``{p}d:``)."""
        return f"{self.prefix}d:"
