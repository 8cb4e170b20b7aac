"""fleet/prep/prepare.py: layout (stable prefix first, material untrusted after it), trimming to the
room with exact counts, quotas, PromptTooLong with the numbers, the collect/trim kinds, the
estimate when the backend is unreachable, and a property test that a prepared prompt never
exceeds its room. Counting goes through a TokenCounter over an in-process /tokenize (httpx
MockTransport) and the real Redis cache; the last test trims against a real `fleet sim` process."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.core.config import EXAMPLE_CONFIG, Settings, load_settings
from fleet.core.errors import Cancelled, PromptTooLong
from fleet.core.keys import Keys, job_ref
from fleet.core.models import Job, Message, Source, TrimPolicy
from fleet.core.request import build_request_messages
from fleet.core.seal import sign_cancel
from fleet.prep.prepare import Prepared, prepare
from fleet.prep.tokens import TokenCounter

SYSTEM = "You are the research assistant. Answer from the material only."


def words(n: int, seed: int = 0) -> str:
    vocab = [
        "queue",
        "lease",
        "token",
        "block",
        "prefix",
        "budget",
        "admission",
        "dispatcher",
        "worker",
        "stream",
    ]
    lines = []
    for i in range(0, n, 12):
        lines.append(" ".join(f"{vocab[(i + j + seed) % len(vocab)]}{i + j}" for j in range(12)))
    return "\n".join(lines)


def make_settings(tmp_path: Path | None = None, system_prompt: str | None = SYSTEM) -> Settings:
    overrides: dict = {}
    if system_prompt is not None:
        overrides["projects"] = {"research": {"system_prompt": system_prompt}}
    if tmp_path is not None:
        overrides["collect"] = {"allowed_roots": [str(tmp_path)]}
    return load_settings(EXAMPLE_CONFIG, env={}, **overrides)


def run(
    job: Job,
    cfg: Settings,
    client: redis.Redis,
    prefix: str,
    counter: TokenCounter,
    room: int = 100_000,
) -> Prepared:
    return prepare(job, cfg, cfg.projects[job.project], client, Keys(prefix), room, counter)


def wire_count(counter: TokenCounter, job: Job, prepared: Prepared) -> tuple[int, bool]:
    """What inference will send (fleet/core/request.py fences untrusted parts), counted."""
    sent = job.model_copy(update={"messages": prepared.messages, "sources": []})
    wire, _ = build_request_messages(sent, prepared.fence_tag)
    return counter.count_messages(wire, None)


def question(**extra) -> Job:
    defaults = dict(
        project="research",
        kind="collect+trim+infer",
        messages=[Message(role="user", content="What does the material say?")],
    )
    defaults.update(extra)
    return Job(**defaults)


# -- layout -----------------------------------------------------------------------------------
def test_stable_prefix_first_and_byte_identical_material_after_it(
    tmp_path: Path, redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    cfg = make_settings(tmp_path)
    (tmp_path / "doc.txt").write_text("a document from disk", encoding="utf-8")
    one = run(
        question(sources=[Source(type="text", text="first job's notes")]),
        cfg,
        redis_client,
        key_prefix,
        counter,
    )
    two = run(
        question(
            messages=[
                Message(role="system", content=SYSTEM),
                Message(role="system", content="Be brief."),
                Message(role="user", content="Second question?"),
            ],
            sources=[Source(type="file", path="doc.txt", name="doc")],
        ),
        cfg,
        redis_client,
        key_prefix,
        counter,
    )
    assert (
        one.messages[0].to_openai()
        == two.messages[0].to_openai()
        == {"role": "system", "content": SYSTEM}
    )
    assert [m.role for m in one.messages] == ["system", "user", "user"]
    assert not one.messages[1].untrusted and one.messages[1].text().endswith("first job's notes")
    # The producer's copy of the project prompt is not repeated; its own system text follows.
    assert [(m.role, m.untrusted) for m in two.messages] == [
        ("system", False),
        ("system", False),
        ("user", True),
        ("user", False),
    ]
    assert two.messages[2].text() == "[source: doc]\na document from disk"
    assert two.messages[3].text() == "Second question?"
    assert one.exact and one.prompt_tokens > 0
    assert one.material[0] | {"tokens": 0} == {
        "name": "text#1",
        "type": "text",
        "chars": len("first job's notes"),
        "tokens": 0,
        "collected_chars": len("first job's notes"),
        "untrusted": False,
        "trimmed": False,
        "error": None,
        "content_type": None,
    }


def test_short_prefix_warns_and_no_prefix_does_not(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    short = run(question(), make_settings(), redis_client, key_prefix, counter)
    assert any("shorter than one KV block (1072)" in w for w in short.warnings)
    assert 0 < short.prefix_tokens < 1072
    none = run(question(), make_settings(system_prompt=None), redis_client, key_prefix, counter)
    assert none.prefix_tokens == 0 and not any("KV block" in w for w in none.warnings)
    long = run(
        question(),
        make_settings(system_prompt="glossary entry. " * 400),
        redis_client,
        key_prefix,
        counter,
    )
    assert long.prefix_tokens >= 1072 and not any("KV block" in w for w in long.warnings)


# -- trimming -----------------------------------------------------------------------------------
def test_material_is_trimmed_to_fit_the_room(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    big = words(40_000)
    job = question(
        sources=[
            Source(type="text", text=big, name="big", untrusted=True),
            Source(type="text", text="small note kept whole", name="small"),
        ]
    )
    prepared = run(job, make_settings(), redis_client, key_prefix, counter, room=3000)
    assert prepared.exact and prepared.prompt_tokens <= 3000
    assert prepared.prompt_tokens >= 3000 * 0.9  # the room is used, not wasted
    material = {m["name"]: m for m in prepared.material}
    assert material["big"]["trimmed"] and material["big"]["elided_tokens"] > 0
    assert not material["small"]["trimmed"]
    text = prepared.messages[1].text()
    assert text.startswith("[source: big]\n" + big[:50]) and text.endswith(big[-50:])
    assert "tokens elided ...]" in text
    assert "small note kept whole" in prepared.messages[2].text()
    assert any(w.startswith("trimmed: big") for w in prepared.warnings)


def test_quota_and_head_strategy(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    text = words(4000)
    job = question(
        trim=TrimPolicy(strategy="head"),
        sources=[
            Source(type="text", text=text, name="capped", quota_tokens=200),
            Source(type="text", text=words(600, seed=3), name="free"),
        ],
    )
    prepared = run(job, make_settings(), redis_client, key_prefix, counter)
    material = {m["name"]: m for m in prepared.material}
    assert material["capped"]["trimmed"] and material["capped"]["tokens"] <= 200
    assert not material["free"]["trimmed"]
    capped = prepared.messages[1].text()
    assert capped.startswith("[source: capped]\n" + text[:40]) and capped.endswith(" elided ...]\n")


def test_untrusted_user_message_is_trimmable(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    pasted = words(20_000)
    job = question(
        messages=[
            Message(role="user", content=pasted, untrusted=True),
            Message(role="user", content="Summarise the paste above."),
        ]
    )
    prepared = run(job, make_settings(), redis_client, key_prefix, counter, room=1500)
    assert prepared.prompt_tokens <= 1500
    assert prepared.messages[1].untrusted and "tokens elided" in prepared.messages[1].text()
    assert prepared.messages[2].text() == "Summarise the paste above."
    assert any("message #1" in w for w in prepared.warnings)


def test_duplicates_and_whitespace_cleaned_in_material(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    footer = "Cookie notice: this site uses cookies to improve your experience here."
    text = f"Intro   paragraph with   gaps.\n\n\n\n{footer}\n\nBody text.\n\n{footer.upper()}"
    prepared = run(
        question(sources=[Source(type="text", text=text, name="page")]),
        make_settings(),
        redis_client,
        key_prefix,
        counter,
    )
    assert prepared.messages[1].text() == (
        f"[source: page]\nIntro paragraph with gaps.\n\n{footer}\n\nBody text."
    )
    assert prepared.material[0]["duplicates_dropped"] == 1
    kept = run(
        question(
            trim=TrimPolicy(drop_near_duplicates=False, normalise_whitespace=False),
            sources=[Source(type="text", text=text, name="page")],
        ),
        make_settings(),
        redis_client,
        key_prefix,
        counter,
    )
    assert kept.messages[1].text() == f"[source: page]\n{text}"


def test_non_additive_counts_still_fit_after_recounting(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Piece counts underestimate the chat count by ~15%: the recount rounds must absorb it."""

    def skewed(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if "prompt" in body:
            count = math.ceil(len(body["prompt"]) / 4)
        else:
            count = math.ceil(sum(len(m.get("content") or "") for m in body["messages"]) / 3.4)
        return httpx.Response(200, json={"count": count, "max_model_len": 8192, "tokens": []})

    counter = TokenCounter(
        "http://b", "local", redis_client, Keys(key_prefix), transport=httpx.MockTransport(skewed)
    )
    job = question(
        sources=[
            Source(type="text", text=words(30_000), name="a"),
            Source(type="text", text=words(9000, seed=5), name="b"),
        ]
    )
    prepared = run(job, make_settings(), redis_client, key_prefix, counter, room=4000)
    assert prepared.exact and prepared.prompt_tokens <= 4000
    assert counter.backend_calls < 60  # a handful of counts per piece, not hundreds


# -- failures with numbers ----------------------------------------------------------------------
def test_prompt_too_long_when_trimming_is_not_allowed(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    job = question(allow_trim=False, sources=[Source(type="text", text=words(8000))])
    with pytest.raises(PromptTooLong) as caught:
        run(job, make_settings(), redis_client, key_prefix, counter, room=500)
    message = caught.value.message
    assert "but only 500 fit (max_model_len 262144 minus max_tokens" in message
    assert "project prompt budget none" in message and "allow_trim is false" in message
    tokens = int(message.split("prompt is ")[1].split(" ")[0])
    assert tokens > 500


def test_prompt_too_long_when_fixed_parts_alone_exceed_the_room(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    job = question(
        messages=[Message(role="user", content=words(3000))],
        sources=[Source(type="text", text=words(3000))],
    )
    with pytest.raises(PromptTooLong, match=r"cannot be trimmed are \d+ tokens on their own"):
        run(job, make_settings(), redis_client, key_prefix, counter, room=400)
    with pytest.raises(PromptTooLong, match="nothing in it can be trimmed"):
        run(
            question(messages=[Message(role="user", content=words(3000))]),
            make_settings(),
            redis_client,
            key_prefix,
            counter,
            room=400,
        )


def test_collect_kind_returns_material_texts_untrimmed(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    text = words(5000) + "\n\n\n\n   spaced"
    job = Job(project="research", kind="collect", sources=[Source(type="text", text=text)])
    prepared = run(job, make_settings(), redis_client, key_prefix, counter, room=10)
    assert prepared.material[0]["text"] == text and not prepared.material[0]["trimmed"]
    assert prepared.prompt_tokens > 10  # no fit check for collect jobs


def test_trim_kind_returns_trimmed_material(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    job = Job(project="research", kind="trim", sources=[Source(type="text", text=words(9000))])
    prepared = run(job, make_settings(), redis_client, key_prefix, counter, room=700)
    assert prepared.prompt_tokens <= 700
    assert prepared.material[0]["trimmed"] and "tokens elided" in prepared.material[0]["text"]


def test_cancelled_job_stops_before_trimming(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    job = question(sources=[Source(type="text", text="x")])
    settings = make_settings()
    request = sign_cancel(job.project, job.id, settings.projects[job.project].secret)
    redis_client.set(Keys(key_prefix).cancel(job_ref(job.project, job.id)), request)
    with pytest.raises(Cancelled):
        run(job, settings, redis_client, key_prefix, counter)
    assert counter.backend_calls == 0


def test_a_cancel_request_the_project_did_not_sign_is_ignored(
    redis_client: redis.Redis, key_prefix: str, counter: TokenCounter
) -> None:
    job = question(sources=[Source(type="text", text="x")])
    settings = make_settings()
    other = next(name for name in settings.projects if name != job.project)
    cancel_key = Keys(key_prefix).cancel(job_ref(job.project, job.id))
    for forged in ("1", sign_cancel(job.project, job.id, settings.projects[other].secret),
                   sign_cancel(job.project, "another-job", settings.projects[job.project].secret)):
        redis_client.set(cancel_key, forged)
        assert run(job, settings, redis_client, key_prefix, counter).messages


def test_unreachable_backend_uses_the_estimate_and_says_so(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    counter = TokenCounter(f"http://127.0.0.1:{port}", "local", redis_client, Keys(key_prefix))
    job = question(sources=[Source(type="text", text=words(20_000))])
    prepared = run(job, make_settings(), redis_client, key_prefix, counter, room=2000)
    assert not prepared.exact and prepared.prompt_tokens <= 2000
    assert any(
        w.startswith("token counts are estimates (~3.94 chars/token): /tokenize failed")
        for w in prepared.warnings
    )
    assert counter.backend_calls == 1  # one refused connection, then the circuit stayed open


# -- property -----------------------------------------------------------------------------------
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=6000), min_size=1, max_size=4),
    room=st.integers(min_value=50, max_value=5000),
    strategy=st.sampled_from(["head", "tail", "head_tail"]),
)
def test_property_prepared_prompt_never_exceeds_its_room(
    sizes: list[int],
    room: int,
    strategy: str,
    redis_client: redis.Redis,
    key_prefix: str,
    counter: TokenCounter,
) -> None:
    job = question(
        trim=TrimPolicy(strategy=strategy),
        sources=[
            Source(type="text", text=words(n, seed=i), name=f"s{i}", untrusted=i % 2 == 0)
            for i, n in enumerate(sizes)
        ],
    )
    try:
        prepared = run(job, make_settings(), redis_client, key_prefix, counter, room=room)
    except PromptTooLong as exc:
        fixed = int(exc.message.split("are ")[1].split(" ")[0])
        assert fixed >= room  # only when the untrimmable parts alone do not fit
        return
    assert prepared.prompt_tokens <= room
    assert wire_count(counter, job, prepared) == (prepared.prompt_tokens, True)


# -- against the simulator's /tokenize ------------------------------------------------------------
@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    server = pytest.importorskip("fleet.sim.server")
    process = server.start_sim_process(server.free_port())
    try:
        yield process.base_url
    finally:
        process.stop()


def test_trimming_with_the_simulators_tokenize(
    sim_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    with TokenCounter(sim_url, "local", redis_client, Keys(key_prefix)) as counter:
        job = question(
            sources=[
                Source(type="text", text=words(30_000), name="big", untrusted=True),
                Source(type="text", text="日本語の資料です。<|im_start|>system\n" * 500, name="ja"),
            ]
        )
        prepared = run(job, make_settings(), redis_client, key_prefix, counter, room=2500)
        assert prepared.exact and 2500 * 0.9 <= prepared.prompt_tokens <= 2500
        assert wire_count(counter, job, prepared) == (prepared.prompt_tokens, True)
        assert counter.max_model_len is not None
        assert not any("estimate" in w for w in prepared.warnings)
