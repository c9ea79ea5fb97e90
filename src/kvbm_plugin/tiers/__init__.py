"""Offload tiers: host memory (G2) and disk (G3), registered under ``kvbm_plugin.tiers``."""
