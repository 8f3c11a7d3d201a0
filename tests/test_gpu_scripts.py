"""The device scripts (bench/run_*_h200*.sh, ci/gpu_*.sh) run end to end without a GPU.

Each script is checked with `bash -n`, then run from a copy of the scripts (a skeleton of the
repository: bench/ and ci/ as they are, empty package folders) with `python3`, `nvidia-smi` and
`deepinfer` replaced by stubs on PATH that log their arguments and exit 0, OUT and TMPDIR in the
test's own folder. The test asserts the exit status, the commands the stubs saw (the install and
each part's bench or pytest call), summary.txt where the script promises it, that OUT holds at
most 8 files (what the device returns), and that each script sources bench/h200_lib.sh (the
preamble and the parts' runner they share).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("bench/run_*_h200*.sh"), *ROOT.glob("ci/gpu_*.sh")]
)
INSTALL = "python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/cuda"
# a stub logs its arguments, makes the folder named by --out (a bench's results folder) and exits 0
STUB = """#!/bin/sh
printf '%s\\n' "$(basename "$0") $*" >> "$STUB_LOG"
echo "stub $(basename "$0") $*"
prev=
for a in "$@"; do
  [ "$prev" = --out ] && case $a in *.json) ;; *) mkdir -p "$a" ;; esac
  prev=$a
done
exit 0
"""
# run_ab_h200.sh reverts PATCH in its copy of the tree: a patch whose new side is the skeleton's file
PATCH = "--- a/deepinfer/x.py\n+++ b/deepinfer/x.py\n@@ -1 +1 @@\n-old\n+new\n"

# script -> (arguments, environment, summary.txt under OUT or None, commands the stubs must see)
CASES: dict[str, tuple[list[str], dict[str, str], str | None, list[str]]] = {
    "bench/run_ab_h200.sh": (
        ["{patch}", "--batches", "1"],
        {"CONF_K": "moe"},
        None,
        [INSTALL, "tests/test_async_graphs.py", "deepinfer.testing.conformance", "bench/bench_e2e.py --out"],
    ),
    "bench/run_decode_h200.sh": (
        ["--batches", "1"],
        {},
        None,
        [INSTALL, "bench/bench_moe_decode.py", "bench/bench_invariant_tiles.py --bits", "bench/bench_e2e.py"],
    ),
    "bench/run_dspark_h200.sh": ([], {}, None, [INSTALL, "bench/bench_spec.py", "bench/bench_spec_step.py"]),
    "bench/run_env_sweep_h200.sh": (
        [],
        {"SETTINGS": "A=1;", "CONF_K": "moe"},
        None,
        [INSTALL, "deepinfer.testing.conformance", "bench/bench_e2e.py"],
    ),
    "bench/run_ep_h200x2.sh": (
        [],
        {},
        None,
        [INSTALL, "bench/bench_ep.py --part tokens", "bench/bench_dp.py", "bench/bench_ep.py --part faults"],
    ),
    "bench/run_final_h200.sh": (
        [],
        {},
        None,
        [
            INSTALL,
            "tests/test_async_graphs.py",
            "bench/bench_cuda.py --only v4",
            "deepinfer bench",
            "bench/bench_spec.py",
        ],
    ),
    "bench/run_fp8kv_h200.sh": (
        [],
        {"PARTS": "tests bench conformance_half"},
        "summary.txt",
        [
            INSTALL,
            "tests/test_cuda_kernels.py",
            "test_fp8_kv_cache.py",
            "bench/bench_cuda.py --only decode_fp8",
        ],
    ),
    "bench/run_invariant_h200.sh": (
        [],
        {},
        None,
        [INSTALL, "bench/bench_invariant_tiles.py", "bench/bench_e2e.py"],
    ),
    "bench/run_moe_decode_h200.sh": (
        ["--batches", "1"],
        {},
        None,
        [INSTALL, "tests/test_cuda_kernels.py", "bench/bench_moe_decode.py", "bench/bench_e2e.py"],
    ),
    "bench/run_mxfp4_h200.sh": (
        [],
        {},
        "summary.txt",
        [
            INSTALL,
            "tests/test_cuda_gpu_kernels.py",
            "bench/bench_v4_decode.py --only moe",
            "bench/bench_e2e_v4.py",
        ],
    ),
    "bench/run_skinny_h200.sh": (
        ["--batches", "1"],
        {"SPEC_ARGS": "--batches 1"},
        None,
        [
            INSTALL,
            "tests/test_cuda_kernels.py",
            "bench/bench_router.py",
            "bench/bench_spec.py",
            "bench/bench_e2e.py",
        ],
    ),
    "bench/run_spec_v4_h200.sh": (
        [],
        {"PARTS": "step spec v4 tiles"},
        None,
        [
            INSTALL,
            "bench/bench_spec_step.py",
            "bench/bench_spec.py",
            "deepinfer bench",
            "bench_invariant_tiles.py",
        ],
    ),
    "bench/run_v41_candidates_h200.sh": (
        [],
        {"ENGRAM4": "1"},
        "summary.txt",
        [INSTALL, "tests/test_parity_v41.py", "candidates_bench.py", "-m deepinfer bench"],
    ),
    "bench/run_v41_h200.sh": (
        [],
        {"PARTS": "tests auto bf16"},
        "summary.txt",
        [INSTALL, "test_v41_kv_ops.py", "bench/bench_v41_kv.py"],
    ),
    "bench/run_v41q_h200.sh": (
        [],
        {},
        "summary.txt",
        [INSTALL, "tests/test_parity_v41_kv.py", "bench/bench_v41_kv.py"],
    ),
    "bench/run_v4_e2e_h200.sh": (
        [],
        {},
        None,
        [INSTALL, "bench/bench_e2e_v4.py --smoke", "bench/bench_e2e_v4.py --out"],
    ),
    "bench/run_v4_family_h200.sh": (
        [],
        {},
        "summary.txt",
        [
            INSTALL,
            "tests/test_cuda_kernels.py",
            "bench/bench_e2e_v4.py",
            "bench/bench_spec_step.py",
            "deepinfer bench",
        ],
    ),
    "bench/run_v4_h200.sh": (
        [],
        {},
        "summary.txt",
        [INSTALL, "tests/test_parity_v4_quant.py", "bench/bench_e2e_v4.py", "bench/bench_v4_decode.py"],
    ),
    "bench/run_v4_profile_h200.sh": (
        [],
        {"FP8": "1"},
        "summary.txt",
        [INSTALL, "tests/test_parity_v4_quant.py", "bench/bench_e2e_v4.py", "--only fp8", "--only moe"],
    ),
    "bench/run_v4_step_h200.sh": (
        [],
        {},
        "summary.txt",
        [INSTALL, "tests/test_cuda_kernels.py", "bench/bench_v4_attention.py", "bench/bench_e2e_v4.py"],
    ),
    "bench/run_vision_h200.sh": (
        [],
        {},
        "summary.txt",
        [INSTALL, "tests/test_cuda_kernels.py", "bench/bench_vision.py"],
    ),
    "ci/gpu_ab.sh": (
        ["--batches", "1"],
        {},
        None,
        [
            INSTALL,
            "ci/gpu_tokens.py --write-v4",
            "ci/gpu_tokens.py --compare",
            "tests/test_async_graphs.py",
            "bench/bench_e2e.py",
        ],
    ),
    "ci/gpu_check.sh": (
        [],
        {},
        None,
        [
            "nvidia-smi",
            INSTALL,
            "tests/test_cuda_kernels.py",
            "deepinfer.testing.conformance",
            "bench/bench_cuda.py",
        ],
    ),
    "ci/gpu_pending.sh": (
        ["1"],
        {},
        "summary.txt",
        [
            INSTALL,
            "tests/test_cuda_gpu_kernels.py",
            "train/train_dflash.py",
            "bench/bench_spec.py",
            "--only decode_fp8",
        ],
    ),
    # no bench_e2e.py arguments: with them the script's status is its last grep's, 1 on a stub's output
    "ci/gpu_suite.sh": (
        [],
        {"TRAIN_TINY": "1", "ENGINE_K": "moe"},
        None,
        [INSTALL, "train/train_tiny.py", "train/train_drafter.py", "tests/test_async_graphs.py", "-k moe"],
    ),
    "ci/gpu_wave.sh": (
        ["one|20|python3 bench/x.py --out $OUT"],
        {},
        "summary.txt",
        [INSTALL, "bench/x.py --out"],
    ),
}


def dry_run(
    root: Path, script: str, args: list[str], env: dict[str, str], tmp: Path
) -> tuple[subprocess.CompletedProcess[str], Path, list[str]]:
    """Runs `script` of `root` in a skeleton under `tmp`, the tools stubbed: (process, OUT, stub log)."""
    repo, bin_dir, out, scratch = tmp / "repo", tmp / "bin", tmp / "out", tmp / "scratch"
    for sub in ("bench", "ci"):
        (repo / sub).mkdir(parents=True)
        for f in (root / sub).iterdir():
            if f.suffix in (".sh", ".py"):
                shutil.copy(f, repo / sub / f.name)
    for sub in ("deepinfer", "backends/cuda", "model/tiny", ".ab/old/ci"):
        (repo / sub).mkdir(parents=True)
    (repo / "deepinfer" / "x.py").write_text("new\n")
    (repo / "patch.diff").write_text(PATCH)
    subprocess.run(["tar", "-C", repo / ".ab" / "old", "-czf", repo / ".ab" / "old.tgz", "ci"], check=True)
    bin_dir.mkdir()
    for tool in ("python3", "nvidia-smi", "deepinfer"):
        (bin_dir / tool).write_text(STUB)
        (bin_dir / tool).chmod(0o755)
    scratch.mkdir()
    log = tmp / "stub.log"
    log.touch()
    run_env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PARTS", "PYTHON", "R")}
    run_env.update(
        env, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), TMPDIR=str(scratch), STUB_LOG=str(log)
    )
    argv = [a.replace("{patch}", str(repo / "patch.diff")) for a in args]
    proc = subprocess.run(
        ["bash", repo / script, *argv], env=run_env, cwd=tmp, capture_output=True, text=True, timeout=60
    )
    return proc, out, log.read_text().splitlines()


def test_every_script_has_a_case() -> None:
    assert sorted(CASES) == SCRIPTS
    assert subprocess.run(["bash", "-n", ROOT / "bench" / "h200_lib.sh"]).returncode == 0


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_dry_run(script: str, tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", ROOT / script]).returncode == 0
    assert "h200_lib.sh" in (ROOT / script).read_text(), f"{script} does not source bench/h200_lib.sh"
    args, env, summary, expected = CASES[script]
    proc, out, calls = dry_run(ROOT, script, args, env, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = "\n".join(calls)
    for command in expected:
        assert command in seen, f"{script} never ran {command!r}; the stubs saw:\n{seen}"
    if summary is not None:
        assert (out / summary).is_file(), sorted(p.name for p in out.iterdir())
        assert "install rc=0" in (out / summary).read_text()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, sorted(str(p.relative_to(out)) for p in files)


def test_total_budget_skips_parts(tmp_path: Path) -> None:
    """run_v41q_h200.sh caps its parts by TOTAL_S: with 5 s in all, every part is skipped, none runs."""
    proc, out, calls = dry_run(ROOT, "bench/run_v41q_h200.sh", [], {"TOTAL_S": "5"}, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    for name in ("tests", "parity", "bench_auto"):
        assert f"{name} skipped:" in summary and f"{name} rc=" not in summary, summary
    assert not any("pytest" in c or "bench_v41_kv" in c for c in calls), calls
