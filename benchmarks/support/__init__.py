"""What the benchmarks share: their models (``models``), local Valkey/Redis servers (``servers``), and the row a
benchmark prints for what it could not measure (``unmeasured``)."""
