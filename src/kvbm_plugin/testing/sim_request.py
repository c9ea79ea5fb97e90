"""One request as the simulated executor tracks it (:class:`SimRequest`), and its states.

The executor's own bookkeeping, not TensorRT-LLM's request object (the connector sees a
``fake_trtllm.LlmRequest``, made at admission): what the device has computed and sampled, what
the host has seen (the overlap scheduler lags by one pass), its blocks and what was reported
to the connector. Made by :meth:`kvbm_plugin.testing.engine.SimulatedEngine.submit` and
changed only by that engine's loop, on the thread that steps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbm_plugin.testing.fake_trtllm import LlmRequest

WAITING, LOADING, CONTEXT, GENERATION, SAVING, DONE = (
    "waiting", "loading", "context", "generation", "saving", "done")


@dataclass
class SimRequest:
    id: int
    prompt: list[int]
    max_new: int
    salt: str | None
    lora: int | None = None  # the LoRA task id (0 is an adapter too); None: the base model
    # multimodal items: (hash as 8 int32 parts, runs of (first prompt position, token count))
    mm: list[tuple[list[int], list[tuple[int, int]]]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # every token the device has
    host_len: int = 0  # tokens the request object shows (lags by one with overlap)
    state: str = WAITING
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    n_device: int = 0
    n_loaded: int = 0
    host_hit: int = 0
    disk_hit: int = 0
    generated: int = 0
    device_done: bool = False  # the last token is sampled (the host may not know yet)
    aborted: bool = False
    reported_tokens: int = 0
    reported_blocks: int = 0
    reserved: int = 0
    context_stored: bool = False  # store_context_blocks ran for the prompt
    chain: list[int] = field(default_factory=list)  # V1 hashes of full blocks so far
    host_finished: bool = False  # the request object is finished (its last token arrived)
    mismatches: int = 0
    llm_request: LlmRequest | None = None
