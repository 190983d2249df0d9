"""Attention backends behind one interface: torch SDPA (the reference), torch-native and xFormers."""
