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


def request_handle(request: Any, req_id: int, deaths: deque[Any]) -> Any:
    """What the leader keeps of ``request``: a weak reference whose ``key`` is ``req_id``,
    appended to ``deaths`` when the object dies, or the object itself (no weak reference
    to it can be made: it cannot die while held)."""
    try:
        return weakref.KeyedRef(request, deaths.append, req_id)
    except TypeError:
        return request


def request_gone(handle: Any, *, executor_thread: bool = True) -> bool:
    """True when the request behind ``handle`` is finished or dead (None: never known). Off
    the executor thread only death is checked (a weak reference, no TRT-LLM object read)."""
    if handle is None:
        return False
    obj = handle() if isinstance(handle, weakref.ref) else handle
    if obj is None:
        return True
    return executor_thread and getattr(obj, "is_finished", False) is True
