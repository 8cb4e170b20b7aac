"""The gateway's file store on a real Redis: client uploads are capped and read back in chunks;
a batch's result file is a record of where its lines come from, with no bytes and no quota."""

from __future__ import annotations

import json
import time

import pytest
import redis

from fleet.core.config import GatewaySettings
from fleet.core.errors import NotFound, TooLarge
from fleet.core.keys import Keys, job_ref
from fleet.gateway.files import CHUNK_BYTES, FileStore


def test_an_upload_is_capped_but_a_batch_result_file_of_any_size_is_recorded(
    key_prefix: str, redis_client: redis.Redis
) -> None:
    """Before, a batch whose output passed max_file_bytes could never finish (every retrieve
    rebuilt the output and answered 413); then its output was stored as a second copy of its
    results, past every cap. Now a result file stores its source, not bytes."""
    settings = GatewaySettings(max_file_bytes=1_000, max_project_bytes=2_000)
    files = FileStore(redis_client, Keys(key_prefix), lambda: settings)
    with pytest.raises(TooLarge):
        files.put("a", "upload.jsonl", "batch", b"x" * 5_000)
    with redis_client.pipeline(transaction=True) as pipe:
        meta = files.stage_result(pipe, "a", "file-out", "out.jsonl", 5_000_000, time.time(),
                                  "batch_1", "output")
        pipe.execute()
    assert meta["bytes"] == 5_000_000 and meta["purpose"] == "batch_output"
    assert files.source("a", "file-out") == ("batch_1", "output")
    with pytest.raises(NotFound):
        files.content("a", "file-out")
    assert files.put("a", "in.jsonl", "batch", b"y" * 1_000)["bytes"] == 1_000  # no quota taken


def test_an_upload_is_read_back_in_chunks(key_prefix: str, redis_client: redis.Redis) -> None:
    settings = GatewaySettings(max_file_bytes=3 * CHUNK_BYTES, max_project_bytes=4 * CHUNK_BYTES)
    files = FileStore(redis_client, Keys(key_prefix), lambda: settings)
    content = bytes(range(256)) * (CHUNK_BYTES * 5 // 2 // 256)
    file_id = files.put("a", "in.jsonl", "batch", content)["id"]
    assert files.source("a", file_id) is None
    chunks = [files.body_chunk("a", file_id, start) for start in range(0, len(content), CHUNK_BYTES)]
    assert [len(chunk) for chunk in chunks] == [CHUNK_BYTES, CHUNK_BYTES, CHUNK_BYTES // 2]
    assert b"".join(chunks) == content
    assert files.delete("a", file_id)
    with pytest.raises(NotFound):
        files.source("a", file_id)


def test_a_file_stored_whole_by_an_earlier_gateway_is_still_read(
    key_prefix: str, redis_client: redis.Redis
) -> None:
    """Files an earlier gateway stored (bytes in the meta hash) stay readable until they expire."""
    keys = Keys(key_prefix)
    files = FileStore(redis_client, keys, lambda: GatewaySettings())
    redis_client.hset(keys.gateway_file(job_ref("a", "file-old")),
                      mapping={"meta": json.dumps({"id": "file-old"}), "content": b"old\n"})
    assert files.source("a", "file-old") is None
    assert files.content("a", "file-old") == b"old\n"
    assert files.body_chunk("a", "file-old", 0) == b"old\n"
    assert files.body_chunk("a", "file-old", 4) == b""


def test_a_batchs_result_files_do_not_count_against_max_files(
    key_prefix: str, redis_client: redis.Redis
) -> None:
    """Before, a batch's output and error files were counted with the uploads for
    gateway.max_files: a project whose finished batches held that many result files could not
    upload the next batch's input. Now only uploads count."""
    files = FileStore(redis_client, Keys(key_prefix), lambda: GatewaySettings(max_files=2))
    with redis_client.pipeline(transaction=True) as pipe:
        for n in range(3):
            files.stage_result(pipe, "a", f"file-out-{n}", "out.jsonl", 10, time.time(),
                               f"batch_{n}", "output")
        pipe.execute()
    files.put("a", "in-1.jsonl", "batch", b"{}\n")
    files.put("a", "in-2.jsonl", "batch", b"{}\n")
    with pytest.raises(TooLarge):
        files.put("a", "in-3.jsonl", "batch", b"{}\n")
    assert len(files.list("a", None, after=None, limit=100)[0]) == 5
