"""Valkey/Redis: a server (``store``) and a Cluster (``cluster``), their URL's settings (``settings``),
the protocol's data path by hand (``resp``) and how a large value is laid out in parts (``value_parts``).
Imports the byte stores' ``base`` and ``health`` and nothing else of the store; redis-py is imported
when a store is opened."""
