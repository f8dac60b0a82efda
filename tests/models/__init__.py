"""Tests of kvgroups.models: config readers, family defaults, sizes and capacity, the model-type sweep."""
