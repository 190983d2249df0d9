"""BlockAllocator against a brute-force model: free counts, reference counts,
first-fit contiguous runs, the ``last + 1`` preference, and otherwise the
lowest free block (a lazily mapped CPU cache stays on the blocks it wrote)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from encdec.block_manager.allocator import BlockAllocator, Device

N = 24


def lowest_run(refs: list[int], n: int, end: int = N) -> list[int] | None:
    for start in range(end - n + 1):
        if all(r == 0 for r in refs[start : start + n]):
            return list(range(start, start + n))
    return None


def check(alloc: BlockAllocator, refs: list[int]) -> None:
    assert [alloc.get_ref_count(b) for b in range(N)] == refs
    assert alloc.get_num_free_blocks() == refs.count(0)
    # The two free views agree with the reference counts.
    assert alloc._free == {b for b in range(N) if refs[b] == 0}
    assert list(alloc._free_map) == [int(r == 0) for r in refs]


ops = st.lists(
    st.tuples(st.sampled_from(["one", "run", "ref", "free"]), st.integers(0, N), st.integers(0, 10**6)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.one_of(st.none(), st.integers(0, N)))
def test_allocator_matches_model(ops, warm):
    """``warm``: blocks written at start (None: all). Runs come from below the
    mark (the highest block ever handed out, or ``warm``) while possible."""
    alloc = BlockAllocator(Device.GPU, N, warm)
    refs = [0] * N
    mark = N if warm is None else warm
    for op, arg, pick in ops:
        used = [b for b in range(N) if refs[b]]
        if op == "one" and refs.count(0):
            prefer = arg if arg < N else None
            block = alloc.allocate(prefer=prefer)
            assert refs[block] == 0
            if prefer is not None and refs[prefer] == 0:
                assert block == prefer
            else:
                assert block == refs.index(0)
            refs[block] = 1
            mark = max(mark, block + 1)
        elif op == "run" and arg <= refs.count(0):
            lowest_free = [b for b in range(N) if refs[b] == 0][:arg]
            warm_free = refs[:mark].count(0)
            expected = lowest_run(refs, arg, mark)
            if expected is None and warm_free >= arg:
                expected = lowest_free
            if expected is None:
                expected = lowest_run(refs, arg) or lowest_free
            assert alloc.get_num_free_warm_blocks() == warm_free
            blocks = alloc.allocate_contiguous(arg)
            assert blocks == expected and all(refs[b] == 0 for b in blocks)
            for b in blocks:
                refs[b] = 1
            if blocks:
                mark = max(mark, blocks[-1] + 1)
        elif op == "ref" and used:
            block = used[pick % len(used)]
            alloc.incr_ref(block)
            refs[block] += 1
        elif op == "free" and used:
            block = used[pick % len(used)]
            alloc.free(block)
            refs[block] -= 1
        check(alloc, refs)
    alloc.reset()
    check(alloc, [0] * N)


def test_contiguous_falls_back_to_any_free_blocks():
    alloc = BlockAllocator(Device.CPU, 8)
    alloc.allocate_contiguous(8)
    for b in (1, 3, 6):
        alloc.free(b)
    assert alloc.allocate_contiguous(2) == [1, 3]
    assert alloc.get_num_free_blocks() == 1
