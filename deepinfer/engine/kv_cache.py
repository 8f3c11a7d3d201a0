"""Paged KV-cache management: the block allocator (with prefix caching) and the pool sizing.

Every KV cache group gets its own pool tensors (allocated by the backend from the model's
KVCacheSpec, at the group's row width: KVCacheGroup.cache_spec); a block id names the same block
in every layer of a group. A model declares its groups (deepinfer.models.forward_batch.
KVCacheGroup): DeepSeek-V2/V3 one (full-attention latent caches that grow with the sequence);
DeepSeek-V4 a ring of a fixed number of blocks per request for its per-token caches, and
compressed-entry caches growing at 1/m blocks per token. GroupedBlockManager, the engine's,
keeps one BlockManager per group and allocates in all or none.

Prefix caching: a full block is identified by hash(parent block's hash, its token ids). When a
request is admitted, the longest run of its leading full blocks found in the cache is reused
(their reference counts go up) and only the rest is computed. Freed blocks keep their hash and
content until they are handed out again, least recently freed first.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

from deepinfer.engine.sequence import Sequence
from deepinfer.models.forward_batch import KVCacheGroup

_ROOT_HASH = 0x5EED


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Block:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out fixed-size KV blocks to sequences; optionally shares identical full prefixes.

    With a `group` (one of several, see GroupedBlockManager) it fills seq.block_tables[table]
    with the blocks that group needs (KVCacheGroup.blocks_for); else seq.block_table, one block
    per block_size tokens.

    Reuse order (what a prefix cache evicts first): free blocks form one queue; a fresh pool
    holds ids 0 .. N-1 in order, a freed block joins its tail (a sequence's blocks from its last
    to its first) and a new block comes from its head: the least recently freed block is reused
    first (FIFO), a cached prompt is evicted from its last block back, and a prefix hit on a free
    cached block takes it out of the queue until it is freed again (tests/test_engine_policies.py)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        group: KVCacheGroup | None = None,
        table: int = 0,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group, self.table = group, table
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_hits = 0  # tokens served from the prefix cache, for stats and tests

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of the first num_blocks full blocks of seq (extends seq.block_hashes)."""
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash((parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))))
        return hashes[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading full blocks. At least one token is always left to
        compute, so that the step that finishes the prompt produces logits."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        bs = self.block_size
        hits: list[int] = []
        for i, h in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // bs)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[int] | None = None) -> bool:
        """Make room for seq's next num_new_tokens tokens (after `prefix`, the blocks returned by
        match_prefix, when given). All or nothing: returns False, changing nothing, if the free
        blocks do not suffice."""
        prefix = prefix or []
        table = seq.block_tables[self.table]
        assert not prefix or not table, "prefix blocks are taken on admission only"
        need = self.blocks_needed(seq, num_new_tokens, len(prefix))
        revived = sum(1 for b in prefix if self.blocks[b].ref_count == 0)  # cached but free now
        if max(need, 0) + revived > len(self.free):
            return False
        for block_id in prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            table.append(block_id)
        for _ in range(need):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids, block.ref_count = None, (), 1
            table.append(block_id)
        self.num_prefix_hits += len(prefix) * self.block_size
        return True

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_prefix_blocks: int = 0) -> int:
        """Blocks seq lacks for its next num_new_tokens tokens (after that many prefix blocks)."""
        bs = self.block_size
        tokens = seq.num_computed_tokens + num_prefix_blocks * bs + num_new_tokens
        total = cdiv(tokens, bs) if self.group is None else self.group.blocks_for(tokens, bs)
        return total - len(seq.block_tables[self.table]) - num_prefix_blocks

    def positions_covered(self, seq: Sequence) -> int | None:
        """The positions p < this whose cache rows seq's blocks hold (KVCacheGroup.
        positions_covered; None: a ring's, which wraps)."""
        table = seq.block_tables[self.table] if self.table < len(seq.block_tables) else []
        if self.group is None:
            return len(table) * self.block_size
        return self.group.positions_covered(len(table), self.block_size)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's fully computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # only blocks whose tokens the host knows (a pending token's id is not known yet)
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        for i, h in enumerate(self._block_hashes(seq, num_full)):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None or h in self.cached:
                continue  # already registered (a prefix hit) or another block holds this content
            block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.cached[h] = block.block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); False, changing nothing, while
        a block is in use."""
        if any(block.ref_count for block in self.blocks):
            return False
        self.cached.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        return True

    def free_sequence(self, seq: Sequence) -> None:
        """Release seq's blocks. Its last blocks are queued for reuse first, so shared prefixes
        stay cached the longest."""
        table = seq.block_tables[self.table] if self.table < len(seq.block_tables) else []
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free[block_id] = None
        table.clear()


class GroupedBlockManager:
    """The blocks of a model's KV cache groups: one BlockManager per group, group g's blocks in
    seq.block_tables[g]. A request gets room in every group or in none; a ring group's blocks
    are taken at its first step and kept until it finishes or is preempted. Prefix caching
    shares the first group's blocks: models that support it have that group only
    (CausalLM.supports_prefix_caching)."""

    def __init__(
        self,
        groups: list[KVCacheGroup],
        num_blocks: list[int],
        block_size: int,
        enable_prefix_caching: bool = False,
    ) -> None:
        assert not enable_prefix_caching or len(groups) == 1, "prefix caching pages one cache group"
        self.groups = groups
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.managers = [
            BlockManager(n, block_size, enable_prefix_caching, group=g, table=i)
            for i, (g, n) in enumerate(zip(groups, num_blocks))
        ]

    @property
    def num_blocks(self) -> int:
        """Blocks of every group."""
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def num_prefix_hits(self) -> int:
        return self.managers[0].num_prefix_hits

    def match_prefix(self, seq: Sequence) -> list[int]:
        return self.managers[0].match_prefix(seq)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached blocks of every group; False, changing nothing, while one is in use."""
        if any(block.ref_count for m in self.managers for block in m.blocks):
            return False
        return all([m.reset_prefix_cache() for m in self.managers])

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[int] | None = None) -> bool:
        """Room for seq's next num_new_tokens tokens (after the first group's `prefix` blocks) in
        every group; False, changing nothing, if one group lacks free blocks."""
        first, rest = self.managers[0], self.managers[1:]
        while len(seq.block_tables) < len(self.managers):
            seq.block_tables.append([])
        if any(m.blocks_needed(seq, num_new_tokens) > m.num_free_blocks for m in rest):
            return False
        if not first.allocate(seq, num_new_tokens, prefix):  # all or nothing itself
            return False
        for m in rest:
            taken = m.allocate(seq, num_new_tokens)
            assert taken
        return True

    def positions_covered(self, seq: Sequence) -> int | None:
        """The positions whose rows seq's blocks hold in every growing group (None: rings only)."""
        covered = [c for m in self.managers if (c := m.positions_covered(seq)) is not None]
        return min(covered, default=None)

    def cache_full_blocks(self, seq: Sequence) -> None:
        self.managers[0].cache_full_blocks(seq)

    def free_sequence(self, seq: Sequence) -> None:
        for m in self.managers:
            m.free_sequence(seq)


# Host bytes the BlockManager spends per block (a Block with __slots__, its list slot, its entry
# in the free OrderedDict, its id), measured with tracemalloc at 227 and rounded up.
HOST_BYTES_PER_BLOCK = 256


def available_host_memory() -> int:
    """Bytes of host memory available to a new allocation (MemAvailable; all of it where
    /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 2**50 else f"{n / 2**40:.3g} TiB"


def check_kv_pool_fits(
    num_blocks: int,
    bytes_per_block: int,
    block_size: int,
    free_device_bytes: int,
    device_is_host: bool,
    source: str,
    host_bytes: int | None = None,
) -> None:
    """Raise ValueError naming `source` (the setting that asked for num_blocks, e.g.
    "num_gpu_blocks_override=10**12") unless a pool of num_blocks fits, checked before anything
    is allocated: its tensors in the free device memory, the block manager's objects
    (HOST_BYTES_PER_BLOCK each) in the available host memory (`host_bytes`, default
    available_host_memory()); both in host memory when the device is the host."""
    host_free = available_host_memory() if host_bytes is None else host_bytes
    if device_is_host:
        checks = [(bytes_per_block + HOST_BYTES_PER_BLOCK, host_free, "host memory (the device is the host)")]
    else:
        checks = [
            (bytes_per_block, free_device_bytes, "free device memory"),
            (HOST_BYTES_PER_BLOCK, host_free, "host memory for the block manager"),
        ]
    for per_block, have, what in checks:
        have = max(have, 0)
        if num_blocks * per_block > have:
            raise ValueError(
                f"{source}: a KV pool of {num_blocks} blocks of {block_size} tokens ({bytes_per_block} "
                f"bytes of KV cache and {HOST_BYTES_PER_BLOCK} bytes of host bookkeeping per block) needs "
                f"{_gib(num_blocks * per_block)} of {what}, but {_gib(have)} is available; at most "
                f"{have // per_block} blocks fit"
            )


def memory_budget(free_bytes: int, total_bytes: int, utilization: float) -> int:
    """Bytes the KV cache may take once the model is loaded: total * utilization minus what is
    already in use (vLLM's rule); negative when nothing is left."""
    return int(total_bytes * utilization) - (total_bytes - free_bytes)


def num_blocks_from_memory(
    free_bytes: int,
    total_bytes: int,
    utilization: float,
    bytes_per_block: int,
) -> int:
    """Blocks that fit in the engine's share of device memory once the model is loaded."""
    return max(memory_budget(free_bytes, total_bytes, utilization), 0) // bytes_per_block


def group_pool_blocks(groups: list[KVCacheGroup], num_blocks: int, max_num_seqs: int) -> list[int]:
    """Each group's pool for a cache of num_blocks blocks of tokens: a ring group one ring per
    request slot (max_num_seqs); a growing group the rows of num_blocks * BS tokens
    (cdiv(num_blocks, ratio) blocks), plus at ratio > 1 one block per request slot, since a
    request's last, partly filled block of entries stands for up to ratio * BS tokens."""
    pools = []
    for g in groups:
        if g.ring_blocks:
            pools.append(g.ring_blocks * max_num_seqs)
        else:
            pools.append(cdiv(num_blocks, g.ratio) + (max_num_seqs if g.ratio > 1 else 0))
    return pools


def fit_blocks(budget: int, pool_bytes: Callable[[int], int], most: int) -> int:
    """The largest num_blocks in [0, most] whose pool takes at most `budget` bytes
    (pool_bytes: num_blocks -> bytes, non-decreasing); 0 if none does."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pool_bytes(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo if pool_bytes(lo) <= budget else 0
