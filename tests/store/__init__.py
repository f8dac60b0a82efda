"""Tests of kvgroups.store: every byte store's contract and faults, entries, keys, secrets, the chunk store,
saves and metrics, on real files, servers and clusters."""
