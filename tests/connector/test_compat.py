"""The TRT-LLM compat layer on both import paths, absent, and installed-but-broken."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from kvbm_plugin.connector import trtllm_compat as _trtllm_compat

NEW_PATH = "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"
OLD_PATH = "tensorrt_llm._torch.pyexecutor.kv_cache_connector"


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []  # a package, so submodule imports go through sys.modules
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _connector_module(path: str) -> types.ModuleType:
    class KvCacheConnectorScheduler:
        def __init__(self, llm_args: Any) -> None:
            self._llm_args = llm_args

    class KvCacheConnectorWorker:
        def __init__(self, llm_args: Any) -> None:
            self._llm_args = llm_args

    class SchedulerOutput:
        pass

    return _module(path, KvCacheConnectorScheduler=KvCacheConnectorScheduler,
                   KvCacheConnectorWorker=KvCacheConnectorWorker, SchedulerOutput=SchedulerOutput)


@pytest.fixture
def fake_trtllm(monkeypatch) -> Iterator[Any]:
    """Installs stand-in tensorrt_llm packages; yields a function adding a connector module."""
    for name in list(sys.modules):
        if name == "tensorrt_llm" or name.startswith("tensorrt_llm."):
            monkeypatch.delitem(sys.modules, name)
    for name in ("tensorrt_llm", "tensorrt_llm._torch", "tensorrt_llm._torch.pyexecutor"):
        extra = {"__version__": "1.2.1"} if name == "tensorrt_llm" else {}
        monkeypatch.setitem(sys.modules, name, _module(name, **extra))

    def add(path: str) -> types.ModuleType:
        parent = path.rsplit(".", 1)[0]
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, _module(parent))
        module = _connector_module(path)
        monkeypatch.setitem(sys.modules, path, module)
        return module

    yield add
    monkeypatch.undo()
    importlib.reload(_trtllm_compat)


def _reload() -> types.ModuleType:
    return importlib.reload(_trtllm_compat)


def test_new_path_preferred(fake_trtllm) -> None:
    new = fake_trtllm(NEW_PATH)
    fake_trtllm(OLD_PATH)
    compat = _reload()
    assert compat.KvCacheConnectorScheduler is new.KvCacheConnectorScheduler
    assert compat.KvCacheConnectorWorker is new.KvCacheConnectorWorker
    assert compat.SchedulerOutput is new.SchedulerOutput
    assert compat.COMPAT.module == NEW_PATH
    assert compat.COMPAT.trtllm_version == "1.2.1"
    assert compat.COMPAT.installed and compat.COMPAT.error is None


def test_old_path_fallback(fake_trtllm) -> None:
    old = fake_trtllm(OLD_PATH)
    compat = _reload()
    assert compat.KvCacheConnectorScheduler is old.KvCacheConnectorScheduler
    assert compat.COMPAT.module == OLD_PATH


def test_connector_classes_subclass_the_base_in_use(fake_trtllm) -> None:
    new = fake_trtllm(NEW_PATH)
    _reload()
    from kvbm_plugin import connector_leader, connector_worker

    # Reloading rebinds the module attributes to new classes; put the originals back afterwards
    # (a second reload would leave modules imported earlier, e.g. testing.engine, holding
    # classes that later tests' monkeypatches do not reach).
    saved = [(m, dict(vars(m))) for m in (connector_leader, connector_worker)]
    try:
        leader = importlib.reload(connector_leader)
        worker = importlib.reload(connector_worker)
        assert issubclass(leader.KvbmConnectorLeader, new.KvCacheConnectorScheduler)
        assert issubclass(worker.KvbmConnectorWorker, new.KvCacheConnectorWorker)
    finally:
        sys.modules.pop(NEW_PATH, None)
        importlib.reload(_trtllm_compat)
        for module, attrs in saved:
            vars(module).clear()
            vars(module).update(attrs)


class _BrokenNativeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``tensorrt_llm._torch.pyexecutor.connectors`` fail like a missing libcuda."""

    target = "tensorrt_llm._torch.pyexecutor.connectors"

    def find_spec(self, name, path, target=None):  # noqa: ANN001
        if name == self.target:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001
        return None

    def exec_module(self, module) -> None:  # noqa: ANN001
        raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")


def test_installed_but_broken_warns_once_with_cause(fake_trtllm, monkeypatch, caplog) -> None:
    monkeypatch.setattr(sys, "meta_path", [_BrokenNativeFinder(), *sys.meta_path])
    with caplog.at_level(logging.DEBUG, logger=_trtllm_compat.__name__):
        compat = _reload()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "libcuda.so.1" in warnings[0].getMessage()
    assert compat.COMPAT.module == compat.STANDIN
    assert compat.COMPAT.installed and "libcuda.so.1" in (compat.COMPAT.error or "")
    assert compat.KvCacheConnectorScheduler is compat.StandinKvCacheConnectorScheduler


def test_not_installed_is_quiet(monkeypatch, caplog) -> None:
    for name in list(sys.modules):
        if name.startswith("tensorrt_llm"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorrt_llm" else None)
    try:
        with caplog.at_level(logging.DEBUG, logger=_trtllm_compat.__name__):
            compat = _reload()
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        assert not compat.COMPAT.installed and compat.COMPAT.trtllm_version is None
        assert compat.KvCacheConnectorWorker is compat.StandinKvCacheConnectorWorker
    finally:
        monkeypatch.undo()
        importlib.reload(_trtllm_compat)


def test_standin_bases_have_trtllm_constructor_and_methods() -> None:
    scheduler = _trtllm_compat.StandinKvCacheConnectorScheduler
    worker = _trtllm_compat.StandinKvCacheConnectorWorker
    assert scheduler.__abstractmethods__ == {
        "build_connector_meta", "get_num_new_matched_tokens", "request_finished",
        "update_state_after_alloc"}
    assert worker.__abstractmethods__ == {
        "register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
        "wait_for_save", "get_finished"}

    class Worker(worker):  # type: ignore[misc, valid-type]
        register_kv_caches = start_load_kv = wait_for_layer_load = save_kv_layer = (
            lambda self, *a: None)
        wait_for_save = get_finished = lambda self, *a: None  # noqa: E731

    instance = Worker(llm_args="args")
    assert instance._llm_args == "args"
    instance.bind_connector_meta({"x": 1})
    assert instance.get_connector_meta() == {"x": 1}
    assert instance.register_forward_pass_callable() is None


class _Manager:
    def get_latest_events(self, timeout_ms: int = 0) -> list:
        return []


class _V2Manager:
    class event_manager:  # noqa: N801 - attribute shape of KVCacheManagerV2
        @staticmethod
        def add_stored_block_event_from_block(block: Any) -> None:
            return None


class _PyExecutorShaped:
    def __init__(self, manager: Any) -> None:
        self.kv_cache_manager = manager

    def loop(self) -> Any:
        return _connector_call()


def _connector_call() -> Any:
    return _trtllm_compat.find_kv_cache_manager()


def test_find_kv_cache_manager_through_the_callers_self() -> None:
    manager = _Manager()
    assert _PyExecutorShaped(manager).loop() is manager
    v2 = _V2Manager()
    assert _PyExecutorShaped(v2).loop() is v2


def test_find_kv_cache_manager_through_a_local() -> None:
    kv_cache_manager = _Manager()
    assert _connector_call() is kv_cache_manager


def test_find_kv_cache_manager_ignores_managers_without_events() -> None:
    assert _PyExecutorShaped(object()).loop() is None
    assert _connector_call() is None


def test_no_serializer_without_trtllm() -> None:
    if not _trtllm_compat.COMPAT.installed:
        assert _trtllm_compat.kv_event_serializer() is None
