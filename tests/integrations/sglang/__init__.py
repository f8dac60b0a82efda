"""Tests of kvgroups.integrations.sglang through SGLang's own storage code (its backend factory, host pools and
fault injection); they run in the environment `make test-sglang` builds (.venv-sglang)."""
