"""KvbmConnectorWorker is one class: TensorRT-LLM's base (or its stand-in) and nothing of this
project's mixed in; its collaborators are objects it owns (docs/architecture.md, "The worker")."""

from __future__ import annotations

from kvbm_plugin.connector_worker import KvbmConnectorWorker


def test_the_worker_has_no_base_class_of_this_project() -> None:
    ours = [c.__qualname__ for c in KvbmConnectorWorker.__mro__[1:]
            if c.__module__.startswith("kvbm_plugin")
            and c.__module__ != "kvbm_plugin.connector.trtllm_compat"]
    assert ours == []
    assert len(KvbmConnectorWorker.__bases__) == 1
    assert KvbmConnectorWorker.__bases__[0].__name__.endswith("KvCacheConnectorWorker")
