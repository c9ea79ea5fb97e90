"""The compiled loops: the optional C extensions, behind one switch (``DYN_KVBM_NATIVE``).

``events/_sink_c.c`` (KvEventSink's ingest loop and V2 hooks), ``consolidator/_core_c.c``
(ConsolidatorCore's dedup loops and its compact block), ``tiers/shared/_frame_c.c`` (the
shared tier's payload word sums), ``tiers/_keytable_c.c`` (the tier index's key table and,
in ``tiers/_keytable_rows.c``, its row writes) and
``tiers/_digests_c.c`` (the tiers' chained block digests) are built at install time where a
C compiler is available (``setup.py`` marks them optional). Each is the compiled form of code
whose reference stays in Python (``event_sink.py``, ``consolidator/core.py``,
``tiers/shared/frame.py``'s torch reductions, ``tiers/_rows.py``'s ``KeyTable`` and
``tiers/index.py``'s ``TierIndex._write_run``,
``tiers/content_keys.py``'s ``_keys_py``), and the tests run both on the same input and
compare. Each is kept because a target of docs/performance.md misses without it ("What each
compiled loop is for"): the event sink's executor cost per block, the consolidator's ingest
rate and the leader's heap per tier block, the shared tier's checksum share of onboarding, the
leader's executor cost per offloaded block (the key table) and per offloaded and onboarded
block (the digests). They use only CPython's public API (its
unstable tier's compact-int reads on 3.12 and later), so they build on every CPython the
package supports.
``DYN_KVBM_NATIVE=0`` selects the Python loops (the variable keeps its name: "native" there
means compiled). ``wire/_gate_c.c``, the connection gate's thread, is built the same way but is
not a loop with a faster reference: it is the memory bound of the capped sockets, so it runs
wherever it was built, whatever ``DYN_KVBM_NATIVE`` says (``wire/conn_gate.py``).
Imported by the components above when they are made, on whatever thread
makes them; no torch or TensorRT-LLM import.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Final

from kvbm_plugin.consolidator_config import NATIVE, compiled_loops_enabled


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:  # installed without a C compiler
        return None


# What was built, keyed by the component whose compiled loops the module holds.
_MODULES: Final = {
    "event_sink": "kvbm_plugin.events._sink_c",
    "consolidator": "kvbm_plugin.consolidator._core_c",
    "shared_frame": "kvbm_plugin.tiers.shared._frame_c",
    "tier_keys": "kvbm_plugin.tiers._keytable_c",
    "tier_digests": "kvbm_plugin.tiers._digests_c",
    "conn_gate": "kvbm_plugin.wire._gate_c",
}
_built: dict[str, ModuleType | None] = {name: _load(mod) for name, mod in _MODULES.items()}


def built(module: str) -> ModuleType | None:
    """The extension of ``module`` as built, whatever ``DYN_KVBM_NATIVE`` says (the
    connection gate's: module docstring), or None."""
    return _built[module]


def loops(module: str, env: Mapping[str, str] | None = None) -> ModuleType | None:
    """The compiled loops of ``module`` (a key of ``_MODULES``), or None: not built,
    or switched off with ``DYN_KVBM_NATIVE``.

    Raises ConfigError for a value of ``DYN_KVBM_NATIVE`` that is not a boolean.
    """
    if not compiled_loops_enabled(env):
        return None
    return _built[module]


def choose(module: str, native: bool | None, owner: str) -> ModuleType | None:
    """The loops a component's ``native=`` argument asks for: None = the compiled ones when
    built and not switched off by ``DYN_KVBM_NATIVE``, False = never, True = the compiled ones
    or ValueError naming ``owner``."""
    if native is False:
        return None
    compiled = loops(module, None if native is None else {})
    if native and compiled is None:
        raise ValueError(f"{owner}: native=True but {_MODULES[module]} was not built")
    return compiled


def describe(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(all in use, one line for ``kvbm-plugin doctor``). Raises ConfigError for a value of
    ``DYN_KVBM_NATIVE`` that is not a boolean, built or not (start-up refuses it either way)."""
    enabled = compiled_loops_enabled(env)
    missing = sorted(name for name, module in _built.items() if module is None)
    if missing:
        return False, (f"not built for {', '.join(missing)} (no C compiler at install time): "
                       "those run their pure-Python loops; reinstall with a compiler")
    if not enabled:
        return False, (f"built, switched off by {NATIVE}: the pure-Python loops run (the "
                       "connection gate stays compiled)")
    return True, "in use (" + ", ".join(
        f"{name}: {module.__name__}" for name, module in _built.items() if module) + ")"
