"""``kvgroups generate MODEL_DIR``: greedy generation from a local model, reusing stored prefixes.

The model directory is loaded with ``from_pretrained`` from local files only. The text (or, for
``--prompt-ids``, the token ids) goes to stdout; reused and computed tokens and the time to the
first token go to stderr, with a progress bar over the prefill, and with ``--stats`` what the
store did (hits, bytes, times, errors). transformers is imported only
when this command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvgroups.cli.arguments import positive_int
from kvgroups.errors import KVGroupsError


def add_generate_command(commands: Any) -> None:
    generate = commands.add_parser(
        "generate", help="generate from a local transformers model, reusing stored prefixes",
        description="Greedy generation with prefix reuse: the longest stored prefix of the prompt is loaded "
                    "instead of computed, and every new full chunk is saved.",
    )
    generate.add_argument("model", help="a local model directory (config.json, weights, tokenizer)")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", help="a file holding the prompt text")
    prompt.add_argument("--prompt-ids", help="a file of the prompt token ids (JSON list or whitespace-separated)")
    generate.add_argument("--store", required=True, help="store URL, e.g. file:///var/cache/kv (repeat the option "
                                                         "for tiers, fastest first)", action="append")
    generate.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default 32)")
    generate.add_argument("--chunk-size", type=positive_int, default=256, help="tokens per stored chunk (default 256)")
    generate.add_argument("--salt", default="", help="tenant salt: chunks are reused only under the same salt")
    generate.add_argument("--secret-file", help="the deployment's secret (else $KVGROUPS_STORE_SECRET): keyed keys "
                                                "and a MAC on every entry")
    generate.add_argument("--encrypt", action="store_true", help="encrypt the entries saved (needs a secret)")
    generate.add_argument("--stats", action="store_true", help="print what the store did (hits, bytes, times, "
                                                               "errors) on stderr")
    generate.add_argument("--no-restore-check", action="store_true",
                          help="on a transformers version kvgroups never verified, serve hits without first checking "
                               "that a restored prefix continues as a computed one (for operators who verified it)")
    generate.set_defaults(run=run_generate)


class _FirstToken:
    """A generate() streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.at: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.at is None:  # the first call carries the prompt
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _prompt_ids(args: argparse.Namespace, tokenizer: Any) -> list[int]:
    if args.prompt_ids is not None:
        text = Path(args.prompt_ids).read_text(encoding="utf-8").strip()
        try:
            ids = json.loads(text) if text.startswith("[") else [int(token) for token in text.split()]
        except ValueError as error:
            raise KVGroupsError(f"{args.prompt_ids}: not a list of token ids ({error})") from None
        if not ids or not all(isinstance(token, int) and token >= 0 for token in ids):
            raise KVGroupsError(f"{args.prompt_ids}: expected a non-empty list of non-negative token ids")
        return list(ids)
    if tokenizer is None:
        raise KVGroupsError(f"{args.model} has no tokenizer; pass --prompt-ids instead of text")
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text(encoding="utf-8")
    ids = tokenizer(text)["input_ids"]
    if not ids:
        raise KVGroupsError("the prompt is empty")
    return list(ids)


def run_generate(args: argparse.Namespace, console: Console) -> int:
    from kvgroups.store import StoreSecret, open_store  # noqa: PLC0415 - the other commands start without it

    # Everything that can be checked without loading the model is checked first.
    args.secret = StoreSecret.from_file(args.secret_file) if args.secret_file else StoreSecret.resolve(None)
    if args.encrypt and args.secret is None:
        raise KVGroupsError("--encrypt needs a secret: --secret-file FILE, or $KVGROUPS_STORE_SECRET")
    directory = Path(args.model)
    if not (directory / "config.json").is_file():
        raise KVGroupsError(f"{args.model}: not a model directory (no config.json)")
    given_ids = _prompt_ids(args, None) if args.prompt_ids is not None else None
    with open_store(args.store) as store:
        return _generate(args, directory, given_ids, store)


def _generate(args: argparse.Namespace, directory: Path, given_ids: list[int] | None, store: Any) -> int:
    import torch  # noqa: PLC0415 - loading a model stack is this command's alone
    import transformers  # noqa: PLC0415

    from kvgroups.integrations.transformers import PrefixCache  # noqa: PLC0415
    from kvgroups.integrations.transformers.restore_check import RestoreCheckWarning  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # stderr carries our one progress bar and summary
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    except (OSError, ValueError) as error:
        raise KVGroupsError(f"{args.model}: cannot load the model: {error}") from None
    tokenizer = None  # token ids in, token ids out: no tokenizer is read
    if given_ids is None:
        with contextlib.suppress(OSError, ValueError):  # no tokenizer: ids are printed instead
            tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = torch.tensor(given_ids if given_ids is not None else _prompt_ids(args, tokenizer), dtype=torch.int64)
    errors = Console(stderr=True)
    with PrefixCache(model, store, chunk_size=args.chunk_size, salt=args.salt, secret=args.secret,
                     encrypt=args.encrypt, restore_check=False if args.no_restore_check else None) as cache, \
            Progress(TextColumn("[bold]prefill"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     console=errors, transient=True) as progress:
        task = progress.add_task("prefill", total=len(ids))
        first = _FirstToken()
        begin = time.perf_counter()

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        with warnings.catch_warnings():
            # The restore check's warning is the report's: one line on stderr below, not the warnings module's.
            warnings.simplefilter("ignore", RestoreCheckWarning)
            output = cache.generate(ids, max_new_tokens=args.max_new_tokens, streamer=first, progress=advance)
        cache.flush()
        check = cache.restore_check
        prefill = cache.last_prefill
        summary = cache.stats.summary()
    new = output[0, len(ids):].tolist()
    if args.prompt_ids is not None or tokenizer is None:
        sys.stdout.write(json.dumps(new) + "\n")
    else:
        sys.stdout.write(tokenizer.decode(new, skip_special_tokens=True) + "\n")
    ttft = (first.at or time.perf_counter()) - begin
    reused_tokens = prefill.reused_tokens if prefill is not None else 0
    if check is not None and not check.passed:
        sys.stderr.write(f"kvgroups: warning: {' '.join(check.warning.split())}\n")
    errors.print(f"reused {reused_tokens} tokens, computed {len(ids) - reused_tokens}; "
                 f"time to first token {ttft:.3f} s; {len(new)} new tokens")
    if args.stats:
        errors.print(_stats_text(summary), markup=False, highlight=False)
    return 0


def _stats_text(summary: dict[str, Any]) -> str:
    """The store's numbers for this run (docs/metrics.md says what each means), one ``name: value`` a line."""
    lines = ["store stats:"]
    for name, value in summary.items():
        shown = json.dumps(value, separators=(", ", ": ")) if isinstance(value, dict) else value
        lines.append(f"  {name}: {shown}")
    return "\n".join(lines)
