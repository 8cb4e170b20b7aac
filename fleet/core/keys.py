"""Every Redis key the fleet uses, in one place. All keys start with the configured prefix
(``key_prefix``, default ``fleet:``), so tests and several fleets can share one Redis database.

Job identity: a job is known by its *ref*, ``<project>/<id>`` (``job_ref``). Job ids are unique per
project, not across the fleet, so every job-scoped key, prep claim, dispatcher item and lease is
named by the ref: a project that submits another project's job id only ever touches its own
keys, and Redis ACLs (fleet/cli/acl.py) can grant a project's producer exactly the keys under its
own project (``{p}job:{<project>/*``). Project names are letters, digits, - and _ (settings), job
ids letters, digits and ``._:-`` (fleet/core/models.py), so a ref contains exactly one ``/`` and
no glob or hash-tag characters.

Hash tags: every key a Lua script touches is declared in its KEYS, and the keys of one script
share a hash tag (the part in braces), so they live in one Redis Cluster slot:
  - per-job keys carry the ref as tag (``{p}result:{<project>/<id>}``): PUBLISH touches the job's keys;
  - prep claims and the watchdog's zset carry ``{prep}``: RENEW/RELEASE touch a claim and the zset;
  - every dispatcher key carries ``{d}``: admission is one serialisation point anyway, and ADMIT,
    REAP, REQUEUE... touch the shared counters together with per-job items and leases.
The prefix comes first so that ``SCAN MATCH {p}*`` still finds every key of a fleet; a prefix
must not contain braces (its tag would then put every key in one slot). Two keys are not tagged
with their script's slot: ``{p}results:<project>`` (or ``{p}gwresults:<project>``) and
``{p}stats:codes``, which PUBLISH also writes (fleet/core/lua/publish.lua explains what a Cluster
move would need). The Celery broker's keys are kombu's and are left as kombu names them.

Jobs and results (fleet/core/results.py, fleet/client.py); <ref> = <project>/<id>
  {p}job:{<ref>}              hash   project, kind, state, submitted_at, signed (the message as
                                     submitted), digest (its sha256), created once by the producer
                                     (fleet/core/results.py: never overwritten); the prep worker
                                     adds job (prepared job JSON), plan (token plan JSON), seal (the
                                     workers' HMAC over both, fleet/core/seal.py); between two
                                     model turns also turn (the next turn's state JSON) and
                                     turn_seal (fleet/core/seal.py); a job the gateway submitted
                                     for an API key (a task, a batch line) also api_key and
                                     api_key_seal (the usage ledger's key, fleet/core/seal.py
                                     ``key_tag``); TTL result_ttl_s
  {p}result:{<ref>}           string final Envelope JSON; TTL result_ttl_s; written exactly once
                                     (SET NX), which is what makes "one final Envelope" hold
  {p}events:{<ref>}           stream per-job events (queued, admitted, attempt, delta, retry, final);
                                     TTL events_ttl_s. Client.result blocks on it with XREAD BLOCK
  {p}results:<project>        stream final Envelopes of one project, for consumer groups
  {p}gwresults:<project>      stream final Envelopes of one project's gateway requests (code,
                                     usage, timings; never text), for the operator's figures
                                     (fleet top): producers did not submit them, so they are kept
                                     out of the stream their consumer groups read
  {p}rejected:{<ref>}:<digest> string E_AUTH Envelope of a message that failed verification, keyed
                                     by the ref it claims and the sha256 of the whole message
                                     received, so only the submitter of that very message finds it
                                     (a forged message cannot make a real job look rejected)
  {p}rejections               stream operator-facing log of E_AUTH rejections (reason, claimed
                                     project, job id; never the secret or the payload)
  {p}idem:<project>:<key>     string job id of the first submission with that idempotency key
  {p}nonce:<project>:<nonce>  string set NX when a signed job is verified; TTL nonce_ttl_s
  {p}cancel:{<ref>}           string a signed cancel request of the job's project (fleet/core/seal.py
                                     ``sign_cancel``); ignored unless its signature verifies
  {p}{prep}:claim:<ref>       string the prep worker preparing the job; TTL prep_lease_s
  {p}{prep}:prepping:<project> zset  the project's jobs not yet handed over, score = when the prep
                                     watchdog looks at them (fleet/prep/watchdog.py)
  {p}attempts:{<ref>}         list   attempt history (JSON) kept for carry-over between attempts
  {p}tools:{<ref>}            hash   tool results of the job's tool rounds, field <round>:<call id>,
                                     sealed by the tool worker (fleet/infer/tools.py), and
                                     sent:<round> once the round's tasks are being sent; TTL
                                     result_ttl_s
  {p}retry_budget:<project>   hash   sliding counters of first attempts and retries (retry budget)
  {p}tokcache:<sha256>        string cached /tokenize count for a piece of content
  {p}sent:{<project>}:<sha256> string prompt tokens of a prompt (or stable prefix) the project sent
                                     recently, by the digest of its messages; TTL
                                     backend.prefix_cache_s, written once an attempt that sent
                                     it got a token back (fleet/core/promptcache.py); tagged by
                                     project, so one MGET reads a job's lookups in one slot
  {p}sent:{<project>}:<backend>:<sha256>  the same for what went to a backend other than the
                                     first (by its name)
  {p}stats:codes              hash   final results counted by "<project>|<code>" (for /metrics)
  {p}usage:{<project>}:h:<YYYYMMDDHH>
                              hash   the usage ledger (fleet/core/usage.py, docs/usage.md): one
                                     hash per project and UTC hour, fields "<key>|<model>|<metric>"
                                     (HINCRBY); TTL usage.retention_days, set again at each write.
                                     The project's producer user may read it, never write it
  {p}usage:{<project>}:open:<job id>
                              string the progress (JSON) of the job's turn streaming now, written
                                     by its inference worker at each lease renewal and deleted by
                                     the turn's count; one of another fence is a turn whose worker
                                     died: the job's next turn counts it (``UsageLedger.settle``);
                                     TTL usage.turn_marker_s
  {p}usage:{<project>}:t:<job id>:<fence>:<turn>
                              string the marker of one counted model turn, SET NX by the same
                                     script as the increments (a count happens once); TTL
                                     usage.turn_marker_s; no project user may read or write it
  {p}kquota:{<project>}:<key>:m:<minute>, ...:d:<YYYYMMDD>, ...:mo:<YYYYMM>
                              hash/string  a gateway API key's own quota windows (<key> its ledger
                                     name, sha256:<8 hex>), as the project's D quota:* keys
                                     (schedulers/store/keyquota.py); TTL 180 s, 3 days, 33 days
  {p}kquota:{<project>}:res   hash   gateway request ref -> its key quota reservation, until settled
  {p}rcache:{<project>}:e     hash   the project's exact-repeat cache (fleet/core/repeatcache.py,
                                     docs/usage.md): digest of a gateway request as it would go to
                                     vLLM -> the answer (JSON, with its expiry); TTL repeat_cache.ttl_s
  {p}rcache:{<project>}:x     zset   digest -> the entry's expiry (pruning, the max_entries bound)
  {p}rcache:{<project>}:s     hash   hits, misses, waits, stores, evictions
  {p}rcache:{<project>}:run:<digest>
                              string the gateway request computing that answer now (a redis-py
                                     Lock token, PX 30 s renewed): identical requests wait for it
                                     instead of running too; no project user may read any rcache key
  {p}rcache:{<project>}:jrun:<digest>
                              string the queue job computing that answer (its ref); PX wait_s
  {p}rcache:{<project>}:jwait:<digest>
                              set    queue jobs waiting for it (deferred in the store until then);
                                     PX wait_s + 60 s (fleet/worker/repeats.py)
  {p}metrics:leader           string the dispatcher exporting the fleet-wide metrics (redis-py
                                     Lock token; PX 15 s, extended by its owner)
  {p}gwgrants:<gateway>       list   grants (JSON: job id, fence, lease expiry) of one gateway process's
                                     requests, pushed by the dispatcher instead of a Celery task when
                                     the job hash has origin=gateway and gateway=<its id>; TTL
                                     lease_ttl_s; the gateway BLPOPs it (fleet/gateway/admission.py)
  {p}gwfile:{<project>/<file>} hash  an OpenAI file of the project (/v1/files): meta (the file
                                     object, JSON), content (the bytes); TTL gateway.files_ttl_s
  {p}gwfiles:<project>        zset   the project's file ids, score = created_at (listing, count cap)
  {p}gwfilebytes:<project>    hash   file id -> its size in bytes, for the project's byte quota
                                     (gateway.max_project_bytes); pruned with gwfiles
  {p}gwbatch:{<project>/<batch>} hash a batch of the project (/v1/batches): meta (the batch object),
                                     lines (line number, custom id, error, code, job id); TTL
                                     gateway.batch_window_s + files_ttl_s
  {p}gwbatches:<project>      zset   the project's batch ids, score = created_at
  {p}gwwake:<gateway>         stream one entry, added when a task-event follower joins, to wake the
                                     gateway's one XREAD over all followed events streams
                                     (fleet/gateway/events.py); TTL a day, deleted on shutdown

Broker (kombu, fleet/worker/app.py)
  {p}q:*                      Celery's queues, unacked sets and bindings (kombu global_keyprefix)

Dispatcher (schedulers/store/redis_store.py, its scripts in schedulers/store/lua/; D =
``{p}{d}:``, one hash tag for all, so a script may touch the shared counters and any job's keys)
  (the dispatcher knows a job by its ref, ``<project>/<id>``, written <id> below)
  D pending:<project>:<band>:<size>[:<elig>]
                              zset   pending job refs; band interactive|batch, size short|long
                                     (prompt over the first backend's long_prompt_tokens); elig
                                     the job's eligibility class, the bit mask of the backends it
                                     may run on (bit b: backend b in the settings' order), left
                                     out for 1 (the first backend only: a one-backend fleet's
                                     names); score = enqueued_at - priority * aging_s, in ms
                                     (fairshare.pending_score); enqueued_at is the prep
                                     worker's clock at hand-over (never the producer's submitted_at);
                                     an expired lease puts the job back at its original place
  D items                     hash   job id -> admission facts of a pending, in-flight or waiting
                                     job, one packed string "project band size prompt ..."
                                     (schedulers/store/records.py ``Item``: its fields in order,
                                     read by name in Python and Lua; its last field, elig, only
                                     when it is not 1); a field lives while the job is pending,
                                     leased (a lease needs it to requeue) or waiting
  D projects                  set    (project, eligibility class) groups that may have pending
                                     work: <project> for class 1, <project>:<elig> otherwise
                                     (pruned when found empty)
  D vtime                     hash   project -> finish tag F_p (start-time fair queuing,
                                     tokens/weight)
  D leases                    zset   in-flight job ids, score = lease expiry (unix seconds)
  D lease                     hash   job id -> its lease, one packed string "fence kv long ..."
                                     (schedulers/store/records.py ``Lease``); the index of the
                                     backend it was granted on (written when not 0) before the
                                     owner, set by the first claim; another owner's delivery is
                                     refused
  D deadlines                 zset   pending job ids with a deadline, score = deadline (unix s);
                                     removed at admission, cancel or expiry, back when an expired
                                     lease requeues the job
  D state                     hash   the first backend's (backend 0's) in_flight, kv, long, inter
                                     (interactive-band), claimed (sums over its live leases),
                                     bucket, bucket_at (prefill token bucket), prefill_until,
                                     prefill_longs (quiet long prefills: the window's end, long
                                     prefills in it), last_admit, blocked_job, blocked_since
                                     (head-of-line reservation); and the fleet's queued (pending
                                     jobs, so a script can tell "nothing pending" without reading
                                     queues it did not declare) and vtime (V)
  D bstate:<name>             hash   the same per-backend fields for each further backend (the
                                     second in the settings' order on): in_flight ... blocked_since
                                     of the leases granted on it (docs/backends.md)
  D fences                    hash   project -> fencing token counter (HINCRBY; every grant gets a new,
                                     larger one of its project's own sequence)
  D wake                      list   pushed on submit/release/readmit/promotion/expiry (capped at
                                     100); dispatchers BLPOP it (no polling)
  D backend                   hash   the first backend's last /metrics + /health scrape: scraped_at,
                                     hold (the gate's verdict), raw figures (schedulers/scrape.py)
  D backend:<name>            hash   the same for each further backend
  D stats                     hash   admissions, hold:<reason>
  D deferred                  zset   continuations waiting for their not-before time (a backoff,
                                     a tool round's timeout, brought forward by its last result),
                                     score = that time (unix s); promoted into their queue by the
                                     dispatcher (schedulers/store/base.py, Continuations); their
                                     item has pending 0, deferred <time>, no lease and no deadline
                                     entry
  D continuations             set    refs of jobs readmitted at least once (``fleet queues``); their
                                     item's cont is the number of the turn ``readmit`` last put
                                     in line (and deferred <time> while waiting); a release
                                     removes the ref with the item, ``continuations`` drops refs
                                     whose item is gone or no continuation
  D gateway                   zset   gateway requests that may be pending, score = deadline by
                                     Redis's clock (GATEWAY adds each and prunes those past it);
                                     with no live inference worker GWADMIT grants only these
  D quota:<project>:m:<minute> hash  t: quota cost held by the project's turns admitted in that
                                     minute (floor(unix / 60)), r: their number; TTL 180 s
                                     (schedulers/policy/quota.py, docs/usage.md "Quotas")
  D quota:<project>:d:<YYYYMMDD>, D quota:<project>:mo:<YYYYMM>
                              string the same cost for the UTC day (TTL 3 days) and month (33 days)
  D qres                      hash   job id -> its grant's quota reservation "project fence cost
                                     minute day month", until the turn settles (SETTLE)
  D workers                   zset   inference worker instances (``<node name>#<pid>-<nonce>``),
                                     score = when the entry lapses by Redis's clock
                                     (fleet/worker/heartbeat.py); no live entry holds admissions
                                     ("no_workers")
"""

from __future__ import annotations

from dataclasses import dataclass


def job_ref(project: str, job_id: str) -> str:
    """A job's identity in Redis: job ids are unique per project only."""
    return f"{project}/{job_id}"


def split_ref(ref: str) -> tuple[str, str]:
    """(project, job id) of a ref; ("", ref) for a string that is not one."""
    project, sep, job_id = ref.partition("/")
    return (project, job_id) if sep else ("", ref)


@dataclass(frozen=True)
class Keys:
    prefix: str = "fleet:"

    def job(self, ref: str) -> str:
        return f"{self.prefix}job:{{{ref}}}"

    def result(self, ref: str) -> str:
        return f"{self.prefix}result:{{{ref}}}"

    def events(self, ref: str) -> str:
        return f"{self.prefix}events:{{{ref}}}"

    def results(self, project: str) -> str:
        return f"{self.prefix}results:{project}"

    def gateway_results(self, project: str) -> str:
        return f"{self.prefix}gwresults:{project}"

    def rejected(self, ref: str, digest: str) -> str:
        return f"{self.prefix}rejected:{{{ref}}}:{digest}"

    @property
    def rejections(self) -> str:
        return f"{self.prefix}rejections"

    def idem(self, project: str, key: str) -> str:
        return f"{self.prefix}idem:{project}:{key}"

    def nonce(self, project: str, nonce: str) -> str:
        return f"{self.prefix}nonce:{project}:{nonce}"

    def cancel(self, ref: str) -> str:
        return f"{self.prefix}cancel:{{{ref}}}"

    def prep(self, ref: str) -> str:
        return f"{self.prefix}{{prep}}:claim:{ref}"

    def prepping(self, project: str) -> str:
        return f"{self.prefix}{{prep}}:prepping:{project}"

    def attempts(self, ref: str) -> str:
        return f"{self.prefix}attempts:{{{ref}}}"

    def tools(self, ref: str) -> str:
        return f"{self.prefix}tools:{{{ref}}}"

    def retry_budget(self, project: str) -> str:
        return f"{self.prefix}retry_budget:{project}"

    def tokcache(self, digest: str) -> str:
        return f"{self.prefix}tokcache:{digest}"

    def sent(self, project: str, digest: str, backend: str | None = None) -> str:
        """What ``project`` sent (fleet/core/promptcache.py): to the first backend, or to the one
        named ``backend`` (``promptcache.backend_tag``)."""
        if backend is None:
            return f"{self.prefix}sent:{{{project}}}:{digest}"
        return f"{self.prefix}sent:{{{project}}}:{backend}:{digest}"

    def gateway_grants(self, gateway: str) -> str:
        return f"{self.prefix}gwgrants:{gateway}"

    def gateway_file(self, ref: str) -> str:
        return f"{self.prefix}gwfile:{{{ref}}}"

    def gateway_file_body(self, ref: str) -> str:
        return f"{self.prefix}gwfilebody:{{{ref}}}"

    def gateway_files(self, project: str) -> str:
        return f"{self.prefix}gwfiles:{project}"

    def gateway_file_bytes(self, project: str) -> str:
        return f"{self.prefix}gwfilebytes:{project}"

    def gateway_batch(self, ref: str) -> str:
        return f"{self.prefix}gwbatch:{{{ref}}}"

    def gateway_batch_settled(self, ref: str) -> str:
        return f"{self.prefix}gwbatchdone:{{{ref}}}"

    def gateway_batches(self, project: str) -> str:
        return f"{self.prefix}gwbatches:{project}"

    def gateway_wake(self, gateway: str) -> str:
        return f"{self.prefix}gwwake:{gateway}"

    def usage_hour(self, project: str, hour: str) -> str:
        """The ledger's hash of one project and UTC hour (``hour`` is ``YYYYMMDDHH``)."""
        return f"{self.prefix}usage:{{{project}}}:h:{hour}"

    def usage_open(self, project: str, job_id: str) -> str:
        return f"{self.prefix}usage:{{{project}}}:open:{job_id}"

    def usage_turn(self, project: str, job_id: str, fence: int, turn: int) -> str:
        return f"{self.prefix}usage:{{{project}}}:t:{job_id}:{fence}:{turn}"

    def rcache(self, project: str, part: str) -> str:
        """The project's exact-repeat cache: ``e`` (entries), ``x`` (expiries), ``s`` (stats),
        ``run:<digest>`` (the gateway request computing that answer now), ``jrun:<digest>`` and
        ``jwait:<digest>`` (the queue job computing it, the queue jobs waiting for it)."""
        return f"{self.prefix}rcache:{{{project}}}:{part}"

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

    @property
    def infer_workers(self) -> str:
        return f"{self.dispatch}workers"
