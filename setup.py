"""Build hook for the optional compiled fast paths; all metadata lives in pyproject.toml.

``optional=True``: where no C compiler is available the package installs without them and runs
its pure-Python reference loops (``kvbm-plugin doctor`` says which are in use).
"""

import sys

from setuptools import Extension, setup

_COMMON = ["src/kvbm_plugin/_util/native_common.h"]
_SINK = [*_COMMON, "src/kvbm_plugin/events/_rank_batch.h"]

setup(ext_modules=[
    Extension("kvbm_plugin.events._sink_c",
              ["src/kvbm_plugin/events/_sink_c.c", "src/kvbm_plugin/events/_rank_batch.c"],
              depends=_SINK, optional=True),
    Extension("kvbm_plugin.consolidator._core_c", ["src/kvbm_plugin/consolidator/_core_c.c",
                                                   "src/kvbm_plugin/consolidator/_core_remove.c",
                                                   "src/kvbm_plugin/consolidator/_core_block.c"],
              depends=[*_COMMON, "src/kvbm_plugin/consolidator/_core_c.h"], optional=True),
    # The tier index's key table (tiers/_rows.py's KeyTable is the reference), its row
    # loops (tiers/index.py's are theirs) and its views (tiers/_entry.py, index_rows.py).
    Extension("kvbm_plugin.tiers._keytable_c", ["src/kvbm_plugin/tiers/_keytable_c.c",
                                                "src/kvbm_plugin/tiers/_keytable_rows.c",
                                                "src/kvbm_plugin/tiers/_entry_views.c"],
              depends=[*_COMMON, "src/kvbm_plugin/tiers/_keytable_c.h"], optional=True),
    # The tiers' chained content digests (tiers/content_keys.py's _chained_py is the reference).
    Extension("kvbm_plugin.tiers._digests_c", ["src/kvbm_plugin/tiers/_digests_c.c"],
              depends=_COMMON, optional=True),
    # The connection gate's GIL-free thread (wire/conn_gate.py): Linux socket filters.
    Extension("kvbm_plugin.wire._gate_c", ["src/kvbm_plugin/wire/_gate_c.c"], optional=True),
    # -O3: GCC vectorizes the word-sum loop only from -O3 (some CPythons build extensions at
    # -O2), which is what brings the check under its cost target (docs/performance.md).
    Extension("kvbm_plugin.tiers.shared._frame_c", ["src/kvbm_plugin/tiers/shared/_frame_c.c"],
              depends=_COMMON, optional=True,
              extra_compile_args=[] if sys.platform == "win32" else ["-O3"]),
])
