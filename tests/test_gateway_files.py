"""The gateway's file store on a real Redis: client uploads are capped, batch output is not."""

from __future__ import annotations

import time

import pytest
import redis

from fleet.core.config import GatewaySettings
from fleet.core.errors import TooLarge
from fleet.core.keys import Keys
from fleet.gateway.files import FileStore


def test_an_upload_is_capped_but_a_batch_output_over_the_cap_is_stored(
    key_prefix: str, redis_client: redis.Redis
) -> None:
    """Before, a batch whose output passed max_file_bytes could never finish: every retrieve
    rebuilt the output and answered 413."""
    settings = GatewaySettings(max_file_bytes=1_000)
    files = FileStore(redis_client, Keys(key_prefix), lambda: settings)
    big = b"x" * 5_000
    with pytest.raises(TooLarge):
        files.put("a", "upload.jsonl", "batch", big)
    with redis_client.pipeline(transaction=True) as pipe:
        meta = files.stage(pipe, "a", "file-out", "out.jsonl", "batch_output", big, time.time())
        pipe.execute()
    assert meta["bytes"] == 5_000
    assert files.content("a", "file-out") == big
