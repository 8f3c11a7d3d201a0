"""pytest plugin of the conformance suite: options, the backend under test, shared fixtures.

Load it with `-p deepinfer.testing.plugin` (`deepinfer conformance` does). Options:
  --deepinfer-backend NAME   backend under test (default: reference), created through the
                             registry exactly as the engine creates it
  --deepinfer-heavy          also run tests marked `heavy` (or DEEPINFER_CONFORMANCE_HEAVY=1)
  --deepinfer-seed N         offset every test's seed (each test is seeded from its node id)
  --deepinfer-plugin MODULE[:ATTR]
                             also register this backend plugin (repeatable): a backend that is
                             not installed through an entry point (in development, or built by a
                             test); the multi-process cases register it in their processes too
Fixtures are documented in deepinfer/testing/__init__.py.

A claim the suite cannot check where it runs (e.g. collectives when the backend's
torch.distributed backend is unavailable) is never skipped quietly: `skip_unchecked` warns, skips
with a reason that starts "NOT CHECKED", and the run ends with a section listing every such case,
because a port can look green without them having run.
"""

from __future__ import annotations

import os
import warnings
from typing import NoReturn

import pytest
import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.registry import BackendError, BackendRegistry
from deepinfer.backend.types import BackendOptions
from deepinfer.testing.helpers import registry_with, seed_from

HEAVY_ENV = "DEEPINFER_CONFORMANCE_HEAVY"

# Every float dtype a backend may claim; tests parametrised by `dtype` skip the unclaimed ones.
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

UNCHECKED = "NOT CHECKED"


class ConformanceGapWarning(UserWarning):
    """A claim of the backend the suite could not check in this environment."""


def skip_unchecked(what: str, why: str) -> NoReturn:
    """Skip loudly: a warning, a skip reason starting with NOT CHECKED, and a line in the
    terminal summary (see pytest_terminal_summary)."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    message = (
        f"{UNCHECKED}: {what}: {why}. A backend can pass this run without these cases ever "
        f"running; run them where they can run."
    )
    warnings.warn(ConformanceGapWarning(message), stacklevel=2)
    pytest.skip(message)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deepinfer", "deepinfer backend conformance")
    group.addoption(
        "--deepinfer-backend", default="reference", help="backend under test (default: reference)"
    )
    group.addoption(
        "--deepinfer-heavy",
        action="store_true",
        default=os.environ.get(HEAVY_ENV, "") not in ("", "0"),
        help=f"also run the heavy (larger) cases; also {HEAVY_ENV}=1",
    )
    group.addoption("--deepinfer-seed", type=int, default=0, help="offset added to every test's seed")
    group.addoption(
        "--deepinfer-plugin",
        action="append",
        default=[],
        metavar="MODULE[:ATTR]",
        help="also register this deepinfer backend plugin (a module or object implementing the "
        "deepinfer_backends hook) that is not installed through an entry point; repeatable",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "heavy: larger shapes, run with --deepinfer-heavy")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--deepinfer-heavy"):
        return
    skip = pytest.mark.skip(reason=f"heavy case: run with --deepinfer-heavy or {HEAVY_ENV}=1")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    return f"deepinfer conformance: backend {config.getoption('--deepinfer-backend')!r}"


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """List every case skipped with skip_unchecked, whatever -r says (xdist included: the
    reports reach the controller)."""
    gaps = [
        (rep.nodeid, _skip_reason(rep))
        for rep in terminalreporter.stats.get("skipped", [])
        if isinstance(rep, pytest.TestReport) and UNCHECKED in _skip_reason(rep)
    ]
    if not gaps:
        return
    backend = terminalreporter.config.getoption("--deepinfer-backend")
    terminalreporter.section(f"deepinfer conformance: {len(gaps)} case(s) NOT CHECKED for {backend!r}")
    for nodeid, reason in gaps:
        terminalreporter.write_line(f"{nodeid}\n    {reason}", yellow=True, bold=True)


@pytest.fixture(scope="session")
def backend_name(request: pytest.FixtureRequest) -> str:
    """The name given with --deepinfer-backend."""
    return str(request.config.getoption("--deepinfer-backend"))


@pytest.fixture(scope="session")
def backend_plugins(request: pytest.FixtureRequest) -> list[str]:
    """The plugins given with --deepinfer-plugin (registered on top of the entry points)."""
    return list(request.config.getoption("--deepinfer-plugin"))


@pytest.fixture(scope="session")
def backend_registry(backend_plugins: list[str]) -> BackendRegistry:
    """The registry discovered from the installed entry points, plus --deepinfer-plugin ones."""
    try:
        return registry_with(backend_plugins)
    except ValueError as exc:
        pytest.fail(str(exc), pytrace=False)


def _create(registry: BackendRegistry, name: str, options: BackendOptions) -> Backend:
    try:
        return registry.create(name, options)
    except BackendError as exc:
        pytest.fail(f"cannot create backend {name!r}: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def backend(backend_registry: BackendRegistry, backend_name: str) -> Backend:
    """The backend under test, default options."""
    return _create(backend_registry, backend_name, BackendOptions())


@pytest.fixture(scope="session")
def invariant_backend(backend_registry: BackendRegistry, backend_name: str, backend: Backend) -> Backend:
    """The backend under test created with batch_invariant=True (skips unless it claims it)."""
    if not backend.capabilities.supports_batch_invariant:
        pytest.skip(f"backend {backend_name!r} does not claim batch invariance")
    return _create(backend_registry, backend_name, BackendOptions(batch_invariant=True))


@pytest.fixture(scope="session")
def device(backend: Backend) -> torch.device:
    """The backend's torch device."""
    return backend.device.device()


@pytest.fixture(params=ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request: pytest.FixtureRequest, backend: Backend) -> torch.dtype:
    """Each float dtype the backend claims (the others are skipped)."""
    dt: torch.dtype = request.param
    if dt not in backend.capabilities.dtypes:
        pytest.skip(f"backend {backend.name!r} does not claim {dt}")
    return dt


@pytest.fixture
def fp8(backend: Backend) -> None:
    """Skips the test unless the backend claims FP8 support."""
    if not backend.capabilities.supports_fp8:
        pytest.skip(f"backend {backend.name!r} does not claim FP8")


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test's node id (and --deepinfer-seed)."""
    seed = seed_from(request.node.nodeid, int(request.config.getoption("--deepinfer-seed")))
    return torch.Generator().manual_seed(seed)
