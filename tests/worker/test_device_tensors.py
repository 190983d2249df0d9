"""Host values to device tensors: plain on CPU, queued (no stream sync) on CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from encdec.device_tensors import array_to_device, to_device


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
