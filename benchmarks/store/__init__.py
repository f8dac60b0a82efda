"""Benchmarks of the store: every tier against its raw medium (``tiers``), MACs and AEADs for sealed entries
(``macs``), and a Valkey/Redis Cluster's failovers (``failover``)."""
