"""Operator tools on top of everything else: the CLI, demo, doctor, sidecar, subscriber, the
router model and the chat workload.
"""
