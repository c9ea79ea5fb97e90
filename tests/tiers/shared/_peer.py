"""A second process with its own shared-store client (another engine's worker, as far as the
store can tell): ``_peer.py STORE ADDRESS PUT_KEYS READ_KEYS BLOCK``.

Writes PUT_KEYS (their bytes from ``_payload.payload``), reads READ_KEYS and checks their
bytes, prints one JSON line ``{"put": codes, "read": codes, "exact": bool}``, then keeps its
client (and, for Mooncake, its segment with its writes) until stdin closes.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

from _payload import Arena, payload

from kvbm_plugin.settings.shared import SharedSettings
from kvbm_plugin.tiers.shared.factory import store_class


def start(store: str, address: str, put_keys: list[str], read_keys: list[str],
          block: int) -> subprocess.Popen[str]:
    """Run this script as a child process (the test keeps it alive, then closes its stdin)."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__)), store, address, json.dumps(put_keys),
         json.dumps(read_keys), str(block)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def report(peer: subprocess.Popen[str], timeout_s: float = 60.0) -> dict[str, Any]:
    """The child's JSON line, waited for with a deadline ({} if it exited first)."""
    assert peer.stdout is not None
    ready, _, _ = select.select([peer.stdout], [], [], timeout_s)
    assert ready, f"the peer process did not report within {timeout_s:g} s"
    return dict(json.loads(peer.stdout.readline() or "{}"))


def main() -> int:
    store_name, address, put_keys, read_keys, block = sys.argv[1:6]
    puts, reads, size = json.loads(put_keys), json.loads(read_keys), int(block)
    settings = SharedSettings(store=store_name, model_key="test-model", address=address,
                              segment_bytes=32 << 20, buffer_bytes=0)
    store = store_class(store_name)(settings)
    arena = Arena(len(puts) + len(reads), size)
    store.register(arena.address, arena.nbytes)
    for i, key in enumerate(puts):
        arena.write(i, payload(key, size))
    put = store.put(puts, [arena.buffer(i) for i in range(len(puts))])
    base = len(puts)
    read = store.get_into(reads, [arena.buffer(base + i) for i in range(len(reads))])
    exact = all(arena.read(base + i) == payload(k, size) for i, k in enumerate(reads))
    print(json.dumps({"put": put, "read": read, "exact": exact}), flush=True)
    sys.stdin.read()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
