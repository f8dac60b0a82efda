"""``KVChunkStore``, the top room of ``kvgroups.store``: a model's chunks saved per (chunk, group) in a
byte store (``chunk_store``), what each group needs of a prefix (``prefixes``), how prefixes are found
and read (``prefix_reads``) or streamed entry by entry (``entry_reads``), and the background writer
(``writer``).

May import every other room of the store (metrics, entries, backends), the core and ``kvgroups.errors``.
"""
