"""Bookkeeping of a step, without torch: scheduling, preemption, stop checks, the typed step outputs."""
