"""Kernels by where they run, not by what calls them: ``cpu/`` (C, one ``.c``
and one ``.py`` wrapper each, built per ISA). A CUDA or Triton kernel gets the
sibling ``cuda/`` or ``triton/`` package, with the same wrapper contract."""
