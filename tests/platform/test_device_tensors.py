"""Host values to device tensors: plain on CPU, queued (no stream sync) on CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from encdec.platform.device_tensors import array_to_device, padded_to_device, split_to_device, to_device


def test_cpu_path_is_torch_tensor():
    t = to_device([3, 1, 2], torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [3, 1, 2] and not t.is_pinned()
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert torch.equal(array_to_device(a, torch.device("cpu")), torch.from_numpy(a))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_queue_behind_running_kernels():
    """A blocking copy would wait for the sleeping kernel; these return while it
    runs (the stream is still busy) and the values arrive in order."""
    dev = torch.device("cuda")
    values, array = list(range(1000)), np.full((4, 5), 7, dtype=np.int32)
    to_device(values, torch.long, dev), array_to_device(array, dev)  # pinned blocks allocated (and cached) first
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
    t = to_device(values, torch.long, dev)
    a = array_to_device(array, dev)
    busy = not torch.cuda.current_stream().query()
    assert busy, "to_device waited for the GPU"
    assert t.sum().item() == sum(range(1000)) and a.sum().item() == 140


@pytest.mark.parametrize("dtype", [torch.int32, torch.long])
def test_a_steps_lists_share_one_tensor_each_view_on_16_bytes(dtype):
    """``split_to_device`` (the model runner's): a step's index lists as views of one tensor
    (one tensor made, one copy to a GPU), values exact, each view contiguous and
    16-byte aligned as a tensor of its own is (Triton specializes on that)."""
    lists = [[1, 2, 3], [4], [], [5, 6, 7, 8, 9], [2**31 - 1]]
    parts = split_to_device(lists, dtype, torch.device("cpu"))
    assert [p.tolist() for p in parts] == lists
    assert all(p.dtype == dtype and p.is_contiguous() and p.data_ptr() % 16 == 0 for p in parts)
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1  # one allocation


def test_block_tables_padded_with_zeros():
    t = padded_to_device([[3, 1], [7], []], torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [[3, 1], [7, 0], [0, 0]]
    assert padded_to_device([], torch.device("cpu")).shape == (0, 1)
