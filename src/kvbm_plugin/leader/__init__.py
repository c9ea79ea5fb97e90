"""The leader (TensorRT-LLM's connector scheduler; rank 0, or each attention-DP rank):
what the face :class:`kvbm_plugin.connector_leader.KvbmConnectorLeader` decides with.
"""
