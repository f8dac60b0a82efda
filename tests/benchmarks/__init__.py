"""Tests of the benchmarks' own parts (benchmarks/): the row of what could not be measured, the soak's report."""
