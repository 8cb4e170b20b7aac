"""The store's packed records mean the same in Python and in Lua: schedulers/store/records.py
(``Item``, ``Lease``) and the accessors of schedulers/store/lua/prelude.lua (``item_get``/``item_put``,
``lease_get``/``lease_put``) agree on the field order, the names and the "none" markers.

Each check runs the prelude's own accessors on the test Redis (the prelude in front of a small
script, as the loader puts it in front of every store script) on the very string Python packs or
unpacks, with a different value in every field, so two fields swapped on either side show."""

from __future__ import annotations

from importlib import resources
from typing import Any

import pytest
import redis

from schedulers.store.records import Item, Lease

PRELUDE = (resources.files("schedulers.store") / "lua" / "prelude.lua").read_text(encoding="utf-8")

# ARGV[1] 'item' | 'lease'; the record is the field 'job' of KEYS[1].
GET = PRELUDE + """
local get = ARGV[1] == 'item' and item_get or lease_get
local out = {}
for name, value in pairs(get(KEYS[1], 'job')) do
  out[#out + 1] = name
  out[#out + 1] = value
end
return out
"""
# ARGV[1] 'item' | 'lease', then name, value, ... of the fields to write (a field left out: nil).
PUT = PRELUDE + """
local put = ARGV[1] == 'item' and item_put or lease_put
local f = {}
for i = 2, #ARGV, 2 do f[ARGV[i]] = ARGV[i + 1] end
put(KEYS[1], 'job', f)
return redis.call('HGET', KEYS[1], 'job')
"""

ITEM = Item(project="proj-a", band="batch", size="long", prompt="9001", max_new="257", kv="9472",
            long="1", enq="1712345678.25", score="1712345000123.5", pending="0", deadline="1712349999.5",
            cont="3", deferred="1712346000.75", uncached="4242")
ROUTED = ITEM._replace(elig="6", hint="2")  # several backends: its class and its prefix-cache hint
HINTED_ON_ONE = ITEM._replace(hint="0")  # elig 1 written before a hint
FILLED = ITEM._replace(fill="5150")  # locality: elig 1 and hint "-" written before its fill
ROUTED_FILLED = ROUTED._replace(fill="4096")
LEASE = Lease(fence="77", kv="9472", long="1", expires="1712345999.5", admitted_at="1712345690.125",
              project="proj-a", owner="celery@host-1 #4711-ab")


@pytest.fixture
def items_key(redis_client: redis.Redis, key_prefix: str) -> str:
    return f"{key_prefix}{{d}}:records"


def lua_get(client: redis.Redis, key: str, kind: str, raw: str) -> dict[str, str]:
    """What prelude.lua's getter makes of ``raw``: its non-nil fields by name."""
    client.hset(key, "job", raw)
    flat = [v.decode() for v in client.eval(GET, 1, key, kind)]
    return dict(zip(flat[::2], flat[1::2], strict=True))


def lua_put(client: redis.Redis, key: str, kind: str, fields: dict[str, str]) -> str:
    """The string prelude.lua's putter writes for ``fields``."""
    args = [kind, *(part for pair in fields.items() for part in pair)]
    return client.eval(PUT, 1, key, *args).decode()


def named(record: Any) -> dict[str, str]:
    """A record's fields by name, without those that are None (Lua's nil)."""
    return {name: value for name, value in record._asdict().items() if value is not None}


@pytest.mark.parametrize("record", [ITEM, ROUTED, HINTED_ON_ONE, FILLED, ROUTED_FILLED, LEASE],
                         ids=["item", "routed item", "hinted class-1 item", "filled item", "routed filled item",
                              "lease"])
def test_lua_reads_what_python_packs(redis_client: redis.Redis, items_key: str, record: Any) -> None:
    kind = type(record).__name__.lower()
    assert lua_get(redis_client, items_key, kind, record.pack()) == named(record)


@pytest.mark.parametrize("record", [ITEM, ROUTED, HINTED_ON_ONE, FILLED, ROUTED_FILLED, LEASE],
                         ids=["item", "routed item", "hinted class-1 item", "filled item", "routed filled item",
                              "lease"])
def test_python_reads_what_lua_packs(redis_client: redis.Redis, items_key: str, record: Any) -> None:
    kind = type(record).__name__.lower()
    raw = lua_put(redis_client, items_key, kind, named(record))
    assert raw == record.pack()
    assert type(record).unpack(raw) == record


@pytest.mark.parametrize("record", [ITEM._replace(deadline=None, deferred=None), LEASE._replace(owner=None)],
                         ids=["item", "lease"])
def test_none_markers_agree(redis_client: redis.Redis, items_key: str, record: Any) -> None:
    kind = type(record).__name__.lower()
    raw = lua_put(redis_client, items_key, kind, named(record))
    assert type(record).unpack(raw) == record
    assert lua_get(redis_client, items_key, kind, raw) == named(record)


def test_an_item_written_before_uncached_counts_its_whole_prompt(redis_client: redis.Redis,
                                                                 items_key: str) -> None:
    raw = ITEM.pack().rsplit(" ", 1)[0]
    assert Item.unpack(raw).uncached == ITEM.prompt
    assert named(Item.unpack(raw)) == lua_get(redis_client, items_key, "item", raw)


def test_fields_of_a_later_version_are_ignored_on_both_sides(redis_client: redis.Redis,
                                                            items_key: str) -> None:
    raw = ROUTED_FILLED.pack() + " 17 future"
    assert Item.unpack(raw) == ROUTED_FILLED
    assert lua_get(redis_client, items_key, "item", raw) == named(ROUTED_FILLED)


def test_a_filled_item_without_a_hint_writes_the_none_marker() -> None:
    assert FILLED.pack().split(" ")[-3:] == ["1", "-", "5150"]
    assert Item.unpack(FILLED.pack()).hint is None


def test_a_lease_written_without_an_owner_has_none(redis_client: redis.Redis, items_key: str) -> None:
    raw = " ".join(LEASE[:-1])  # no owner, and no space before it
    assert Lease.unpack(raw).owner is None
    assert named(Lease.unpack(raw)) == lua_get(redis_client, items_key, "lease", raw)


@pytest.mark.parametrize("kind", [Item, Lease])
def test_a_string_too_short_is_no_record(kind: Any) -> None:
    with pytest.raises(ValueError):
        kind.unpack("proj-a batch long")


def test_the_queue_is_the_first_three_fields() -> None:
    assert ITEM.queue == ("proj-a", "batch", "long") == tuple(ITEM.pack().split(" ")[:3])
