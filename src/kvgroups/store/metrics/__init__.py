"""What the stores report: counters and histograms kept as the work happens (``counters``), and the
Prometheus collector that reads them at scrape time (``prometheus``).

The lowest room of ``kvgroups.store``: it imports nothing of the store, so every other room may count.
"""
