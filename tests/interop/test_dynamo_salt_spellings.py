"""NVIDIA Dynamo's real indexer (ai-dynamo-runtime 1.6.1) reading salts as the consolidated
output spells them (wire/router_forms.py, DYN_KVBM_KV_EVENTS_SALT_FORM=client) at the edges:
an empty salt string, a salt of 64 hex digits (Dynamo's multimodal-hash shape) and a plain
one, each asked by the string a client sends and by an unsalted request."""

from __future__ import annotations

import time
from pathlib import Path

from kvbm_plugin.consolidator_config import PublisherSettings, parse_endpoint
from kvbm_plugin.routers.dynamo_indexer import Indexer
from kvbm_plugin.wire.identity import SALT_TEXTS, salt_extra_key, salt_of
from kvbm_plugin.wire.publisher import ZmqEventPublisher
from kvbm_plugin.wire.router_forms import spell_for_routers

BS = 4
SALTS = {"": [1, 2, 3, 4], "a" * 64: [5, 6, 7, 8], "tenant-a": [9, 10, 11, 12]}


def test_each_salted_block_is_credited_to_its_salt_string_and_not_to_unsalted_requests(
        indexer: Indexer, tmp_path: Path) -> None:
    SALT_TEXTS.clear()
    events = []
    for i, (text, tokens) in enumerate(SALTS.items()):
        salt = salt_of({"cache_salt": text})  # the leader saw the string
        events.append({"type": "BlockStored", "block_hashes": [(1 << 40) + i],
                       "parent_block_hash": None, "token_ids": tokens, "block_size": BS,
                       "lora_id": None, "medium": "GPU", "lora_name": None,
                       "extra_keys": [[salt_extra_key(salt)]]})
    out = spell_for_routers(events)
    endpoint = parse_endpoint("e", f"ipc://{tmp_path}/pub", default_host="127.0.0.1")
    replay = parse_endpoint("r", f"ipc://{tmp_path}/replay", default_host="127.0.0.1")
    pub = ZmqEventPublisher(PublisherSettings(), endpoint, replay)
    try:
        pub.publish(out)  # before the indexer listens: it sees seq 1 first, always
        indexer.register(1, endpoint.connect, replay.connect, BS)
        deadline = time.monotonic() + 30
        # Its SUB joins at a moment of its own: the batch is sent again until it is held, and
        # a first batch it saw past seq 0 is filled by replay (without the replay endpoint the
        # indexer warned "batches lost", seen once in a loaded run).
        while not indexer.held():
            assert time.monotonic() < deadline, "the indexer never held the batch"
            pub.publish(out)
            time.sleep(0.2)  # poll interval: the indexer applies events asynchronously
    finally:
        pub.shutdown(2.0)
    assert len(next(iter(indexer.held().values()))) == len(SALTS)
    for text, tokens in SALTS.items():
        assert indexer.cached_tokens(tokens, cache_salt=None) == 0, repr(text)
        if text:  # a client's "" reads as no salt to Dynamo: credited to nobody
            assert indexer.cached_tokens(tokens, cache_salt=text) == BS, text
        assert indexer.cached_tokens(tokens, cache_salt="tenant-b") == 0
    assert indexer.warnings() == []
