"""Build hook for the optional compiled fast paths; all metadata lives in pyproject.toml.

``optional=True``: where no C compiler is available the package installs without
``kvbm_plugin._speedups`` and runs its pure-Python reference paths (``kvbm-plugin doctor``
says which is in use).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvbm_plugin._speedups", ["src/kvbm_plugin/_speedups.c"],
                             optional=True)])
