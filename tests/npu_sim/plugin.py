"""pytest plugin that installs the torch_npu simulation before any backend is created.

    python -m pytest -p tests.npu_sim.plugin -p deepinfer.testing.plugin \
        --pyargs deepinfer.testing.conformance --deepinfer-backend ascend

DEEPINFER_NPU_SIM_SOC picks the simulated SoC (default 220, Atlas A2; 260 = Ascend 950).
"""

from __future__ import annotations

import pytest

from .state import STATE, install

install()


def pytest_report_header(config: pytest.Config) -> str:
    return f"torch_npu simulation installed (CPU device, SoC {STATE.soc_version})"
