"""Gateway API keys: how they are minted, stored and recognised (``fleet keys mint``).

A key is ``fk-`` + 43 URL-safe characters (32 random bytes from ``secrets``). The settings keep
only its digest, per project::

    [projects.assistant]
    api_keys = ["sha256:9f86d0...", "sha256:2c26b4...:batch"]

An entry is ``sha256:<64 hex>``, optionally followed by ``:interactive`` or ``:batch``, the
admission band of that key's chat requests (interactive when absent).

Why plain SHA-256 and not a slow password hash (scrypt, argon2, PBKDF2): a slow hash protects
guessable secrets, people's passwords, from an attacker who has the digests. A key of 256 random
bits cannot be guessed whatever the hash costs, so stretching buys nothing and would cost every
request a deliberate delay; a digest of a high-entropy key is one-way and that is all it needs
(the same reasoning as GitHub's and Stripe's token storage). Digests are compared through a dict
lookup on the digest, so a timing difference reveals only digest prefixes, never the key.

Failure cases: an entry not in this shape is refused when the settings load (``ConfigError``
naming ``projects.<name>.api_keys``).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from typing import Literal

KEY_PREFIX = "fk-"
KEY_BYTES = 32
_ENTRY = re.compile(r"sha256:([0-9a-f]{64})(?::(interactive|batch))?")


@dataclass(frozen=True)
class KeyEntry:
    digest: str
    band: Literal["interactive", "batch"] = "interactive"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_entry(entry: str) -> KeyEntry:
    """The digest and band of one ``api_keys`` entry; ValueError for anything else."""
    match = _ENTRY.fullmatch(entry.strip())
    if match is None:
        raise ValueError("an api_keys entry is 'sha256:<64 lowercase hex>' with an optional "
                         "':interactive' or ':batch'")
    band = match.group(2) or "interactive"
    return KeyEntry(match.group(1), "batch" if band == "batch" else "interactive")


def mint(band: str | None = None) -> tuple[str, str]:
    """A new key and the settings entry that admits it: ``(key, "sha256:...")``."""
    key = KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)
    entry = f"sha256:{digest(key)}" + (f":{band}" if band else "")
    parse_entry(entry)  # a band other than interactive/batch is refused here, not at load time
    return key, entry
