"""Paged KV-cache management: the block allocator (with prefix caching) and the pool sizing.

Every KV cache group gets its own pool tensors (allocated by the backend from the model's
KVCacheSpec, at the group's row width: KVCacheGroup.cache_spec); a block id names the same block
in every layer of a group. A model declares its groups (deepinfer.models.forward_batch.
KVCacheGroup): DeepSeek-V2/V3 one (full-attention latent caches that grow with the sequence);
DeepSeek-V4 a ring of a fixed number of blocks per request for its per-token caches, and
compressed-entry caches growing at 1/m blocks per token. GroupedBlockManager, the engine's,
keeps one BlockManager per group and allocates in all or none.

Prefix caching: a full block is identified by hash(parent block's hash, its token ids, and the
content hashes of the images whose spans it overlaps, engine.images). When a
request is admitted, the longest run of its leading full blocks found in the cache is reused
(their reference counts go up) and only the rest is computed. Freed blocks keep their hash and
content until they are handed out again, least recently freed first. With several groups
(DeepSeek-V4's ring and compressed-entry groups) a cached prefix of P tokens is the entry blocks
it fills (shared), the one it fills in part (copied) and the ring rows of its last L positions
(copied from a pool of retained ring blocks): GroupedBlockManager, docs/prefix_caching.md.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.engine.sequence import Sequence
from deepinfer.models.forward_batch import KVCacheGroup

_ROOT_HASH = 0x5EED


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Block:
    __slots__ = ("block_id", "hash", "partial_keys", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.partial_keys: list[int] = []  # its registrations as a partly valid block (BlockManager.partial)


@dataclass(frozen=True)
class PrefixHit:
    """A request's cached prefix: its first num_tokens tokens need no compute.

    blocks   per cache group, the cached blocks its table starts with (shared: reference counted)
    ring     several groups (DeepSeek-V4): the retained ring rows to copy into the request's ring,
             as (token block t, retained block id): rows of positions [t * BS, (t + 1) * BS)
    partial  per cache group, (cached block, rows): the first `rows` rows of that block copied
             into the block after `blocks` (a growing group's last, partly filled block), or None
    """

    num_tokens: int = 0
    blocks: tuple[tuple[int, ...], ...] = ()
    ring: tuple[tuple[int, int], ...] = ()
    partial: tuple[tuple[int, int] | None, ...] = ()


@dataclass
class StepCopies:
    """Cache row copies queued with one step (GroupedBlockManager with several groups).

    restore  per group g, (src slots, dst slots): before the forward, what a prefix hit brings
             into the admitted requests' blocks (each source read before any write)
    retain   (batch row b, token block i, retained block id): after the forward, the ring rows of
             token block i of request b, read through the step's own table of b (ring or step
             scratch), copied to that block of the ring's prefix pool
    """

    restore: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    retain: list[tuple[int, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.restore or self.retain)


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
        # several groups (GroupedBlockManager): a token block's hash -> (block id, rows, its token
        # ids): the first `rows` rows of that block hold what the prefix up to that token block
        # stored in it (a growing group's partly filled block)
        self.partial: dict[int, tuple[int, int, tuple[int, ...]]] = {}
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
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            # image positions hold the same ids for every image: the block's images' content too
            images = tuple(s.image.digest for s in seq.images if s.start < (i + 1) * bs and s.end > i * bs)
            hashes.append(hash((parent, tokens, images) if images else (parent, tokens)))
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

    def match(self, seq: Sequence, max_tokens: int | None = None) -> PrefixHit:
        """match_prefix as a PrefixHit, of at most max_tokens tokens (None: no limit)."""
        blocks = self.match_prefix(seq)
        if max_tokens is not None:
            blocks = blocks[: max_tokens // self.block_size]
        return PrefixHit(len(blocks) * self.block_size, (tuple(blocks),))

    def admit(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit) -> bool:
        """allocate, after the blocks of `hit` (match)."""
        return self.allocate(seq, num_new_tokens, list(hit.blocks[0]) if hit.blocks else None)

    def step_copies(
        self, seqs: list[Sequence], num_new_tokens: list[int], num_draft_tokens: list[int] | None = None
    ) -> StepCopies:
        """One group pages every cache: a prefix hit shares blocks, nothing is copied."""
        return StepCopies()

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        prefix: list[int] | None = None,
        num_prefix_tokens: int | None = None,
    ) -> bool:
        """Make room for seq's next num_new_tokens tokens (after `prefix`, the blocks returned by
        match_prefix, when given; they stand for num_prefix_tokens tokens, default len(prefix) *
        BS). All or nothing: returns False, changing nothing, if the free blocks do not suffice."""
        prefix = prefix or []
        table = seq.block_tables[self.table]
        assert not prefix or not table, "prefix blocks are taken on admission only"
        need = self.blocks_needed(seq, num_new_tokens, len(prefix), num_prefix_tokens)
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
            table.append(self.take_free().block_id)
        if num_prefix_tokens is None:
            self.num_prefix_hits += len(prefix) * self.block_size
        return True

    def take_free(self) -> Block:
        """The least recently freed block, its cached content forgotten, now held once."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        for key in block.partial_keys:
            if self.partial.get(key, (-1,))[0] == block_id:
                del self.partial[key]
        block.hash, block.token_ids, block.ref_count, block.partial_keys = None, (), 1, []
        return block

    def blocks_needed(
        self,
        seq: Sequence,
        num_new_tokens: int,
        num_prefix_blocks: int = 0,
        num_prefix_tokens: int | None = None,
    ) -> int:
        """Blocks seq lacks for its next num_new_tokens tokens (after that many prefix blocks,
        standing for num_prefix_tokens tokens: default num_prefix_blocks * BS)."""
        bs = self.block_size
        cached = num_prefix_blocks * bs if num_prefix_tokens is None else num_prefix_tokens
        tokens = seq.num_computed_tokens + cached + num_new_tokens
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
        self.partial.clear()
        for block in self.blocks:
            block.hash, block.token_ids, block.partial_keys = None, (), []
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
    are taken at its first step and kept until it finishes or is preempted.

    Prefix caching with one group: the first group's full blocks are shared (BlockManager).
    With several (DeepSeek-V4: a ring for the per-token caches, growing groups of compressed
    entries at 1/m rows per token), a prefix of P tokens (P a multiple of BS) is restored exactly,
    from what a step that starts at position P reads:
      growing group (ratio m)  its entries w < P // m, each a function of tokens up to (w+1)m - 1
                    only: the full blocks among them are shared, each cached under the hash of the
                    token block that closes its last entry; the last, partly filled block (rows
                    [0, (P // m) % BS)) is copied into a block of the request's own, from the
                    block that held it when token block P / BS - 1 was cached (registered in
                    BlockManager.partial until that block is handed out again);
      ring          rows of positions [P - L, P) (L = ring_lookback): every full token block a
                    request computes (its tokens known to the host) has its ring rows copied, after
                    the step's forward, into a block of the ring's prefix pool (`ring_prefix`:
                    (first block id, count) in the ring group's caches, after its rings and step
                    scratch; least recently used first out), cached under the token block's hash;
                    a hit copies the ceil(L / BS) retained blocks before P into its ring.
    The longest P whose every piece is cached wins, at least one token left to compute. The
    copies are queued with the step (step_copies -> StepCopies, run by the worker)."""

    def __init__(
        self,
        groups: list[KVCacheGroup],
        num_blocks: list[int],
        block_size: int,
        enable_prefix_caching: bool = False,
        ring_prefix: tuple[int, int] = (0, 0),
    ) -> None:
        several = len(groups) > 1
        if enable_prefix_caching and several:
            assert groups[0].ring_blocks and all(not g.ring_blocks for g in groups[1:]), (
                "prefix caching of several groups: a ring first, then growing groups"
            )
            assert ring_prefix[1] > 0, "prefix caching of a ring needs its prefix pool"
        self.groups = groups
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.managers = [
            BlockManager(n, block_size, enable_prefix_caching and not several, group=g, table=i)
            for i, (g, n) in enumerate(zip(groups, num_blocks))
        ]
        # several groups with prefix caching: the ring's retained blocks (their own manager, ids
        # from 0; in the caches from ring_prefix[0]), and per request the token blocks registered
        self.retained: BlockManager | None = None
        self.retained_first = ring_prefix[0]
        if enable_prefix_caching and several:
            self.retained = BlockManager(ring_prefix[1], block_size, True)
        self.lookback_blocks = cdiv(groups[0].ring_lookback, block_size)
        self._registered: dict[int, int] = {}  # id(seq) -> its token blocks registered
        # id(seq) -> [token block, retained block, launched]: ring rows copied (or to be copied by the
        # step planned) into a retained block, registered once launched and its tokens known
        self._pending: dict[int, list[list[int]]] = {}
        self._restore: dict[int, tuple[list[int], list[int]]] = {}  # this step's, so far
        self._hits = 0

    @property
    def num_blocks(self) -> int:
        """Blocks of every group."""
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def num_prefix_hits(self) -> int:
        """Tokens served from the prefix cache."""
        return self._hits if self.retained is not None else self.managers[0].num_prefix_hits

    def match_prefix(self, seq: Sequence) -> list[int]:
        return self.managers[0].match_prefix(seq)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached blocks of every group; False, changing nothing, while one is in use."""
        managers = self.managers + ([self.retained] if self.retained is not None else [])
        if any(block.ref_count for m in managers for block in m.blocks):
            return False
        return all([m.reset_prefix_cache() for m in managers])

    # ------------------------------------------------------------------ admission

    def match(self, seq: Sequence, max_tokens: int | None = None) -> PrefixHit:
        """The longest cached prefix of seq, of at most max_tokens tokens (None: no limit)."""
        if self.retained is None:
            blocks = self.managers[0].match_prefix(seq)
            if max_tokens is not None:
                blocks = blocks[: max_tokens // self.block_size]
            return PrefixHit(
                len(blocks) * self.block_size, (tuple(blocks),) + ((),) * (len(self.managers) - 1)
            )
        if seq.block_table:
            return PrefixHit()
        bs, ring = self.block_size, self.retained
        last = (seq.num_tokens - 1) // bs  # token blocks that may be cached: one token left
        if max_tokens is not None:
            last = min(last, max_tokens // bs)
        hashes = ring._block_hashes(seq, last)

        def tokens(t: int) -> tuple[int, ...]:
            return tuple(seq.token_ids[t * bs : (t + 1) * bs])

        def found(m: BlockManager, t: int) -> int | None:  # the block cached under token block t
            block_id = m.cached.get(hashes[t])
            return block_id if block_id is not None and m.blocks[block_id].token_ids == tokens(t) else None

        # per growing group, the leading full entry blocks cached (block j under token block (j+1)m - 1)
        runs: list[list[int]] = []
        for m, g in zip(self.managers[1:], self.groups[1:]):
            run: list[int] = []
            while (t := (len(run) + 1) * g.ratio - 1) < last and (b := found(m, t)) is not None:
                run.append(b)
            runs.append(run)
        for n in range(last, 0, -1):  # P = n * BS, longest first
            p = n * bs
            ring_blocks = [(t, found(ring, t)) for t in range(max(0, n - self.lookback_blocks), n)]
            if any(b is None for _, b in ring_blocks):
                continue
            shared: list[tuple[int, ...]] = [()]
            partial: list[tuple[int, int] | None] = [None]
            for m, g, run in zip(self.managers[1:], self.groups[1:], runs):
                entries = p // g.ratio
                full, rows = divmod(entries, bs)
                if full > len(run):
                    break
                piece = None
                if rows:
                    cached = m.partial.get(hashes[n - 1])
                    if cached is None or cached[1] != rows or cached[2] != tokens(n - 1):
                        break
                    piece = (cached[0], rows)
                shared.append(tuple(run[:full]))
                partial.append(piece)
            else:
                return PrefixHit(
                    p, tuple(shared), tuple((t, b) for t, b in ring_blocks if b is not None), tuple(partial)
                )
        return PrefixHit()

    def admit(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit) -> bool:
        """Room for seq's next num_new_tokens tokens after its cached prefix `hit` (match) in every
        group, and the copies that bring the prefix into its own blocks (queued for the step:
        step_copies); False, changing nothing, if one group lacks free blocks."""
        if self.retained is None:
            return self.allocate(seq, num_new_tokens, list(hit.blocks[0]) if hit.blocks else None)
        if not hit.num_tokens:
            return self.allocate(seq, num_new_tokens)
        while len(seq.block_tables) < len(self.managers):
            seq.block_tables.append([])
        p = hit.num_tokens
        for m, blocks in zip(self.managers, hit.blocks):
            revived = sum(1 for b in blocks if m.blocks[b].ref_count == 0)
            if max(m.blocks_needed(seq, num_new_tokens, len(blocks), p), 0) + revived > m.num_free_blocks:
                return False
        for m, blocks in zip(self.managers, hit.blocks):
            taken = m.allocate(seq, num_new_tokens, list(blocks), p)
            assert taken
        bs, ring = self.block_size, seq.block_tables[0]
        src, dst = self._restore.setdefault(0, ([], []))
        for t, b in hit.ring:  # token block t's rows -> the ring's block of t
            self.retained.free.move_to_end(b)  # just used: the last to go
            src.extend(range((self.retained_first + b) * bs, (self.retained_first + b + 1) * bs))
            dst.extend(range(ring[t % len(ring)] * bs, (ring[t % len(ring)] + 1) * bs))
        for g, (blocks, piece) in enumerate(zip(hit.blocks, hit.partial)):
            if piece is not None:
                block, rows = piece
                if block in self.managers[g].free:  # just used: the last of the free ones to go
                    self.managers[g].free.move_to_end(block)
                own = seq.block_tables[g][len(blocks)]
                src, dst = self._restore.setdefault(g, ([], []))
                src.extend(range(block * bs, block * bs + rows))
                dst.extend(range(own * bs, own * bs + rows))
        self._registered[id(seq)] = p // bs  # what it holds is cached already
        self._hits += p
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[int] | None = None) -> bool:
        """Room for seq's next num_new_tokens tokens (after the first group's `prefix` blocks,
        one group only) in every group; False, changing nothing, if one group lacks free blocks."""
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

    # ------------------------------------------------------------------ the step

    def step_copies(
        self, seqs: list[Sequence], num_new_tokens: list[int], num_draft_tokens: list[int] | None = None
    ) -> StepCopies:
        """The copies of the step the scheduler just planned (seqs[b] computes its next
        num_new_tokens[b] tokens, the last num_draft_tokens[b] of them drafts): the prefix hits'
        restores, and a retained block for every token block that completes in the step (drafts
        aside) and is not retained yet (the latest ones while the prefix pool has free blocks). A
        block whose last token is pending (sampled by the step before, async scheduling) is
        copied now and cached once the host knows that token."""
        copies = StepCopies(self._restore)
        self._restore = {}
        ring = self.retained
        if ring is None:
            return copies
        bs, planned = self.block_size, set()
        drafts = num_draft_tokens or [0] * len(seqs)
        for b, (seq, n, nd) in enumerate(zip(seqs, num_new_tokens, drafts)):
            start, known = seq.num_computed_tokens, len(seq.token_ids)
            end = (start + n - nd) // bs
            hashes = ring._block_hashes(seq, min(end, known // bs))
            for t in reversed(range(start // bs, end)):  # the pool short: the latest blocks kept
                if t < len(hashes):  # its tokens known: retained once per content
                    h, tokens = hashes[t], tuple(seq.token_ids[t * bs : (t + 1) * bs])
                    cached = ring.cached.get(h)
                    if h in planned or (cached is not None and ring.blocks[cached].token_ids == tokens):
                        if cached is not None:
                            ring.free.move_to_end(cached)
                        continue
                    planned.add(h)
                if not ring.free:
                    break
                block = ring.take_free()  # held until registered (cache_full_blocks)
                self._pending.setdefault(id(seq), []).append([t, block.block_id, 0])
                copies.retain.append((b, t, self.retained_first + block.block_id))
        return copies

    def _register_retained(self, seq: Sequence, release: bool) -> None:
        """seq's retained blocks of launched steps whose tokens the host knows: cached; the rest
        kept pending, or with `release` (seq leaves) back to the free ones uncached."""
        ring, bs = self.retained, self.block_size
        assert ring is not None
        keep = []
        for item in sorted(self._pending.pop(id(seq), [])):  # in order: the last one used last
            t, block_id, launched = item
            block = ring.blocks[block_id]
            if launched and (t + 1) * bs <= len(seq.token_ids):
                h = ring._block_hashes(seq, t + 1)[t]
                if h not in ring.cached:
                    block.hash, block.token_ids = h, tuple(seq.token_ids[t * bs : (t + 1) * bs])
                    ring.cached[h] = block_id
            elif not release:
                keep.append(item)
                continue
            block.ref_count = 0
            ring.free[block_id] = None
        if keep:
            self._pending[id(seq)] = keep

    def positions_covered(self, seq: Sequence) -> int | None:
        """The positions whose rows seq's blocks hold in every growing group (None: rings only)."""
        covered = [c for m in self.managers if (c := m.positions_covered(seq)) is not None]
        return min(covered, default=None)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's computed full blocks (its launched step's retained ring blocks too)."""
        if self.retained is None:
            self.managers[0].cache_full_blocks(seq)
            return
        bs, ring = self.block_size, self.retained
        for item in self._pending.get(id(seq), []):
            item[2] = 1  # its step was launched: the copy is queued
        self._register_retained(seq, release=False)
        done = self._registered.get(id(seq), 0)
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        if num_full <= done:
            return
        hashes = ring._block_hashes(seq, num_full)
        for t in range(done, num_full):
            key, tokens = hashes[t], tuple(seq.token_ids[t * bs : (t + 1) * bs])
            for m, g in zip(self.managers[1:], self.groups[1:]):
                table = seq.block_tables[m.table]
                entries = (t + 1) * bs // g.ratio
                full, rows = divmod(entries, bs)
                if rows:  # block `full` holds `rows` rows of this prefix
                    block = m.blocks[table[full]]
                    m.partial[key] = (block.block_id, rows, tokens)
                    block.partial_keys.append(key)
                elif (t + 1) % g.ratio == 0 and full:  # entry block full - 1 closes here
                    block = m.blocks[table[full - 1]]
                    if block.hash is None and key not in m.cached:
                        block.hash, block.token_ids = key, tokens
                        m.cached[key] = block.block_id
        self._registered[id(seq)] = num_full

    def free_sequence(self, seq: Sequence) -> None:
        for m in self.managers:
            m.free_sequence(seq)
        self._registered.pop(id(seq), None)
        if self.retained is not None:  # what was copied and is known is cached; the rest let go
            self._register_retained(seq, release=True)


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
