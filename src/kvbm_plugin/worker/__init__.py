"""The worker (TensorRT-LLM's connector worker; every rank): what the face
:class:`kvbm_plugin.connector_worker.KvbmConnectorWorker` moves the bytes with.
"""
