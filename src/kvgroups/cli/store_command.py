"""``kvgroups store stats|verify|clear URL``: what a chunk store holds, whether every entry is whole.

``verify`` exits 1 when it found bad entries (they are listed, and removed with ``--delete``);
``clear`` deletes nothing from a server (shared with other deployments) without ``--yes``, and
can be limited to one metadata fingerprint. None
of them creates a store that does not exist. Bad input, such as an unknown URL or a store that
cannot be reached, exits 2 as everywhere else; a password in a URL is never printed. The store
package is imported only when one of these commands runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

EXIT_BAD_ENTRIES = 1
_HEADER_PROBE_BYTES = 4096
_NOT_AN_ENTRY = "(not an entry)"


def add_store_commands(commands: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    store = commands.add_parser("store", help="statistics, verification and clearing of a chunk store",
                                description="Look into a chunk store given by its URL (memory://, file:///dir, "
                                            "redis://host:port/db, rediss://, unix:///path.sock).")
    actions = store.add_subparsers(dest="store_command", required=True, parser_class=parser_class)
    stats = actions.add_parser("stats", help="entries, bytes and when the oldest and newest were written, in all "
                                             "and by metadata fingerprint")
    stats.add_argument("url", help="store URL")
    stats.add_argument("--json", action="store_true", help="print JSON")
    verify = actions.add_parser("verify", help="read every entry and check its header and checksum (or MAC)")
    verify.add_argument("url", help="store URL")
    verify.add_argument("--delete", action="store_true", help="delete the bad entries found")
    verify.add_argument("--json", action="store_true", help="print JSON")
    clear = actions.add_parser("clear", help="delete kvgroups' entries of the store (all, or one fingerprint's)")
    clear.add_argument("url", help="store URL")
    clear.add_argument("--fingerprint", help="delete only the entries of this metadata fingerprint")
    clear.add_argument("--yes", action="store_true", help="really delete from a server shared with others (without "
                                                           "it, only say what would go)")
    for action in (stats, verify, clear):
        action.add_argument("--secret-file", help="the deployment's secret (else $KVGROUPS_STORE_SECRET): "
                                                  "verify checks entries' MACs with it")
        action.set_defaults(run=run_store_command)


def _header_fields(store: Any, key: str) -> tuple[str, int | None]:
    """An entry's metadata fingerprint and the Unix second it was written (None when it does not say),
    read from its header alone."""
    from kvgroups.store.entries.codec import MAX_HEADER_BYTES, CorruptEntryError, read_header  # noqa: PLC0415

    prefix = store.get_prefix(key, _HEADER_PROBE_BYTES)
    try:
        if prefix is not None and len(prefix) >= 8:
            needed = 8 + int.from_bytes(prefix[:8], "little")
            if len(prefix) < needed <= 8 + MAX_HEADER_BYTES:
                prefix = store.get_prefix(key, needed)
        metadata = read_header(prefix or b"")["__metadata__"]
    except CorruptEntryError:
        return _NOT_AN_ENTRY, None
    written = metadata.get("written", "")
    return str(metadata.get("fingerprint", _NOT_AN_ENTRY)), int(written) if written.isdigit() else None


def _utc(second: int | None) -> str | None:
    return None if second is None else datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stats(store: Any) -> dict[str, Any]:
    entries: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    written: dict[str, list[int]] = {}
    for key in store.iter_keys():
        size = store.size_of(key)
        if size is None:
            continue  # evicted meanwhile
        fingerprint, second = _header_fields(store, key)
        entries[fingerprint] += 1
        sizes[fingerprint] += size
        if second is not None:
            times = written.setdefault(fingerprint, [second, second])
            times[0], times[1] = min(times[0], second), max(times[1], second)
    every = [second for times in written.values() for second in times]
    return {
        "url": store.url, "entries": sum(entries.values()), "bytes": sum(sizes.values()),
        "oldest": _utc(min(every, default=None)), "newest": _utc(max(every, default=None)),
        "by_fingerprint": [{"fingerprint": name, "entries": entries[name], "bytes": sizes[name],
                            "oldest": _utc(written.get(name, [None])[0]), "newest": _utc(written.get(name, [None])[-1])}
                           for name in sorted(entries)],
    }


def _progress() -> Progress:
    return Progress(TextColumn("[bold]verify"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True)


def _verify(store: Any, delete: bool, secret: Any) -> dict[str, Any]:
    from kvgroups.store.entries.codec import CorruptEntryError, decode_entry, read_header  # noqa: PLC0415

    keys = list(store.iter_keys())
    bad = []
    checked = 0
    with _progress() as progress:
        task = progress.add_task("verify", total=len(keys))
        for key in keys:
            value = store.get(key)
            progress.advance(task)
            if value is None:
                continue  # evicted meanwhile
            checked += 1
            try:
                decode_entry(value, secret=secret)
                named = read_header(value)["__metadata__"].get("key")
                if named != key:
                    raise CorruptEntryError(f"entry says it is {named!r}")
            except CorruptEntryError as error:
                bad.append({"key": key, "problem": str(error)})
                if delete:
                    store.delete(key)
    return {"url": store.url, "checked": checked, "bad": bad, "deleted": len(bad) if delete else 0}


def _clear(store: Any, fingerprint: str | None, really: bool) -> tuple[int, str]:
    """Delete every entry (of ``fingerprint``), or with ``really`` False count what would go."""
    if fingerprint is None and really:
        return store.clear(), "deleted"
    keys = [key for key in store.iter_keys()
            if fingerprint is None or _header_fields(store, key)[0] == fingerprint]
    if not really:
        return len(keys), "would delete (pass --yes to delete)"
    return sum(bool(store.delete(key)) for key in keys), "deleted"


def run_store_command(args: argparse.Namespace, console: Console) -> int:
    from kvgroups.store import StoreSecret, open_store  # noqa: PLC0415 - keeps the other commands' start fast

    secret = StoreSecret.from_file(args.secret_file) if args.secret_file else StoreSecret.resolve(None)
    with open_store(args.url, create=False) as store:
        if args.store_command == "clear":
            count, done = _clear(store, args.fingerprint, args.yes or not store.shared)
            scope = f" of fingerprint {args.fingerprint}" if args.fingerprint else ""
            sys.stdout.write(f"{done} {count} entries{scope} from {store.url}\n")
            return 0
        if args.store_command == "stats":
            report = _stats(store)
            if args.json:
                sys.stdout.write(json.dumps(report, indent=2) + "\n")
                return 0
            span = f"; written {report['oldest']} to {report['newest']}" if report["oldest"] else ""
            table = Table(title=f"{report['url']}: {report['entries']} entries, {report['bytes']:,} bytes{span}")
            for header, justify in (("fingerprint", "left"), ("entries", "right"), ("bytes", "right"),
                                    ("oldest", "left"), ("newest", "left")):
                table.add_column(header, justify=justify)  # type: ignore[arg-type]
            for row in report["by_fingerprint"]:
                table.add_row(row["fingerprint"], f"{row['entries']:,}", f"{row['bytes']:,}", row["oldest"] or "-",
                              row["newest"] or "-")
            console.print(table)
            return 0
        report = _verify(store, args.delete, secret)
        if args.json:
            sys.stdout.write(json.dumps(report, indent=2) + "\n")
        else:
            sys.stdout.write(f"checked {report['checked']} entries of {report['url']}: {len(report['bad'])} bad"
                             + (f", {report['deleted']} deleted" if args.delete else "") + "\n")
            for entry in report["bad"]:
                sys.stdout.write(f"bad {entry['key']}: {entry['problem']}\n")
        return EXIT_BAD_ENTRIES if report["bad"] else 0
