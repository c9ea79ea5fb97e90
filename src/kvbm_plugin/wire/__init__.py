"""The KV-event stream: the wire codec, block identity as routers read it, the publisher ABC with
its ZMQ and null implementations, the replay server and reconnecting subscribers.
"""
