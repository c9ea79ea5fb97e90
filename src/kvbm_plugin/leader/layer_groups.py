"""Models with several KV layer groups (one per attention window: variable sliding-window
attention, VSWA, e.g. Gemma 3 and GPT-OSS): the leader's side.

TensorRT-LLM's connector API (``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py``
@ 035ab91cad04, stored id 68382362537) hands such a cache per layer group: the scheduler gets
``update_state_after_alloc_by_layer_group(request, ids_by_group)``,
``request_finished_by_layer_group(request, ids_by_group)`` and
``RequestData.new_block_ids_by_layer_group`` (the flat ``new_block_ids`` is empty with several
groups); a sliding group keeps every block ordinal but reports page ``-1`` where its window
has passed (``connectors/kv_cache_layout.py``, ``valid_page_slots``, stored id 57717663703).
The worker side is :mod:`kvbm_plugin.worker.layer_group_copies`.

How the plugin keeps a block of such a model (one tier entry per block, every group inside):

* A tier slot holds **every group's page** of one block ordinal, group after group (the slot
  is as large as the groups' ``bytes_per_page`` summed). Its key is the block's content key,
  so a block's groups live and die together, and the key never names one group's bytes as
  another's (the rule of upstream's VSWA example connector, stored id 57516862026: "a cache key
  must include the layer group": here the group is the slot's segment, and the disk header
  records the windows (``connector/llm_args.py``, ``disk_identity_suffix``) and a digest of
  every group's window, regions and layers, ``GroupPages.identity``).
* A block is offloaded only while **every** group holds a live page for it: a page reported
  ``-1`` is never read, and a sliding group's page only while the block is inside its window
  of the tokens computed after this iteration's forward (:meth:`LayerGroups.in_window`), so a
  sliding group never contributes more than its window of a sequence at the time of a save.
* Servable = upstream's example rule: a block is servable only when every group holds it, and
  a prefix only up to the first block any group lacks. ``get_num_new_matched_tokens`` needs no
  change for it: an entry exists only with every group inside, and the tiers are
  prefix-closed. Why not "a sliding group only needs the last window before the resume point"
  (which would serve more): the router sees one name per block and counts a prefix of
  advertised blocks, so the engine must serve exactly the prefix the router can see, or the
  router's estimate and the engine's reuse disagree.
* One name per block for the router: the block hash of the largest-window group, the only
  life cycle TensorRT-LLM's own streaming publisher reports (``set_layer_group_window_sizes``
  in ``kv_cache_events.py`` @ 44004b3864a7 / 13599e98c71c). The tier STORE is registered when
  the whole slot is written on every rank, so a block is advertised only while every group
  holds it.
* Hybrid models (Mamba / linear-attention layers) are refused (worker side): their state
  reuses only at snapshot boundaries (``mamba_cache_manager_v2.py`` @ 28295084972c coerces
  block reuse to ``PER_REQUEST``: "SSM reuse is valid only at explicit snapshot
  boundaries"), which a per-block copy cannot honour.

The leader's per-group hooks call :class:`LayerGroupPages`; all of it runs under the leader's
lock on the executor thread. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbm_plugin.connector.llm_args import configured_windows
from kvbm_plugin.consolidator_config import ConfigError

# Published by rank 0's worker (register_kv_cache_layout), read by the in-process leader.
_GROUP_WINDOWS: dict[str, tuple[int | None, ...]] = {}


def publish_group_windows(group: str, windows: Sequence[int | None]) -> None:
    """Rank 0's worker tells an in-process leader each layer group's window, by group id."""
    _GROUP_WINDOWS[group] = tuple(windows)


def group_windows(group: str) -> tuple[int | None, ...] | None:
    return _GROUP_WINDOWS.get(group)


def forget_group_windows(group: str) -> None:
    _GROUP_WINDOWS.pop(group, None)


def refuse_unsupported(llm_args: Any, env: Mapping[str, str], has_grouped_api: bool) -> None:
    """Refuse, at construction, what several layer groups cannot run with, in one line naming
    the windows: a TensorRT-LLM revision without the per-group API, the shared tier (its keys
    and pages are per device block), and a disk tier without a host tier (a disk-only save
    reads the device page on the transfer thread after the sliding window may have moved)."""
    windows = configured_windows(llm_args)
    if not windows:
        return
    named = f"kv_cache_config.max_attention_window has {len(windows)} windows {list(windows)}"
    v2 = getattr(getattr(llm_args, "kv_cache_config", None), "use_kv_cache_manager_v2", None)
    if v2 is False:  # the C++ KVCacheManager hands the connector one flat page list
        raise ConfigError(f"kvbm_plugin: {named} (several KV layer groups) but "
                          "kv_cache_config.use_kv_cache_manager_v2=False: the connector gets "
                          "the groups' pages only from KVCacheManagerV2; set it to True or auto")
    if not has_grouped_api:
        raise ConfigError(f"kvbm_plugin: {named} (several KV layer groups) but this "
                          "TensorRT-LLM has no update_state_after_alloc_by_layer_group: run "
                          "without the connector, with one window, or on TensorRT-LLM >= "
                          "035ab91cad04")
    from kvbm_plugin.settings.shared import load_shared_settings

    if load_shared_settings(env) is not None:
        raise ConfigError(f"kvbm_plugin: {named}: the shared tier does not support several "
                          "layer groups yet; unset DYN_KVBM_SHARED_TIER or run one window")
    from kvbm_plugin.consolidator_config import load_tier_settings

    tiers = load_tier_settings(env)
    if tiers.disk_enabled and not tiers.host_enabled:
        raise ConfigError(f"kvbm_plugin: {named}: the disk tier needs the host tier "
                          "(DYN_KVBM_CPU_CACHE_GB) with several layer groups")


@dataclass(frozen=True)
class LayerGroups:
    """The layer groups as the leader sees them: each group's window by group id."""

    windows: tuple[int | None, ...]  # None: full attention
    block_size: int

    @property
    def rep(self) -> int:
        """The group whose page stands for the block (largest window; full attention wins,
        then the lowest id), as TensorRT-LLM's streaming publisher picks its life cycle."""
        big = max(range(len(self.windows)),
                  key=lambda g: (self.windows[g] is None, self.windows[g] or 0, -g))
        return big

    def in_window(self, group: int, index: int, valid_tokens: int) -> bool:
        """Whether block ``index`` of ``group`` still has a live page once ``valid_tokens``
        tokens are computed: some token of it is within the window of the next token."""
        window = self.windows[group]
        return window is None or (index + 1) * self.block_size > valid_tokens - window


def grouped_ids(rd: Any) -> list[list[int]] | None:
    """``RequestData.new_block_ids_by_layer_group`` when it holds several groups, else None
    (one group: the flat ``new_block_ids`` is that group's list)."""
    by_group = getattr(rd, "new_block_ids_by_layer_group", None)
    if by_group and len(by_group) > 1:
        return [list(ids) for ids in by_group]
    return None


class LayerGroupPages:
    """Which page of each layer group holds a request's block, as the leader sees it: the
    groups' windows (learned from the first call that carries several groups) and, per block,
    whether every group still has a live page to offload it from. Owned by the leader; the
    request states are passed in. With one group every method reduces to the flat page list."""

    def __init__(self, group: str, block_size: int, configured: tuple[int, ...],
                 stats: dict[str, int]) -> None:
        """``group``: the leader's process-group id (rank 0's worker publishes the windows under
        it); ``configured``: kv_cache_config's distinct windows
        (:func:`~kvbm_plugin.connector.llm_args.configured_windows`)."""
        self._group = group
        self._block_size = block_size
        self.configured = configured
        self._stats = stats
        self._layer_groups: LayerGroups | None = None

    def groups_for(self, count: int) -> LayerGroups:
        """The groups of a call carrying ``count`` lists: from rank 0's layout when it was
        published, else from the configured windows (same count), else an error naming both."""
        groups = self._layer_groups
        if groups is not None and len(groups.windows) == count:
            return groups
        windows = group_windows(self._group)
        if windows is None and len(self.configured) == count:
            # No in-process worker layout: the configured windows, one group each, the
            # largest (full attention) first as V2 orders life cycles by window.
            ordered = sorted(self.configured, reverse=True)
            windows = (None, *ordered[1:])
        if windows is None or len(windows) != count:
            raise RuntimeError(f"kvbm_plugin: TensorRT-LLM reported {count} layer groups; the "
                               f"configured windows are {list(self.configured)} and "
                               f"the workers' layout {windows}: they do not describe one cache")
        self._layer_groups = groups = LayerGroups(tuple(windows), self._block_size)
        return groups

    def absorb_block_ids(self, state: Any, rd: Any) -> None:
        """Fold one RequestData's new pages in: the flat list, or every group's list (the
        representative group's pages then stand in ``state.block_ids``)."""
        by_group = grouped_ids(rd)
        if by_group is None:
            if self.configured and rd.new_block_ids:
                # Several windows, one flat list: a cache that does not describe its groups
                # (the C++ KVCacheManager); offloading it would save one group's pages only.
                raise RuntimeError(f"kvbm_plugin: kv_cache_config.max_attention_window has "
                                   f"windows {list(self.configured)} but TensorRT-LLM "
                                   "reported one flat page list: run on KVCacheManagerV2")
            state.block_ids.extend(rd.new_block_ids)
            return
        groups = self.groups_for(len(by_group))
        if not state.group_pages:
            state.group_pages = [[] for _ in by_group]
        for pages, new in zip(state.group_pages, by_group, strict=True):
            pages.extend(new)
        state.block_ids.extend(by_group[groups.rep])

    def save_block(self, state: Any, index: int, count: bool = True) -> int:
        """The device block to offload block ``index`` from, or -1: with several groups, -1
        unless every group holds a live page for it now (reported, not -1, in its window)."""
        if not state.group_pages:
            return int(state.block_ids[index])
        groups = self._layer_groups
        assert groups is not None
        for g, pages in enumerate(state.group_pages):
            if index >= len(pages) or pages[index] < 0 \
                    or not groups.in_window(g, index, state.valid_tokens):
                if count:
                    self._stats["window_skips"] += 1
                return -1
        return int(state.block_ids[index])

    def can_resave(self, state: Any, tier: Any, index: int) -> bool:
        """Whether block ``index`` (a parent that left ``tier``) can be offloaded again from
        the device: one group, its device block exists (the walk back resaves its own
        missing ancestors in turn); several groups, every block from it back to the nearest
        ancestor still in ``tier`` has a live page in every group (else the walk back would
        meet a block no group can give, forever)."""
        if not state.group_pages:
            return int(state.block_ids[index]) >= 0
        for j in range(index, -1, -1):
            if self.save_block(state, j, count=False) < 0:
                return False
            if j and state.keys[j - 1] in tier:
                return True
        return True

    @staticmethod
    def save_pages(state: Any, index: int) -> tuple[int, ...]:
        """Every group's page of block ``index`` (() for a one-group model)."""
        return tuple(int(p[index]) for p in state.group_pages) if state.group_pages else ()

    @staticmethod
    def load_pages(state: Any, index: int) -> tuple[int, ...]:
        """Every group's page to load block ``index`` into (-1: that group has none there,
        a sliding window's passed block: never written); () for a one-group model."""
        alloc = state.alloc_pages
        if not alloc:
            return ()
        return tuple(int(p[index]) if index < len(p) else -1 for p in alloc)
