"""Registers and spills of the decode step's Triton kernels for SM90, on any machine (no GPU):
each kernel of tests/test_cuda_compile.py's decode-step list is lowered to PTX by Triton and
assembled by the ptxas that ships in the Triton wheel, with -v. A kernel whose registers keep it
to one program per SM, or that spills, is a lead for the decode step's latency (a register file of
65536 a SM: 256 threads at 255 registers is one program).

    python bench/kernel_registers.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGS_PER_SM = 65536


def ptxas_info(ptx: str) -> tuple[int, int, int]:
    """(registers a thread, spill stores, spill loads in bytes a thread) of one kernel's PTX."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(d) / "k.o")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    regs = int(re.findall(r"Used (\d+) registers", out.stderr)[-1])
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)[-1]
    return regs, int(spills[0]), int(spills[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import test_cuda_compile as compiled

    rows = [
        "| kernel | registers a thread | warps | programs a SM by registers | spill stores / loads (bytes) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, ptx in compiled.decode_step_kernels(pdl=True).items():
        regs, stores, loads = ptxas_info(ptx)
        per_sm = REGS_PER_SM // (regs * 32 * ptx.num_warps)
        rows.append(f"| {name} | {regs} | {ptx.num_warps} | {per_sm} | {stores} / {loads} |")
    table = "\n".join(rows)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
