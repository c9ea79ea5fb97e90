"""Models of the routers that read the plugin's streams (NVIDIA Dynamo's indexer, llm-d's
indexer and scorer, a strict view): for the demo, the tests and the benchmarks.
"""
