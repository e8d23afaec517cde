"""Agreement between the processes of a multi-host run, through jax's coordination service.

Checkpoint bookkeeping (which steps exist, which to delete, whether a restore read back)
depends on what each host sees on disk, and hosts see a shared directory at slightly
different moments. A host that decides differently then runs a different sequence of
collectives, and the pod waits forever (seen: process 0 inside orbax's delete barrier while
process 1, which had not yet seen the new step commit, went on to the next step's
collectives). So such decisions are process 0's, published to the others here.

These go through the coordination service's key-value store and named barriers, not through
XLA collectives: a name cannot pair with the wrong collective the way two device all-reduces
issued in a different order can. Every process must make the same calls in the same order
(the names are numbered per call site). With one process every function is local.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import jax

TIMEOUT_MS = 60 * 60 * 1000  # a host may be writing a large checkpoint meanwhile
_calls: collections.Counter = collections.Counter()


def _client():
    from jax._src import distributed  # the client orbax uses for its own barriers

    return distributed.global_state.client


def _key(name: str) -> str:
    _calls[name] += 1
    return f"ess_jax/{name}/{_calls[name]}"


def barrier(name: str) -> None:
    """Wait until every process has reached the barrier `name`."""
    if jax.process_count() > 1:
        _client().wait_at_barrier(_key(name), TIMEOUT_MS)


def from_process0(name: str, value: Any, timeout_ms: int = TIMEOUT_MS) -> Any:
    """Process 0's `value` (JSON-able), on every process (the others' `value` is ignored)."""
    if jax.process_count() == 1:
        return value
    key = _key(name)
    if jax.process_index() == 0:
        _client().key_value_set(key, json.dumps(value))
        return value
    return json.loads(_client().blocking_key_value_get(key, timeout_ms))


def gather(name: str, value: Any) -> list:
    """Every process's `value` (JSON-able), in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    key, client = _key(name), _client()
    client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
    return [
        json.loads(client.blocking_key_value_get(f"{key}/{i}", TIMEOUT_MS))
        for i in range(jax.process_count())
    ]


def on_every_process(name: str, ok: bool) -> bool:
    """Whether `ok` holds on every process."""
    if jax.process_count() == 1:
        return bool(ok)
    key, client = _key(name), _client()
    client.key_value_set(f"{key}/{jax.process_index()}", "1" if ok else "0")
    got = [
        client.blocking_key_value_get(f"{key}/{i}", TIMEOUT_MS) for i in range(jax.process_count())
    ]
    return all(v == "1" for v in got)
