"""What any store URL says: its options, checked against those its store takes, and the URL itself as it
may be shown (without its password)."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from kvgroups.errors import KVGroupsError


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log and show)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


def url_options(url: str, query: str, allowed: Sequence[str]) -> dict[str, str]:
    """The options after a store URL's ``?``, by name; one the store does not take raises, naming it and
    those it takes (the URL shown without its password)."""
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in allowed:
            raise KVGroupsError(f"store URL {mask_url(url)!r}: unknown option {name!r}; expected "
                                f"{', '.join(allowed) or 'none'}")
        options[name] = value
    return options
