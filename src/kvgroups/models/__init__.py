"""Models as far as their caches go: per-layer specs, config readers, bundled presets, the meta-device
engine build and capacity."""
