"""Take a freshly trained DFlash drafter for the benchmark that follows, only if it is better:
    python ci/gpu_pending_adopt.py SRC DST FLOOR
copies SRC/config.json and SRC/model.safetensors over DST's when SRC/train_log.json's held-out
mean accepted length is above FLOOR (the shipped drafter's); prints what it did either way."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main(src: Path, dst: Path, floor: float) -> int:
    log = src / "train_log.json"
    if not log.is_file():
        print(f"no trained drafter at {src}: {dst} unchanged")
        return 1
    held_out = json.loads(log.read_text())["held_out"]
    length = float(held_out["mean_accepted_length"])
    if length <= floor:
        print(f"trained drafter's held-out mean accepted length {length:.3f} <= {floor}: {dst} unchanged")
        return 1
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    print(f"adopted {src} (held-out mean accepted length {length:.3f} > {floor}; {held_out})")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])))
