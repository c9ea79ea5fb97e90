"""Shared helpers at the bottom of the package: rate-limited logs, safe reprs, entry-point
loading and the loader of the compiled loops. Imports nothing of the package but its settings.
"""
