"""The optional compiled fast paths (``kvbm_plugin._speedups``), behind one switch.

``_speedups.c`` is built at install time where a C compiler is available (``setup.py`` marks
it optional). Each function in it has a pure-Python reference in the module that uses it, and
the tests run both on the same input and compare the output. ``DYN_KVBM_NATIVE=0`` selects
the Python paths. No torch or TensorRT-LLM import.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

from kvbm_plugin.consolidator_config import NATIVE, native_enabled

try:
    from kvbm_plugin import _speedups as _built
except ImportError:  # installed without a C compiler
    _built = None


def speedups(env: Mapping[str, str] | None = None) -> ModuleType | None:
    """The compiled module, or None (not built, or switched off with ``DYN_KVBM_NATIVE``).

    Raises ConfigError for a value of ``DYN_KVBM_NATIVE`` that is not a boolean.
    """
    if not native_enabled(env):
        return None
    return _built


def describe(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(in use, one line for ``kvbm-plugin doctor``)."""
    if _built is None:
        return False, ("not built (no C compiler at install time): the pure-Python paths run; "
                       "reinstall with a compiler for the faster event sink")
    if not native_enabled(env):
        return False, f"built, switched off by {NATIVE}: the pure-Python paths run"
    return True, f"in use ({_built.__file__})"
