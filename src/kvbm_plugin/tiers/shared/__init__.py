"""The shared tier (G4): KV blocks in a store every engine of a deployment reads and writes.

* :mod:`.keys`: the object key of one rank's shard of one block, and the content digest in it.
* :mod:`.store`: :class:`~.store.SharedStore`, the interface a store client implements (one per
  worker process; called from background threads only, never TensorRT-LLM's executor thread).
* :mod:`.mooncake`, :mod:`.redis_store`: the store clients (entry points ``mooncake``, ``redis``).
* :mod:`.breaker`: GuardedStore, the circuit breaker every client runs behind.
* :mod:`.factory`: ``open_store(settings)``, the client ``DYN_KVBM_SHARED_TIER`` names, guarded.
"""
