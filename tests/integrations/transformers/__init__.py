"""Tests of kvgroups.integrations.transformers: PrefixCache's reuse, refusals, reserved layers, restore check."""
