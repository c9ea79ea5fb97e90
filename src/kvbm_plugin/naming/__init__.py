"""What each block is called, for every source: import from :mod:`kvbm_plugin.naming.names`,
the face; the ``_``-modules are its private pieces.
"""
