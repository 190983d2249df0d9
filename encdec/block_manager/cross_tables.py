"""Cross-attention tables, shared by every request whose encoder input is the same.

A request reads exactly one table; a table is read by its users::

    users        "a" ---+
                 "b" ---+--> CrossTable(key="9f3c..", blocks=[20..23], GPU)  written once
    key index    "9f3c.." -> that table (the newest with this content)

``key`` is the engine's content hash of the encoder input (with the model's
identity); ``None`` keeps a table private to its request (cache off). Where
a table lives follows its users:

    on the device  while any user is running there;
    swapped out    once, with the last user to leave the device by swap; when
                   the last running user ends instead (finish, abort, recompute)
                   and the others are swapped, it is queued and goes to CPU at
                   the next ``schedule()`` (``swap_out_idle``), CPU room allowing;
    swapped in     once, with the first user to come back;
    cached-free    when the last user ends, a keyed device table that is still
                   indexed stays whole, blocks allocated and referenced by no
                   request (LRU order); a request with its key revives it and
                   skips the encoder; ``make_room`` evicts the least recently
                   used ones when an allocation needs their blocks (or
                   would otherwise write never-used memory: ``make_room``).

Cached-free blocks count as free (``num_evictable``): they can be taken at
once, so admission and the free-block arithmetic see the same numbers with
the cache on as off. A CPU table is never kept once unused.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from encdec.block_manager.allocator import BlockAllocator, Device


@dataclass(eq=False)
class CrossTable:
    key: str | None  # content key of the encoder input; None = private to one request
    blocks: list[int]  # block numbers on ``device``; one ascending run when one was free
    device: Device
    users: set[str] = field(default_factory=set)  # request ids reading it
    swapped: set[str] = field(default_factory=set)  # users swapped to CPU (subset of users)
    written: bool = False  # a prefill has been scheduled to write its KV (the encoder ran)

    def on_device_users(self) -> int:
        return len(self.users) - len(self.swapped)


class CrossTables:
    """Which table each request reads, the key index and the cached-free LRU.
    Block numbers come from the two allocators the manager owns."""

    def __init__(self, gpu: BlockAllocator, cpu: BlockAllocator) -> None:
        self.gpu, self.cpu = gpu, cpu
        self.reset()

    def reset(self) -> None:
        self._of: dict[str, CrossTable] = {}  # request id -> its table
        self._by_key: dict[str, CrossTable] = {}
        self._lru: OrderedDict[str, CrossTable] = OrderedDict()  # cached-free, oldest first
        self._idle: list[CrossTable] = []  # device tables whose users all left by swap
        self.num_evictable = 0  # blocks of cached-free tables
        self.num_evictions = 0  # cached-free tables evicted since reset (tests, stats)

    # -- queries ---------------------------------------------------------------
    def table_of(self, request_id: str) -> CrossTable | None:
        return self._of.get(request_id)

    def tables(self) -> dict[str, list[int]]:
        """request id -> its table's blocks (a fresh dict; the lists are live)."""
        return {r: t.blocks for r, t in self._of.items()}

    def cached_free(self) -> list[CrossTable]:
        return list(self._lru.values())

    def _reusable(self, key: str | None) -> CrossTable | None:
        table = self._by_key.get(key) if key is not None else None
        return table if table is not None and table.device is Device.GPU else None

    def has_device_table(self, key: str | None) -> bool:
        """Whether a request with ``key`` would read a device table already there
        (live, cached-free, or acquired this step): its encoder need not run."""
        return self._reusable(key) is not None

    def device_blocks_needed(self, key: str | None, num_blocks: int) -> int:
        """Device blocks that acquiring ``key`` takes out of the free count: none
        for a live table, its own blocks for a cached-free one, else new ones."""
        table = self._reusable(key)
        if table is None:
            return num_blocks
        return len(table.blocks) if not table.users else 0

    # -- users -----------------------------------------------------------------
    def acquire(self, request_id: str, key: str | None, num_blocks: int) -> CrossTable:
        """Give the request the device table of ``key`` (live or cached-free) or
        a new one. Callers check room first (``device_blocks_needed``)."""
        assert request_id not in self._of, f"request {request_id} already has a cross table"
        table = self._reusable(key)
        if table is None:
            self.make_room(num_blocks)
            table = CrossTable(key, self.gpu.allocate_contiguous(num_blocks), Device.GPU)
            if key is not None:
                self._by_key[key] = table  # a CPU table of the same key is no longer found
        elif not table.users:  # revive a cached-free table
            del self._lru[key]
            self.num_evictable -= len(table.blocks)
        table.users.add(request_id)
        self._of[request_id] = table
        return table

    def claim_write(self, request_id: str) -> bool:
        """True exactly once per table: for the first prefill scheduled to write
        it (that prefill runs the encoder); others read what it writes."""
        table = self._of[request_id]
        first, table.written = not table.written, True
        return first

    def release(self, request_id: str) -> None:
        """The request stops reading its table (finished, aborted, recomputed)."""
        table = self._of.pop(request_id, None)
        if table is None:
            return
        table.users.discard(request_id)
        table.swapped.discard(request_id)
        if table.users:
            if table.device is Device.GPU and not table.on_device_users():
                self._idle.append(table)  # only swapped users left: follow them to CPU
            return
        if table.device is Device.GPU and table.written and self._by_key.get(table.key) is table:
            self._lru[table.key] = table  # cached-free, most recently used last
            self.num_evictable += len(table.blocks)
            return
        if self._by_key.get(table.key) is table:
            del self._by_key[table.key]
        self._free(table)

    def make_room(self, num_blocks: int) -> None:
        """Evict cached-free tables, least recently used first, until the device
        allocator has ``num_blocks`` free below its mark (blocks already
        written: ``BlockAllocator``). A lazily mapped CPU cache would otherwise
        keep every finished table and walk all its memory, paying a page fault
        per page of each new one; cached tables are kept as long as the memory
        already written holds them."""
        while self.gpu.get_num_free_warm_blocks() < num_blocks and self._lru:
            key, table = self._lru.popitem(last=False)
            del self._by_key[key]
            self.num_evictable -= len(table.blocks)
            self.num_evictions += 1
            self._free(table)

    def _free(self, table: CrossTable) -> None:
        allocator = self.gpu if table.device is Device.GPU else self.cpu
        for block in table.blocks:
            allocator.free(block)
        table.blocks = []

    # -- swapping ----------------------------------------------------------------
    def moves_with(self, request_id: str, dst: Device) -> list[int]:
        """Blocks of the request's table that move if the request goes to ``dst``:
        all of them when it is the last user to leave the device (to CPU) or
        the first to come back (to GPU), else none."""
        table = self._of.get(request_id)
        if table is None or table.device is dst:
            return []
        if dst is Device.CPU and table.on_device_users() > 1:
            return []
        return table.blocks

    def swap_user(self, request_id: str, dst: Device) -> list[tuple[int, int]]:
        """Move the request to ``dst``; its table moves with it when
        ``moves_with`` says so. Returns ``[(src, dst)]`` block pairs."""
        table = self._of.get(request_id)
        if table is None:
            return []
        moving = self.moves_with(request_id, dst)
        if dst is Device.CPU:
            table.swapped.add(request_id)
        else:
            table.swapped.discard(request_id)
        return self._move(table, dst) if moving else []

    def swap_out_idle(self) -> list[tuple[int, int]]:
        """Device -> CPU pairs for tables queued by ``release`` whose users are
        all still swapped, as far as CPU room allows; the rest stay on the
        device (still valid) and are retried next time."""
        pairs: list[tuple[int, int]] = []
        waiting: list[CrossTable] = []
        for table in dict.fromkeys(self._idle):
            if table.device is not Device.GPU or not table.users or table.on_device_users():
                continue
            if len(table.blocks) <= self.cpu.get_num_free_blocks():
                pairs += self._move(table, Device.CPU)
            else:
                waiting.append(table)
        self._idle = waiting
        return pairs

    def _move(self, table: CrossTable, dst: Device) -> list[tuple[int, int]]:
        src_alloc, dst_alloc = (self.cpu, self.gpu) if dst is Device.GPU else (self.gpu, self.cpu)
        if dst is Device.GPU:
            self.make_room(len(table.blocks))
        new = dst_alloc.allocate_contiguous(len(table.blocks))
        for block in table.blocks:
            src_alloc.free(block)
        pairs = list(zip(table.blocks, new))
        table.blocks[:] = new  # in place: users' views of the table stay current
        table.device = dst
        return pairs
