"""The consolidator's block state: the block layout, the per-dp-rank maps, slots and identities.

Used by :mod:`kvbm_plugin.consolidator.core` (the dedup state machine) and
:mod:`kvbm_plugin.consolidator.held_back` (prefix closure), on the one thread that owns a core.
The compiled loops (``consolidator/_core_c.c``) read and write these layouts directly (its
``B_*`` enum mirrors the indices below), so the two stay in step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from kvbm_plugin.wire.events import MEDIA

if TYPE_CHECKING:
    from kvbm_plugin.consolidator.held_back import HeldBack

# Sources of residency. The engine's GPU-tier stream is one source whatever medium its events
# carry; the registration API (the leader's host and disk tiers) is the other.
SOURCE_ENGINE: Final = 0
SOURCE_TIERS: Final = 1
SOURCE_NAMES: Final = ("engine", "tiers")
TIER_INDEX: Final = {medium: i for i, medium in enumerate(MEDIA)}  # GPU 0 .. EXTERNAL 3
NUM_SLOTS: Final = len(SOURCE_NAMES) * len(MEDIA)  # a slot is one (source, tier)

MASK: Final = (1 << 64) - 1
I64_MAX: Final = (1 << 63) - 1
U64: Final = 1 << 64
ROOT: Final = 0  # parent identity of a root block
# Salt of the parent identity of a block whose parent hash no source knows: such a block must
# not be confused with a root block carrying the same tokens.
UNKNOWN_PARENT: Final = 0x6B76626D5F706172


def slot_of(source: int, tier: int) -> int:
    return source * len(MEDIA) + tier


def slot_name(slot: int) -> str:
    return f"{SOURCE_NAMES[slot // len(MEDIA)]}/{MEDIA[slot % len(MEDIA)]}"


def wire_hash(value: int) -> int:
    """Signed int64 wire form of a u64 hash (the form every output event carries)."""
    return value - U64 if value > I64_MAX else value


# A block is a plain list (creating one is several times cheaper than an object, and the ingest
# hot path creates one per stored block), or, in a core that runs the compiled loops, their
# ``Block`` (``consolidator/_core_block.c``): the same items at the same indices, read and
# written the same way, in one allocation of 96 bytes instead of a list's 152, with the four
# counters (CHILDREN, TOTAL, ALIAS_SLOT, HELD_BACK) as machine ints. Layout, by index:
IDENT: Final = 0  # content-chain identity (the key in _Rank.blocks)
PUB: Final = 1  # published hash, u64: the first external hash seen (unless it clashed)
WIRE: Final = 2  # the published hash as signed int64, what the output carries
PARENT: Final = 3  # parent block or None; kept alive by this block's entry in CHILDREN
CHILDREN: Final = 4  # how many live blocks have this one as their parent
TOTAL: Final = 5  # (slot, external hash) holdings; 0 = resident nowhere
COUNTS: Final = 6  # passthrough only: holdings per medium [GPU, CPU, DISK, EXTERNAL]; None in dedup
ALIAS_SLOT: Final = 7  # the first external hash that names this block: its slot...
ALIAS_EXT: Final = 8  # ...and the hash (most blocks have exactly one)
MORE_ALIASES: Final = 9  # further (slot, hash) pairs, or None
# The live children by identity (never the blocks themselves: a child holds its parent, so a
# parent holding its children would make every chain a reference cycle): None (no child), one
# child's identity (the common case, a chain), or an insertion-ordered dict of identities.
# A walk of a block's descendants (a cascade) costs what they are, not what the rank holds.
KIDS: Final = 10
# In how many medium groups the block is held back (dedup: 0 or 1; see held_back.py): what the
# compiled loops read to leave a held-back block to the Python code without a lookup.
HELD_BACK: Final = 11
BLOCK_LEN: Final = 12
Block = list  # one block of one dp rank (or a compiled Block), alive while resident or a parent


def add_kid(parent: Block, ident: int) -> None:
    """Record a new child of ``parent`` (the C loops' ``add_kid`` does the same)."""
    kids = parent[KIDS]
    if kids is None:
        parent[KIDS] = ident
    elif type(kids) is dict:
        kids[ident] = None
    else:
        parent[KIDS] = {kids: None, ident: None}


def drop_kid(parent: Block, ident: int) -> None:
    """Forget a collected child of ``parent`` (the C loops' ``drop_kid`` does the same)."""
    kids = parent[KIDS]
    if type(kids) is dict:
        kids.pop(ident, None)
        if not kids:
            parent[KIDS] = None
    elif kids == ident:
        parent[KIDS] = None


def kids_of(blocks: dict[int, Block], block: Block) -> list[Block]:
    """The live children of ``block``, oldest first."""
    kids = block[KIDS]
    if kids is None:
        return []
    if type(kids) is dict:
        return [blocks[ident] for ident in kids]
    return [blocks[kids]]


class _Rank:
    """All state of one dp rank; dp ranks never share blocks."""

    __slots__ = ("blocks", "known", "held", "unlisted", "out", "visible", "last_remove",
                 "hidden", "orphans")

    def __init__(self, hidden: list[HeldBack]) -> None:
        self.blocks: dict[int, Block] = {}  # identity -> block
        # Per slot: external hash -> block, for every alias of a live block (parent lookups
        # must work after a tier evicted the parent while a child still lives).
        self.known: list[dict[int, Block]] = [{} for _ in range(NUM_SLOTS)]
        # Per slot: external hashes that slot holds now -> block (the residency itself).
        self.held: list[dict[int, Block]] = [{} for _ in range(NUM_SLOTS)]
        # Published u64 hash -> block, only for the blocks the known maps do not find by it:
        # a derived hash, or a first alias that another block's store took over. Every other
        # block publishes its first external hash, which known[ALIAS_SLOT] maps to it (see
        # pub_taken): no map entry per block for the published hashes. Empty in normal use.
        self.unlisted: dict[int, Block] = {}
        self.out: list[dict[str, Any]] = []  # output wire events not yet taken
        # Downstream-visible units: blocks (dedup) or (block, medium) pairs (passthrough).
        self.visible = 0
        self.last_remove: dict[str, Any] | None = None  # the BlockRemoved being extended
        # Per medium group (dedup: group 0 only): the blocks resident in that group but not
        # published because their parent is not (see held_back.py). Empty in normal operation.
        self.hidden = hidden
        # Identities of blocks stored under a parent hash no source knew: never published.
        self.orphans: set[int] = set()


def pub_taken(rank: _Rank, pub: int) -> bool:
    """Whether a live block of ``rank`` publishes the u64 hash ``pub``: one the known maps
    name by it and that publishes it, or one in ``rank.unlisted`` (the compiled loops'
    ``pub_taken`` does the same)."""
    if pub in rank.unlisted:
        return True
    for known in rank.known:
        if known:
            block = known.get(pub)
            if block is not None and block[PUB] == pub:
                return True
    return False


def set_known(rank: _Rank, slot: int, ext: int, block: Block) -> None:
    """``known[slot][ext] = block``; a block the map named by its published hash before is
    listed in ``rank.unlisted`` from then on (the compiled loops do the same)."""
    known = rank.known[slot]
    old = known.get(ext)
    if old is not None and old is not block and old[PUB] == ext:
        rank.unlisted[ext] = old
    known[ext] = block


def collect(rank: _Rank, block: Block | None) -> None:
    """Forget blocks resident nowhere with no live child, walking up the chain."""
    blocks = rank.blocks
    known = rank.known
    unlisted = rank.unlisted
    while block is not None and block[TOTAL] == 0 and block[CHILDREN] == 0:
        ident = block[IDENT]
        del blocks[ident]
        slot_map = known[block[ALIAS_SLOT]]
        if slot_map.get(block[ALIAS_EXT]) is block:
            del slot_map[block[ALIAS_EXT]]
        if block[MORE_ALIASES] is not None:
            for slot, ext in block[MORE_ALIASES]:
                slot_map = known[slot]
                if slot_map.get(ext) is block:
                    del slot_map[ext]
        if unlisted and unlisted.get(block[PUB]) is block:
            del unlisted[block[PUB]]
        if rank.orphans:
            rank.orphans.discard(ident)
        parent = block[PARENT]
        if parent is not None:
            parent[CHILDREN] -= 1
            drop_kid(parent, ident)
        block = parent
