"""Whether TensorRT-LLM is done with a request it never told the connector about.

``PyExecutor`` (``py_executor.py`` @ 0004396720054) calls ``request_finished`` only from
``_send_kv_async``, for requests that finished; a cancelled or errored request is terminated
(its blocks freed) without any connector call. The request object itself says so: it is
``is_finished`` from the moment ``finish_by_reason`` ran, and it dies once TensorRT-LLM drops
it. The leader keeps a weak reference where the object allows one (a strong one otherwise: the
executor's connector manager keeps async-loading requests alive anyway) and asks once per
build; the keeper thread checks death only (never the object): each weak reference names its
request and queues itself in ``deaths`` when the object dies (the reference's callback, one
deque append on whichever thread dropped the object), so the keeper's check is O(deaths). Only
a request still tracked when its object dies is queued: a forgotten request's handle went
with its state (a weak reference freed first never calls back).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any


class RequestHandle(weakref.ref):
    """A weak reference to a request that names it (``key``: its request id). Made as a plain
    ``weakref.ref`` is (no Python-level constructor: ``weakref.KeyedRef``'s costs 0.47 us
    against 0.14 here, once per request on the executor thread)."""

    __slots__ = ("key",)


def request_handle(request: Any, req_id: int, deaths: deque[Any]) -> Any:
    """What the leader keeps of ``request``: a :class:`RequestHandle` of ``req_id``, appended
    to ``deaths`` when the object dies, or the object itself (no weak reference to it can be
    made: it cannot die while held)."""
    try:
        handle = RequestHandle(request, deaths.append)
    except TypeError:
        return request
    handle.key = req_id
    return handle


def request_gone(handle: Any) -> bool:
    """True when the request behind ``handle`` is finished or dead (None: never known). Reads
    the request object: the executor thread only (the keeper reaps the queued deaths)."""
    if handle is None:
        return False
    obj = handle() if isinstance(handle, weakref.ref) else handle
    if obj is None:
        return True
    return getattr(obj, "is_finished", False) is True
