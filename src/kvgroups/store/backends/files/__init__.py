"""``file:///dir``: the file store (``store``), what it needs of the operating system (``io``) and its
fan-out directories (``shards``). Imports the byte stores' ``base`` and nothing else of the store."""
