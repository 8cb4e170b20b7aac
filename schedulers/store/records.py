"""The Redis store's packed records, read by name: a job's admission facts (``Item``, one field of
the ``items`` hash) and its lease (``Lease``, one field of the ``lease`` hash), each one
space-separated string per job (key layout: fleet/core/keys.py).

The Lua scripts write and read these strings with the accessors of ``lua/prelude.lua``
(``item_put``/``item_get``, ``lease_put``/``lease_get``); Python only reads them, here. The field
order is declared once on each side: by the fields of the two classes below and by those
accessors; tests/test_store_records.py packs on one side and unpacks on the other to prove they
agree. A field added later goes at the end, on both sides.

Values are the strings as stored, decoded the way prelude.lua's accessors decode them: the
markers for "none" become ``None`` (an item's deadline and deferred ``-``, a lease's owner empty)
and an item written before ``uncached`` existed counts its whole prompt as uncached. Readers
convert the few numbers they need themselves, so a decode costs one ``split``.

Backends: an item's ``elig`` (the bit mask of the backends it may run on; with its ``hint``, the
backend expected to hold its cached prefix, written only when there is one) and a lease's
``backend`` (the index of the backend it was granted on) are written only when they are not
backend 0's (elig ``1``, backend ``0``), so the records of a one-backend fleet are the strings
they were before backends existed, and a record written before reads as backend 0's (a field
added after ``elig`` must have it written always). A lease's
owner is the rest of its string (it may hold spaces), so its ``backend`` is written before the
owner, and read as the backend when that word is a bare number: the owners the fleet writes
never are one (``host:pid:nonce``, ``gateway-<id>``), and an owner whose first word is one gets
its backend written even when it is 0, so the string stays unambiguous.

Failure cases: ``unpack`` raises ValueError for a string that has too few fields to be a record
of its kind (what no script writes); a missing record is the caller's ``None`` (HGET's nil), never
passed here. Extra trailing item fields (written by a newer version) are ignored.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Item(NamedTuple):
    """``items[id]``: a pending, in-flight or waiting job's admission facts."""

    project: str
    band: str  # interactive | batch
    size: str  # short | long
    prompt: str  # prompt tokens
    max_new: str
    kv: str  # KV tokens reserved while it runs
    long: str  # 1 | 0
    enq: str  # enqueued at (unix s)
    score: str  # its place in line (fairshare.pending_score, ms)
    pending: str  # 1 | 0
    deadline: str | None  # unix s
    cont: str  # 0, or the number of the turn READMIT last put in line
    # the not-before time READMIT gave it while it waits in `deferred` (the zset's score is the
    # one that counts: ``hurry`` may lower it)
    deferred: str | None
    # the prompt tokens prep expects to miss the prefix cache (absent in items written before it
    # existed: the whole prompt)
    uncached: str
    # the bit mask of the backends the job may run on, its eligibility class (bit b: backend b);
    # not written when it is 1 (backend 0 only), and absent in items written before it existed
    elig: str = "1"
    # the index of the backend expected to hold its longest cached prefix (placement.pick);
    # written only when there is one (then elig is written too, even 1)
    hint: str | None = None
    # with locality on (schedulers/policy/locality.py): its cache backend's ``filled`` count when
    # it was queued; written only then, after elig and hint (``-`` for none)
    fill: str | None = None

    @classmethod
    def unpack(cls, raw: str) -> Item:
        fields: list[Any] = raw.split(" ", _ITEM_LEN)
        if len(fields) > _ITEM_LEN:  # fields of a newer version
            del fields[_ITEM_LEN:]
        elif _UNCACHED <= len(fields) < _ITEM_LEN:  # the fields after uncached not written
            fields += ["", "1", None, None][len(fields) - _UNCACHED:]
        elif len(fields) != _ITEM_LEN:
            raise ValueError(f"not a packed item: {raw!r}")
        if fields[_DEADLINE] == "-":
            fields[_DEADLINE] = None
        if fields[_DEFERRED] == "-":
            fields[_DEFERRED] = None
        if fields[_HINT] == "-":
            fields[_HINT] = None
        if not fields[_UNCACHED]:  # what the scripts count then: the whole prompt
            fields[_UNCACHED] = fields[_PROMPT]
        return cls._make(fields)

    def pack(self) -> str:
        """The stored string, as ``item_put`` writes it (for tests and tools: only Lua writes)."""
        values = ["-" if value is None else value for value in self]
        if self.fill is None:
            del values[-1]
            if self.hint is None:
                del values[-1]
                if self.elig == "1":
                    del values[-1]
        return " ".join(values)

    @property
    def queue(self) -> tuple[str, str, str]:
        """(project, band, size) of the pending queue the job is (or goes back) in; ``where``
        adds its eligibility class, the rest of the queue's name."""
        return self.project, self.band, self.size

    @property
    def where(self) -> tuple[str, str, str, str]:
        """(project, band, size, elig): which pending queue the job is (or goes back) in."""
        return self.project, self.band, self.size, self.elig


class Lease(NamedTuple):
    """``lease[id]``: an in-flight job's lease."""

    fence: str
    kv: str  # KV tokens it holds
    long: str  # 1 | 0, then "i" for an interactive-band job (quiet windows protect it)
    expires: str  # unix s
    admitted_at: str  # unix s
    project: str
    backend: str = "0"  # the index of the backend it was granted on (module docstring)
    owner: str | None = None  # set by the first claim; the rest of the string (it may hold spaces)

    @classmethod
    def unpack(cls, raw: str) -> Lease:
        fields: list[Any] = raw.split(" ", _OWNER - 1)
        if len(fields) == _OWNER - 1:  # no backend, no owner and no space before them
            fields.append("")
        elif len(fields) != _OWNER:
            raise ValueError(f"not a packed lease: {raw!r}")
        rest = fields.pop()
        word, _, after = rest.partition(" ")
        backend, owner = (word, after) if _number(word) else ("0", rest)
        return cls._make([*fields, backend, owner or None])

    def pack(self) -> str:
        """The stored string, as ``lease_put`` writes it (for tests and tools: only Lua writes)."""
        values = [str(value) for value in self[:_BACKEND]]
        owner = self.owner or ""
        if self.backend != "0" or _number(owner.partition(" ")[0]):
            values.append(self.backend)
        return " ".join([*values, owner])


def _number(word: str) -> bool:
    """A bare decimal number (what a lease's backend is, and what Lua's ``%d+`` matches)."""
    return word.isascii() and word.isdigit()


# Positions, derived from the declarations above (never written twice).
_ITEM_LEN = len(Item._fields)
_DEADLINE = Item._fields.index("deadline")
_DEFERRED = Item._fields.index("deferred")
_PROMPT = Item._fields.index("prompt")
_UNCACHED = Item._fields.index("uncached")
_HINT = Item._fields.index("hint")
_BACKEND = Lease._fields.index("backend")
_OWNER = Lease._fields.index("owner")
