"""Tests of kvgroups.core: layouts, layer groups and their lookups, metadata, fingerprints, LMCache's API."""
