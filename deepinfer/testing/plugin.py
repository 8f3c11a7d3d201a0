"""pytest plugin of the conformance suite: options, the backend under test, shared fixtures.

Load it with `-p deepinfer.testing.plugin` (`deepinfer conformance` does). Options:
  --deepinfer-backend NAME   backend under test (default: reference), created through the
                             registry exactly as the engine creates it
  --deepinfer-heavy          also run tests marked `heavy` (or DEEPINFER_CONFORMANCE_HEAVY=1)
  --deepinfer-seed N         offset every test's seed (each test is seeded from its node id)
  --deepinfer-dtypes LIST    run the dtype-parametrised cases for these dtypes only (comma-
                             separated, e.g. float32,bfloat16; default: every claimed one); the
                             others are deselected and the verdict line names the restriction
  --deepinfer-plugin MODULE[:ATTR]
                             also register this backend plugin (repeatable): a backend that is
                             not installed through an entry point (in development, or built by a
                             test); the multi-process cases register it in their processes too
Fixtures are documented in deepinfer/testing/__init__.py.

A claim the suite cannot check where it runs (e.g. collectives when the backend's
torch.distributed backend is unavailable) is never skipped quietly: `skip_unchecked` warns, skips
with a reason that starts "NOT CHECKED", and the run ends with a section listing every such case,
because a port can look green without them having run.

What green means: the run ends with a verdict line. GREEN = no failure, no error, no NOT CHECKED
case, and every skip one of the expected kinds: a capability the backend does not claim ("does
not claim ..."), a heavy case without --deepinfer-heavy ("heavy case ..."), or a case that does
not apply to the claims ("not applicable: ..."). Anything else is NOT GREEN, with the reason.
"""

from __future__ import annotations

import warnings
from typing import NoReturn

import pytest
import torch

from deepinfer import envs
from deepinfer.backend.ops import Backend
from deepinfer.backend.registry import BackendError, BackendRegistry
from deepinfer.backend.types import BackendOptions
from deepinfer.testing.helpers import registry_with, seed_from

HEAVY_ENV = envs.CONFORMANCE_HEAVY.name

# Every float dtype a backend may claim; tests parametrised by `dtype` skip the unclaimed ones.
ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

UNCHECKED = "NOT CHECKED"
NOT_APPLICABLE = "not applicable"
# skip reasons a green run may have, by the text they contain -> how the verdict counts them
EXPECTED_SKIPS = (
    ("does not claim", "unclaimed"),
    ("heavy case", "heavy"),
    (NOT_APPLICABLE, "not applicable"),
)


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


def skip_not_applicable(why: str) -> NoReturn:
    """Skip a case that does not apply to what the backend claims (an expected skip)."""
    __tracebackhide__ = True
    pytest.skip(f"{NOT_APPLICABLE}: {why}")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deepinfer", "deepinfer backend conformance")
    group.addoption(
        "--deepinfer-backend", default="reference", help="backend under test (default: reference)"
    )
    group.addoption(
        "--deepinfer-heavy",
        action="store_true",
        default=envs.read().conformance_heavy,
        help=f"also run the heavy (larger) cases; also {HEAVY_ENV}=1",
    )
    group.addoption("--deepinfer-seed", type=int, default=0, help="offset added to every test's seed")
    group.addoption(
        "--deepinfer-dtypes",
        default=None,
        help="comma-separated dtypes whose cases run (default: every claimed one); the verdict names it",
    )
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


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _chosen_dtypes(config: pytest.Config) -> list[str] | None:
    value = config.getoption("--deepinfer-dtypes")
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    known = [_dtype_name(dt) for dt in ALL_DTYPES]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise pytest.UsageError(f"--deepinfer-dtypes {value!r}: expected a comma-separated subset of {known}")
    return names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = _chosen_dtypes(config)
    if chosen is not None:  # deselect the other dtypes' cases
        keep: list[pytest.Item] = []
        drop: list[pytest.Item] = []
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            dt = params.get("dtype")
            (drop if isinstance(dt, torch.dtype) and _dtype_name(dt) not in chosen else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
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


def _reports(terminalreporter: pytest.TerminalReporter, key: str) -> list[pytest.TestReport]:
    return [r for r in terminalreporter.stats.get(key, []) if isinstance(r, pytest.TestReport)]


def verdict(passed: int, failed: int, errors: int, skip_reasons: list[str]) -> tuple[bool, str]:
    """(green, explanation) for a run with these counts and skip reasons (see the module doc)."""
    kinds: dict[str, int] = {}
    unchecked = unexpected = 0
    for reason in skip_reasons:
        if UNCHECKED in reason:
            unchecked += 1
            continue
        kind = next((k for text, k in EXPECTED_SKIPS if text in reason), None)
        if kind is None:
            unexpected += 1
        else:
            kinds[kind] = kinds.get(kind, 0) + 1
    problems = []
    if failed:
        problems.append(f"{failed} failed")
    if errors:
        problems.append(f"{errors} error(s)")
    if unchecked:
        problems.append(f"{unchecked} NOT CHECKED (claims that did not run here, listed above)")
    if unexpected:
        problems.append(f"{unexpected} unexpected skip(s) (run with -rs to see why)")
    if not passed and not problems:
        problems.append("nothing passed")
    expected = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"
    if problems:
        return False, f"NOT GREEN: {'; '.join(problems)}; {passed} passed, expected skips: {expected}"
    return True, f"GREEN: {passed} passed; expected skips: {expected}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """List every case skipped with skip_unchecked, whatever -r says (xdist included: the
    reports reach the controller), then the verdict: GREEN or NOT GREEN and why."""
    backend = terminalreporter.config.getoption("--deepinfer-backend")
    skipped = _reports(terminalreporter, "skipped")
    gaps = [(rep.nodeid, _skip_reason(rep)) for rep in skipped if UNCHECKED in _skip_reason(rep)]
    if gaps:
        terminalreporter.section(f"deepinfer conformance: {len(gaps)} case(s) NOT CHECKED for {backend!r}")
        for nodeid, reason in gaps:
            terminalreporter.write_line(f"{nodeid}\n    {reason}", yellow=True, bold=True)
    calls = [r for r in _reports(terminalreporter, "passed") if r.when == "call"]
    failed = [r for r in _reports(terminalreporter, "failed") if r.when == "call"]
    errors = [r for r in _reports(terminalreporter, "error")] + [
        r for r in _reports(terminalreporter, "failed") if r.when != "call"
    ]
    if not (calls or failed or errors or skipped):
        return  # nothing of the suite ran (e.g. --collect-only)
    green, text = verdict(len(calls), len(failed), len(errors), [_skip_reason(r) for r in skipped])
    chosen = _chosen_dtypes(terminalreporter.config)
    if chosen is not None:
        text += f" (dtypes {', '.join(chosen)} only: --deepinfer-dtypes)"
    terminalreporter.section(f"deepinfer conformance verdict for {backend!r}")
    terminalreporter.write_line(text, green=green, red=not green, bold=True)


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
def short_invariant_backend(
    backend_registry: BackendRegistry, backend_name: str, backend: Backend
) -> Backend:
    """batch_invariant=True for sequences of at most 192 tokens (BackendOptions.max_model_len),
    which a backend may use to size its fixed reductions (skips unless it claims invariance)."""
    if not backend.capabilities.supports_batch_invariant:
        pytest.skip(f"backend {backend_name!r} does not claim batch invariance")
    return _create(backend_registry, backend_name, BackendOptions(batch_invariant=True, max_model_len=192))


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
