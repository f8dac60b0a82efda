"""Benchmarks of the data path: pack and unpack against ``copy_`` (``transfer``), and the check of the kernels and
the connector's copies on a CUDA GPU (``gpu_check``)."""
