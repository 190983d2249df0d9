"""Triton kernels for the GPU path, testable on CPU under ``TRITON_INTERPRET=1``
(the interpreter runs a kernel's programs one by one on CPU torch tensors).

Same contract as ``encdec/kernels/cpu``: ``available(device)``, ``path(device)``
("cuda", "interpreter" or "torch" where it declines) and one main call that
returns None, having done nothing, to decline; the caller runs its torch path.

- ``paged_attention``: attention of packed query groups over the paged KV
  cache, read in place by block table; the torch_native backend's decode (and
  its cross-attention prefill when a prefill reads a cached cross table)
"""
