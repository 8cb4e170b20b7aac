"""The simulated vLLM engine: scheduler, chunked prefill, decode, KV blocks, preemption.

Time: the engine keeps a simulated clock ``t`` (seconds). ``sim_now()`` is real elapsed time times
``speed``. One asyncio task (``run``) repeatedly advances ``t`` by at least one *tick* of
simulated time (``tick_real_s * speed``, catching up when it fell behind), sleeps until real time
reaches the new ``t``, and only then tells the affected sequences how many tokens they now have.
So at high speed one wake-up stands for many decode steps, and the cost per simulated second stays
flat: about 10-50 engine wake-ups per real second whatever the load.

Inside an advance, the engine runs vLLM's V1 loop step by step, but in bulk where nothing changes:

1. Admit waiting sequences (FIFO) while fewer than ``max_num_seqs`` run and the pool has blocks
   for the head's first chunk; the first admission looks the prompt up in the prefix cache, and
   cached tokens count as already computed.
2. If any running sequence is still prefilling, take ONE step: every decoding sequence gets one
   token and the rest of the ``max_num_batched_tokens`` budget goes to prefill chunks (oldest
   first). The step lasts ``decode_step(n) + prefill_tokens / prefill_tokens_per_s``, which is how
   a long prompt slows everybody decoding beside it. vLLM's chunked-prefill flags shape the
   chunks: with ``--long-prefill-token-threshold`` T set (or implied: 4% of ``max_model_len`` when
   ``--max-num-partial-prefills`` > 1), no sequence gets more than T prompt tokens a step, so a
   long prompt leaves budget to the prompts behind it; with ``--max-num-partial-prefills`` > 1, at
   most that many prompts take chunks in one step, and at most ``--max-long-partial-prefills`` of
   them longer than T (a long prompt over that count waits and the short ones behind it go). With
   vLLM's defaults (1, 1, 0) the chunks are as without the flags, as in vLLM's V1 scheduler.
3. Otherwise take ``k`` decode-only steps at once (each lasting ``n / aggregate(n)``), where ``k``
   stops at the next event: a sequence finishing, a stall point, a held sequence resuming, or the
   end of the tick.

Blocks are taken as tokens are computed; when the pool runs dry the newest running sequence is
preempted: its blocks are freed and it goes back to the head of the queue, to recompute its prompt
plus what it generated so far (``num_preemptions`` grows; its client just sees a pause).

Holds model the slow-first-token and stall scenarios: a held sequence keeps its slot and blocks but
does not decode until ``hold_until``.

Aborts (client disconnects) and ``kill`` (engine death) take effect immediately, outside the loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from fleet.sim.kvcache import BlockPool, PrefixCache
from fleet.sim.profiles import SimProfile

log = logging.getLogger(__name__)


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. Written by the engine; read by the response writer."""

    request_id: str
    prompt_len: int
    hashes: list[int]
    total: int
    finish_reason: str = "stop"
    long: bool = False
    slow_first_s: float = 0.0
    stall_at: int | None = None
    stall_s: float = 0.0
    state: SeqState = SeqState.WAITING
    computed: int = 0
    target: int = 0
    generated: int = 0
    visible: int = 0
    closed: bool = False
    blocks: int = 0
    hold_until: float = -math.inf
    queried: bool = False
    prompt_counted: bool = False
    cached_tokens: int = 0
    arrival_t: float = 0.0
    admitted_t: float | None = None
    first_token_t: float | None = None
    finish_t: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def active(self) -> bool:
        return self.state in (SeqState.WAITING, SeqState.RUNNING)


@dataclass
class EngineStats:
    total_requests: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    max_running_seen: int = 0
    max_waiting_seen: int = 0
    max_long_running_seen: int = 0
    running_seconds: float = 0.0
    waiting_seconds: float = 0.0
    busy_seconds: float = 0.0
    prefill_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(
        self,
        profile: SimProfile,
        speed: float = 1.0,
        tick_real_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_finish: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.profile = profile
        self.speed = speed
        self.tick_real_s = tick_real_s or min(0.1, max(0.02, 0.005 * speed))
        self._clock = clock
        self._t0 = clock()
        self.t = 0.0
        self.on_finish = on_finish or (lambda seq: None)
        self.pool = BlockPool(profile.kv_pool_tokens, profile.block_tokens)
        self.cache = PrefixCache(self.pool.total, profile.block_tokens)
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.stats = EngineStats()
        self.dead_until: float = -math.inf
        self._touched: set[Sequence] = set()
        self._wake = asyncio.Event()

    # -- clock -----------------------------------------------------------------------------
    def sim_now(self) -> float:
        return (self._clock() - self._t0) * self.speed

    @property
    def dead(self) -> bool:
        return self.sim_now() < self.dead_until

    # -- API used by the HTTP layer ----------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if not self.running and not self.waiting:
            # an idle engine's step clock stops; catch it up, or this request would be admitted
            # at a step time before its own arrival (a negative queue time)
            self.t = max(self.t, self.sim_now())
        seq.arrival_t = max(self.sim_now(), self.t)
        seq.target = seq.prompt_len
        self.waiting.append(seq)
        self.stats.total_requests += 1
        self._admit()  # a free slot is taken at once, as vLLM's next step would
        # the peak is taken after admission: a request that found a free slot never waited
        self.stats.max_waiting_seen = max(self.stats.max_waiting_seen, len(self.waiting))
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """Client went away: free the slot and blocks now."""
        if not seq.active:
            return
        self._remove(seq)
        seq.state = SeqState.ABORTED
        seq.finish_t = self.t
        self.stats.aborted += 1
        self._count_reason("abort")
        self._close(seq)

    def kill(self, for_s: float) -> None:
        """Engine death: every in-flight sequence fails; ``dead`` for ``for_s`` seconds."""
        self.dead_until = self.sim_now() + for_s
        for seq in list(self.running) + list(self.waiting):
            self._remove(seq)
            seq.state = SeqState.FAILED
            self.stats.failed += 1
            self._close(seq)

    def revive(self) -> None:
        self.dead_until = -math.inf

    def reset_stats(self) -> None:
        self.stats = EngineStats(max_running_seen=len(self.running),
                                 max_waiting_seen=len(self.waiting),
                                 max_long_running_seen=self._long_running())
        self.cache.clear_counters()

    @property
    def kv_usage(self) -> float:
        return self.pool.usage()

    # -- main loop --------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                self.t = max(self.t, self.sim_now())
            tick = self.tick_real_s * self.speed
            self.advance_until(max(self.t + tick, self.sim_now()))
            delay_s = (self.t - self.sim_now()) / self.speed
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            self._notify()

    def advance_until(self, target_t: float) -> None:
        while self.t < target_t:
            self._admit()
            if not self.running:
                self.t = target_t
                break
            decoding = [s for s in self.running if self._decodable(s)]
            if any(s.computed < s.target for s in self.running):
                self._mixed_step(decoding)
            elif decoding:
                self._decode_steps(decoding, target_t)
            else:
                wake = min(s.hold_until for s in self.running)
                self._advance_time(min(wake, target_t) - self.t)

    def _notify(self) -> None:
        for seq in self._touched:
            seq.visible = seq.generated
            if not seq.active:
                seq.closed = True
            seq.event.set()
        self._touched.clear()

    # -- scheduling ---------------------------------------------------------------------------
    def _decodable(self, s: Sequence) -> bool:
        return s.computed >= s.target and s.hold_until <= self.t

    def _admit(self) -> None:
        budget = self.profile.max_num_batched_tokens
        while self.waiting and len(self.running) < self.profile.max_num_seqs:
            s = self.waiting[0]
            if not s.queried:
                s.queried = True
                s.cached_tokens = self.cache.lookup(s.hashes, s.prompt_len)
                s.computed = s.cached_tokens
            first = min(s.target, s.computed + budget)
            need = self.pool.blocks_for(first)
            if need > self.pool.free and self.running:
                break
            self.waiting.popleft()
            self.pool.used += need
            s.blocks = need
            s.state = SeqState.RUNNING
            if s.admitted_t is None:
                # a busy engine's step clock can trail the wall clock by part of a tick
                s.admitted_t = max(self.t, s.arrival_t)
            self.running.append(s)
            self.stats.max_running_seen = max(self.stats.max_running_seen, len(self.running))
            self.stats.max_long_running_seen = max(
                self.stats.max_long_running_seen, self._long_running())

    def _long_running(self) -> int:
        return sum(1 for s in self.running if s.long)

    def _ensure_blocks(self, s: Sequence, tokens: int) -> bool:
        """Give ``s`` blocks for ``tokens``; preempt the newest runners if needed."""
        need = self.pool.blocks_for(tokens) - s.blocks
        while need > self.pool.free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is s:
                return False
        if need > 0:
            self.pool.used += need
            s.blocks += need
        return True

    def _preempt(self, s: Sequence) -> None:
        self.running.remove(s)
        self.pool.used -= s.blocks
        s.blocks = 0
        s.computed = 0
        s.target = s.prompt_len + s.generated
        s.state = SeqState.WAITING
        self.waiting.appendleft(s)
        self.stats.preemptions += 1
        log.debug("sim: preempted %s after %d tokens", s.request_id, s.generated)

    # -- steps --------------------------------------------------------------------------------
    def _mixed_step(self, decoding: list[Sequence]) -> None:
        profile = self.profile
        budget = profile.max_num_batched_tokens - len(decoding)
        threshold = profile.long_prefill_threshold()
        limited = profile.max_num_partial_prefills > 1
        prefill = partial = long_partial = 0
        for s in [s for s in self.running if s.computed < s.target]:
            if budget <= 0 or (limited and partial >= profile.max_num_partial_prefills):
                break
            if s.state is not SeqState.RUNNING:
                continue
            long = 0 < threshold < s.prompt_len
            if limited and long and long_partial >= profile.max_long_partial_prefills:
                continue
            partial, long_partial = partial + 1, long_partial + long
            chunk = min(budget, s.target - s.computed, threshold or budget)
            if not self._ensure_blocks(s, s.computed + chunk):
                continue
            s.computed += chunk
            budget -= chunk
            prefill += chunk
            if s.computed >= s.target:
                self._prefill_done(s)
        self.stats.prefill_tokens += prefill
        dt = self.profile.decode.step_s(len(decoding)) + prefill / self.profile.prefill_tokens_per_s
        self._advance_time(dt)
        self._emit(decoding, 1, self.t)

    def _decode_steps(self, decoding: list[Sequence], target_t: float) -> None:
        step = self.profile.decode.step_s(len(decoding))
        k = max(1, math.ceil((target_t - self.t) / step - 1e-9))
        for s in decoding:
            k = min(k, s.total - s.generated)
            if s.stall_at is not None:
                k = min(k, max(1, s.stall_at - s.generated))
        held = [s.hold_until for s in self.running if s.hold_until > self.t]
        if held:
            k = min(k, max(1, math.ceil((min(held) - self.t) / step)))
        k = max(1, k)
        first_token_t = self.t + step
        self._advance_time(k * step)
        self._emit(decoding, k, first_token_t)

    def _advance_time(self, dt: float) -> None:
        if dt <= 0:
            return
        self.t += dt
        self.stats.running_seconds += len(self.running) * dt
        self.stats.waiting_seconds += len(self.waiting) * dt
        if self.running:
            self.stats.busy_seconds += dt

    def _prefill_done(self, s: Sequence) -> None:
        if s.generated == 0 and s.slow_first_s > 0:
            s.hold_until = self.t + s.slow_first_s
            s.slow_first_s = 0.0
        if not s.prompt_counted:
            # once per request, as vLLM counts a prompt (a preempted request's recompute is not
            # a new prompt); prompts shorter than one block have no hashes but count all the same
            s.prompt_counted = True
            self.stats.prompt_tokens += s.prompt_len
        if s.hashes:
            self.cache.insert(s.hashes)
            s.hashes = []
        if s.generated >= s.total:
            self._touched.add(s)
            self._finish(s)

    def _emit(self, decoding: list[Sequence], k: int, first_token_t: float) -> None:
        """Each still-running sequence in ``decoding`` produced ``k`` tokens by ``self.t``, the
        first of them at ``first_token_t``."""
        for s in decoding:
            if s.state is not SeqState.RUNNING:
                continue
            n = min(k, s.total - s.generated)
            if n <= 0 or not self._ensure_blocks(s, s.computed + n):
                continue
            s.generated += n
            s.computed += n
            self.stats.generation_tokens += n
            if s.first_token_t is None:
                s.first_token_t = max(first_token_t, s.arrival_t)
            self._touched.add(s)
            if s.stall_at is not None and s.generated >= s.stall_at:
                s.hold_until = self.t + s.stall_s
                s.stall_at = None
            if s.generated >= s.total:
                self._finish(s)

    def _finish(self, s: Sequence) -> None:
        self._remove(s)
        s.state = SeqState.FINISHED
        s.finish_t = self.t
        self.stats.finished += 1
        self._count_reason(s.finish_reason)
        self.on_finish(s)

    def _count_reason(self, reason: str) -> None:
        by = self.stats.finished_by_reason
        by[reason] = by.get(reason, 0) + 1

    def _remove(self, s: Sequence) -> None:
        if s.state is SeqState.RUNNING:
            self.running.remove(s)
            self.pool.used -= s.blocks
            s.blocks = 0
        elif s.state is SeqState.WAITING:
            self.waiting.remove(s)

    def _close(self, s: Sequence) -> None:
        s.visible = s.generated
        s.closed = True
        s.event.set()
        self._touched.discard(s)
