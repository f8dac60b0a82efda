"""The core: what a model's KV caches are, grouped and described, with nothing engine-specific.

Layouts (``layouts``), one spec per kind of layer cache (``cache_specs``), what one layer's cache
value is and the key layers are grouped by (``group_keys``), the grouping planner (``grouping``),
``KVLayerGroupInfo`` (``groups``) and ``KVLayerGroupsManager`` (``manager``), ``LMCacheMetadata``
(``metadata``), and small shared facts (``dtypes``, ``sizes``, ``formatting``, ``checks``). It
imports only :mod:`kvgroups.errors` and torch; every other subpackage builds on it.
"""
