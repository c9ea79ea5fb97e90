"""What the connector faces need from TensorRT-LLM: the compat seam, connector metadata,
llm_args, the leader's assembly of publishers and consolidator, and metrics.
"""
