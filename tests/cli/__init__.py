"""Tests of the kvgroups command: inspect, presets, plot, store and generate."""
