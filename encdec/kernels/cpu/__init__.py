"""The C kernels: one ``<name>_cpu.c`` and one ``<name>_cpu.py`` wrapper each,
compiled by ``build`` (once per machine and ISA, never ``-march=native``: at
set-up by ``encdec build-kernels``, else all at once at the first use) and
called through ctypes.

Every wrapper has the same contract:

- ``available(isa=None) -> bool``: whether the kernel runs anything for
  ``isa`` (default ``build.cpu_isa()``).
- ``path(isa=None) -> str``: what the build for ``isa`` runs, as the build
  itself says: "avx512", "avx2", "none" (portable C), or "torch" where the
  kernel declines every call there (no compiler, ``ENCDEC_DISABLE_C_KERNELS=1``,
  or no portable path). ``available(isa)`` is ``path(isa) != "torch"``.
- one main call (``dense_attention``, ``paged_decode_attention``,
  ``small_linear``, ``small_linear_int8``, ``quantize_rows``, ``greedy_logprobs``,
  ``whisper_rules``, ``decode_step``)
  that returns None, having done nothing, to decline: the caller then runs
  its torch path.

An ``isa`` the CPU does not run is a ValueError. The ISA is chosen at run
time: the best this CPU runs, or a lower one ``ENCDEC_CPU_ISA=avx512|avx2|none``
asks for (``build.cpu_isa``). Tests live in ``tests/kernels/``, one per
kernel, against a float64 or torch reference, with the path in the test id.

The kernels, and who calls them:

- ``dense_attention_cpu``: non-causal attention (Whisper's encoder); the attention backend
- ``paged_attention_cpu``: decode attention from the paged cache; the attention backend
- ``small_linear_cpu``: x W^T + b for a decode step's few rows; ``models.layers.Linear``
- ``greedy_cpu``: the greedy token, its log-prob and rank; ``sample.sampler``
- ``whisper_rules_cpu``: Whisper's logits rules; ``models.whisper_processors``
- ``decoder_step_cpu``: every pre-norm decoder layer of a decode step (float32 or int8
  matmuls); ``models.layers.FusedDecodeStep``
- ``int8_rows_cpu``: per-row quantization before, and dequantization after, an int8
  matmul; ``models.layers.Linear`` (``quantization="int8"``)
- ``small_linear_int8_cpu``: the decode step's int8 matmul (VNNI); ``decoder_step_cpu``
"""
