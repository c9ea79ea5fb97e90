"""The simulated engine's shape (:class:`EngineConfig`) and what it reports
(:class:`EngineStats`, :class:`RequestResult`).

Built by tests, the demo and the benchmarks before they start a
:class:`kvbm_plugin.testing.engine.SimulatedEngine` (one per attention-DP rank); read back from
it on the caller's thread. Kept apart from the engine's executor loop, which follows
TensorRT-LLM's ``py_executor.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbm_plugin.testing.kv_events import DEFAULT_EVENT_BUFFER_MAX_SIZE


@dataclass
class EngineConfig:
    """Shape of the simulated model and engine."""

    num_layers: int = 2
    num_kv_heads: int = 4  # total; each TP rank holds num_kv_heads // tp_size
    head_dim: int = 4
    tokens_per_block: int = 4
    num_gpu_blocks: int = 64
    tp_size: int = 1
    max_num_tokens: int = 256  # token budget per iteration; longer prompts are chunked
    max_batch_size: int = 8
    device: str = "cpu"  # "cuda" puts the pools on the GPU
    dtype: torch.dtype = torch.float32
    env: Mapping[str, str] = field(default_factory=dict)  # DYN_KVBM_* for the connector
    provide_block_hashes: bool = True  # RequestData.block_hashes (TRT-LLM >= ~1.3)
    max_seq_len: int = 4096  # the attention window reported in KV events
    tier_events: Any = None  # optional recorder for the leader's tier registrations
    vocab_size: int = 1000
    # TRT-LLM's default executor loop; False runs the plain loop (_executor_loop).
    overlap_scheduler: bool = True
    # Run TRT-LLM's KV-event dispatch thread (what LLM.get_kv_cache_events reads).
    trtllm_event_reader: bool = False
    event_buffer_max_size: int = DEFAULT_EVENT_BUFFER_MAX_SIZE  # kv_cache_config's
    # Ranks 1.. in child processes, completion reports over ZMQ (needs tp_size > 1).
    processes: bool = False
    kv_factor: int = 2  # 1: MLA (one latent per token)
    kv_cache_dtype: str = "auto"  # "fp8": FP8 values in an int8-stored pool
    # kv_cache_config.kv_events_config (fake_trtllm.KVEventsConfig): when enabled, TRT-LLM's
    # own streaming publisher sends the GPU tier (testing.trtllm_stream), the pull API is empty
    kv_events_config: Any = None
    # Attention-DP ranks (TRT-LLM's enable_attention_dp with tp_size of them): this engine is
    # rank dp_rank's own executor; testing.adp.AttentionDpEngine runs every rank.
    attention_dp: int = 1
    dp_rank: int = 0
    load_errors: bool = True  # handle_load_errors (TRT-LLM revisions with it); False: older


@dataclass
class EngineStats:
    iterations: int = 0
    forward_passes: int = 0
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    computed_prefill_tokens: int = 0  # prompt tokens the forward pass computed
    gpu_hit_tokens: int = 0  # prompt tokens reused from the GPU pool
    host_hit_tokens: int = 0  # prompt tokens onboarded from the host tier
    disk_hit_tokens: int = 0  # prompt tokens onboarded from the disk tier
    bytes_offloaded: int = 0  # summed over ranks
    bytes_onboarded: int = 0
    kv_mismatches: int = 0  # blocks whose KV differed from the forward's values
    recomputed_requests: int = 0  # handle_load_errors: their connector-loaded tokens redone


@dataclass
class RequestResult:
    request_id: int
    state: str
    tokens: list[int]
    gpu_hit_tokens: int
    host_hit_tokens: int
    disk_hit_tokens: int
    kv_mismatches: int
