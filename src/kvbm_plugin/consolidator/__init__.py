"""The consolidator: the pure de-duplicating core, its compiled loops and the socket shell
around them.

Import its names from :mod:`kvbm_plugin.consolidator.service` (the public face). The modules,
bottom to top: ``blocks`` (block layout and per-rank maps), ``inputs`` (what an event may
carry), ``held_back`` (prefix closure: held back, released, cascaded), ``core`` (the dedup state
machine; compiled loops in ``_core_c.c`` and ``_core_remove.c``), ``streams`` (the shell's
sequence, replay and apply of each rank's GPU-tier stream) and ``service`` (the shell: lifecycle,
registrations, output).
"""
