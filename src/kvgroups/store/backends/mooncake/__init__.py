"""Mooncake Store: the URL's settings, the client (set up in the background, calls within a timeout), the store."""
