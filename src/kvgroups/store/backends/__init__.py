"""The byte stores: opaque values under string keys. ``base`` (the ``ByteStore`` contract and its
errors), ``memory``, ``files/`` (one private file per entry), ``redis/`` (a Valkey/Redis server or
Cluster), ``tiered`` (a list of stores as one), ``health`` (back-off after a failure) and ``urls``
(``open_store``: a store from its URL).

Imports ``kvgroups.store.metrics`` (each tier counts what it does), the core and ``kvgroups.errors``;
never the entry format or the chunk store: a byte store does not know what its values are.
"""
