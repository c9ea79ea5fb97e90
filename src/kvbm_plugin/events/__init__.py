"""Where GPU-tier events come from: the sources that attach the event sink to TensorRT-LLM's KV
cache manager (tap, drain, V2 hooks), the fields read from its events, a dp rank's batch and
the sink's compiled loop. What each block is called is :mod:`kvbm_plugin.naming.names`'.
"""
