"""Benchmarks of PrefixCache on transformers models: time to first token with reuse (``reuse``) and the cost of
the restore check on a transformers release never verified (``restore_check``)."""
