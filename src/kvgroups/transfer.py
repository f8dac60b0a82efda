"""The data path's public name: ``from kvgroups.transfer import KVTransfer, pack, unpack``.

The code lives in :mod:`kvgroups.datapath`; this module only names it.
"""

from kvgroups.datapath.transfer import KVTransfer, pack, unpack

__all__ = ["KVTransfer", "pack", "unpack"]
