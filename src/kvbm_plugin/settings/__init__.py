"""Every setting kvbm_plugin reads, parsed and checked in one place (standard library
only); :mod:`kvbm_plugin.consolidator_config` is their face and re-exports them.
"""
