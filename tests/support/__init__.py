"""What the tests of every folder share (and the benchmarks borrow): repository paths, config fixtures,
tiny models, stored chunks, real Valkey/Redis servers and clusters, the model-type sweep, the versions tool."""
