"""The consolidator: the pure de-duplicating core, its compiled loops and the socket shell
around them.
"""
