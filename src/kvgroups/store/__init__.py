"""Stored KV chunks: prefix keys, byte stores (memory, disk, Valkey/Redis) and the chunk store."""
