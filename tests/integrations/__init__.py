"""Tests of the engine integrations, one folder each."""
