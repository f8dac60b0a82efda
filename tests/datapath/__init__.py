"""Tests of kvgroups.datapath: pack / unpack on every layout, the numba, Triton and torch copy paths, streams."""
