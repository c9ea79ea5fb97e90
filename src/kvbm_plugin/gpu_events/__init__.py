"""Where GPU-tier events come from: the sources that attach the event sink to TensorRT-LLM's KV
cache manager (tap, drain, V2 hooks), the block-name table and the sink's compiled loop.
"""
