"""What a stored value is: the entry format (``codec``: one group's chunk as a checksummed safetensors
blob, with an optional keyed MAC or encryption), the chain of prefix keys (``keys``), a model's identity
(``identity``) and the deployment secret (``secret``).

Imports ``kvgroups.store.metrics`` (an entry that does not check out counts as corrupt), the core and
``kvgroups.errors``: no byte store and no chunk store, so an integration can write and check kvgroups
entries in pages of its own.
"""
