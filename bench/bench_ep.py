"""Expert parallelism on two devices, the parts of issue 42 that bench_dp.py does not measure
(random weights, every configuration in worker processes the engine starts):

  tokens  greedy tokens of two expert-parallel ranks against one process holding every expert,
          the DeepSeek-V2-Lite shape and the DeepSeek-V4-Flash shape at reduced depth (random
          weights seeded by tensor name, so both hold the same model);
  eplb    skewed routing (a few experts made hot on every rank), EPLB off and on, eager steps
          (graph steps compute every pair on every rank: the placement does not change them):
          output throughput, and the busiest rank's share of the MoE pairs over each interval
          before a rearrangement (the first: the initial placement; the last: balanced);
  faults  a rank raising (then the next call), killed, stalled past distributed_timeout_s,
          calling generate once more than the other: the error and the seconds until the
          call ended on every rank.

--cpu runs every part at tiny sizes on the reference backend over gloo (a few minutes on two
cores); without it: the backend the machine selects (cuda: NCCL). Results: one JSON (--out).

    python bench/bench_ep.py --out /tmp/ep.json --cpu
    python bench/bench_ep.py --out $OUT/ep.json --part tokens
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.args import engine_config, resolve_engine_config
from deepinfer.entrypoints.data_parallel import DataParallelEngine, RandomWeights
from deepinfer.models.hub import REPO_MODEL_DIR
from deepinfer.testing.checkpoints import tiny_v4_config

PARTS = ("tokens", "eplb", "faults")


def with_layers(config_file: Path, layers: int | None, out: Path) -> Path:
    """A copy of config_file with num_hidden_layers = layers (None: as it is), no MTP layers."""
    config = json.loads(config_file.read_text())
    if layers is not None:
        config["num_hidden_layers"] = layers
    config["num_nextn_predict_layers"] = 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out / "config.json"


def start(args: argparse.Namespace, config_file: Path, dp: int, fp8: bool = False, **kwargs: Any) -> Any:
    """A DataParallelEngine of dp workers over random weights of config_file (seeded by name)."""
    engine_args = {
        "backend": args.backend, "dtype": args.dtype, "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs, "data_parallel_size": dp, "enable_expert_parallel": dp > 1,
        "distributed_timeout_s": args.timeout_s, "seed": 0, **kwargs,
    }  # fmt: skip
    setup = engine_args.pop("setup", None)
    config = resolve_engine_config(engine_config(config_file.parent, engine_args, "bench_ep"), config_file)
    return DataParallelEngine(
        config,
        LLM.from_engine,
        setup=setup,
        random_weights=RandomWeights(str(config_file), fp8, by_name=True),
    )


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": p} for p in torch.randint(3, vocab, (n, length), generator=g).tolist()]


def greedy_tokens(engine: Any, requests: list[Any], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [
        list(o.outputs[0].token_ids)
        for o in engine.generate(requests, [params] * len(requests), use_tqdm=False)
    ]


# --------------------------------------------------------------------------- tokens


def part_tokens(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, config_file, fp8 in models(args, folder):
        row: dict[str, Any] = {"config": str(config_file), "fp8": fp8}
        try:
            tokens = {}
            for dp in (1, 2):
                engine = start(args, config_file, dp, fp8, max_num_seqs=args.tokens_prompts)
                try:
                    requests = prompts(engine.vocab_size, args.tokens_prompts, args.input_len)
                    tokens[dp] = greedy_tokens(engine, requests, args.tokens_out)
                finally:
                    engine.close()
            pairs = [(a, b) for a, b in zip(tokens[1], tokens[2])]
            row["requests_equal"] = sum(a == b for a, b in pairs)
            row["requests"] = len(pairs)
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in pairs]
            row["first_difference"] = [f for f in first if f is not None]
            row["equal"] = row["requests_equal"] == row["requests"]
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        out[name] = row
        print(f"tokens {name}: {row}", flush=True)
    return out


def models(args: argparse.Namespace, folder: Path) -> list[tuple[str, Path, bool]]:
    """(name, config.json, fp8) of the token-equality models."""
    if args.cpu:
        v4 = folder / "tiny-v4"
        v4.mkdir(parents=True, exist_ok=True)
        (v4 / "config.json").write_text(json.dumps(tiny_v4_config(n_routed_experts=6)))
        tiny = with_layers(REPO_MODEL_DIR / "tiny" / "config.json", None, folder / "tiny")
        return [("tiny-v3", tiny, False), ("tiny-v4", v4 / "config.json", False)]
    v2 = with_layers(REPO_MODEL_DIR / "deepseek-v2-lite" / "config.json", args.v2_layers, folder / "v2")
    v4 = with_layers(REPO_MODEL_DIR / "deepseek-v4-flash" / "config.json", args.v4_layers, folder / "v4")
    return [(f"deepseek-v2-lite ({args.v2_layers or 'all'} layers)", v2, False),
            (f"deepseek-v4-flash ({args.v4_layers} layers, FP8 + MXFP4)", v4, True)]  # fmt: skip


# --------------------------------------------------------------------------- EPLB


def skew(hot: list[int], rank: int, llm: Any) -> None:
    """Make experts `hot` win most selections in every MoE layer: +1 on their routing bias where
    the router has one (V3, V4), else their gate rows times 6 (V2's softmax router)."""
    for m in llm.llm_engine.model.modules():
        if not hasattr(m, "gate_weight") or not hasattr(m, "held"):
            continue
        bias = getattr(m, "e_score_correction_bias", None)
        bias = bias if bias is not None else getattr(m, "bias", None)
        if bias is not None and bias.numel() == m.gate_weight.shape[0]:
            bias[hot] += 1.0
        else:
            m.gate_weight[hot] *= 6.0


def part_eplb(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    name = "tiny" if args.cpu else "deepseek-v2-lite"
    config_file = with_layers(REPO_MODEL_DIR / name / "config.json", args.eplb_layers, folder / "eplb")
    experts = json.loads(config_file.read_text())["n_routed_experts"]
    hot = list(range(experts // 2 - 2, experts // 2 + 1))  # 3 experts of rank 0's half
    out: dict[str, Any] = {"config": str(config_file), "hot_experts": hot, "runs": {}}
    for on in (False, True):
        run: dict[str, Any] = {}
        try:
            eplb = {"enable_eplb": True, "eplb_config": {
                "num_redundant_experts": args.redundant, "step_interval": args.interval,
                "window_size": args.interval}} if on else {}  # fmt: skip
            engine = start(
                args, config_file, 2, enforce_eager=True, setup=functools.partial(skew, hot), **eplb
            )
            try:
                requests = prompts(engine.vocab_size, args.eplb_prompts, args.input_len, seed=1)
                params = SamplingParams(temperature=1.0, max_tokens=args.eplb_out, ignore_eos=True, seed=0)
                engine.generate(requests[:4], [params] * 4, use_tqdm=False)  # warm-up
                t0 = time.perf_counter()
                done = engine.generate(requests, [params] * len(requests), use_tqdm=False)
                run["elapsed_s"] = time.perf_counter() - t0
                run["output_tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in done) / run["elapsed_s"]
                run["busiest_share_per_interval"] = engine.eplb_shares
            finally:
                engine.close()
        except Exception as exc:
            run["error"] = f"{type(exc).__name__}: {exc}"[:600]
        out["runs"]["on" if on else "off"] = run
        print(f"eplb {'on' if on else 'off'}: {run}", flush=True)
    on_run, off_run = out["runs"].get("on", {}), out["runs"].get("off", {})
    shares = on_run.get("busiest_share_per_interval") or []
    if len(shares) >= 2:
        out["busiest_share_initial_placement"] = shares[0]
        out["busiest_share_balanced"] = shares[-1]
    if "output_tokens_per_s" in on_run and "output_tokens_per_s" in off_run:
        out["throughput_on_over_off"] = on_run["output_tokens_per_s"] / off_run["output_tokens_per_s"]
    return out


# --------------------------------------------------------------------------- faults


def faults(directory: str, rank: int, llm: Any) -> None:
    """Rank 1's faults, each armed by a file in `directory` (removed when it fires): raise, kill
    (SIGKILL), stall (sleeps the stall file's seconds) in its next step; diverge: its next
    generate runs twice."""
    if rank != 1:
        return
    engine, folder = llm.llm_engine, Path(directory)

    def fires(name: str) -> str | None:
        armed = folder / name
        if armed.exists():
            text = armed.read_text()
            armed.unlink()
            return text
        return None

    def forward(real: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            if fires("raise") is not None:
                raise RuntimeError("injected fault")
            if fires("kill") is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            stall = fires("stall")
            if stall is not None:
                time.sleep(float(stall))
            return real(*a, **k)

        return wrapped

    engine.step = forward(engine.step)
    generate = llm.generate

    def diverging(*a: Any, **k: Any) -> Any:
        if fires("diverge") is not None:
            generate(*a, **k)
        return generate(*a, **k)

    llm.generate = diverging


def part_faults(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    config_file = with_layers(REPO_MODEL_DIR / "tiny" / "config.json", None, folder / "faults")
    timeout = args.fault_timeout_s
    bound = 2 * timeout + 5
    out: dict[str, Any] = {"distributed_timeout_s": timeout, "bound_s": bound, "cases": {}}
    arm = folder / "armed"
    arm.mkdir(exist_ok=True)
    for case in ("raise", "kill", "stall", "diverge"):
        row: dict[str, Any] = {}
        try:
            engine = start(
                args, config_file, 2, setup=functools.partial(faults, str(arm)), max_num_seqs=8,
                distributed_timeout_s=timeout,
            )  # fmt: skip
            pids = list(engine.worker_pids)
            try:
                requests = prompts(engine.vocab_size, 4, 8)
                greedy_tokens(engine, requests, 4)  # warm
                (arm / case).write_text(str(timeout * 1.5 + 2) if case == "stall" else "")
                t0 = time.monotonic()
                try:
                    greedy_tokens(engine, requests, 16)
                    row["error"] = None
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                row["ended_after_s"] = time.monotonic() - t0
                row["within_bound"] = row["ended_after_s"] <= bound and row["error"] is not None
                if case == "raise":  # the workers keep serving
                    row["next_call_served"] = len(greedy_tokens(engine, requests, 2)) == len(requests)
                else:
                    time.sleep(1.0)
                    row["workers_gone"] = all(not _alive(p) for p in pids)
            finally:
                engine.close()
        except Exception as exc:
            row["setup_error"] = f"{type(exc).__name__}: {exc}"[:400]
        out["cases"][case] = row
        print(f"fault {case}: {row}", flush=True)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie of this process's children counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--cpu", action="store_true", help="tiny sizes, reference backend over gloo")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--dtype", default=None, help="default bfloat16 (cpu: float32)")
    parser.add_argument("--v2-layers", type=int, default=None, help="V2-Lite depth for tokens (default all)")
    parser.add_argument("--v4-layers", type=int, default=4, help="V4-Flash depth for tokens")
    parser.add_argument("--eplb-layers", type=int, default=None, help="default: all (cpu: as tiny)")
    parser.add_argument("--tokens-prompts", type=int, default=None, help="default 16 (cpu 4)")
    parser.add_argument("--tokens-out", type=int, default=None, help="default 32 (cpu 6)")
    parser.add_argument("--eplb-prompts", type=int, default=None, help="default 256 (cpu 6)")
    parser.add_argument("--eplb-out", type=int, default=None, help="default 64 (cpu 6)")
    parser.add_argument("--input-len", type=int, default=None, help="default 128 (cpu 8)")
    parser.add_argument("--redundant", type=int, default=None, help="EPLB redundant slots (default 2)")
    parser.add_argument(
        "--interval", type=int, default=None, help="EPLB step interval = window (default 32, cpu 4)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default 256 (cpu 8)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default 512 (cpu 64)")
    parser.add_argument(
        "--timeout-s", type=float, default=None, help="distributed_timeout_s (default 60, cpu 30)"
    )
    parser.add_argument(
        "--fault-timeout-s", type=float, default=10.0, help="distributed_timeout_s of the faults"
    )
    args = parser.parse_args(argv)
    cpu = args.cpu
    defaults = {
        "backend": "reference" if cpu else "auto", "dtype": "float32" if cpu else "bfloat16",
        "tokens_prompts": 4 if cpu else 16, "tokens_out": 6 if cpu else 32, "eplb_prompts": 6 if cpu else 256,
        "eplb_out": 6 if cpu else 64, "input_len": 8 if cpu else 128, "redundant": 2,
        "interval": 4 if cpu else 32, "max_num_seqs": 8 if cpu else 256, "max_model_len": 64 if cpu else 512,
        "timeout_s": 30.0 if cpu else 60.0,
    }  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    results: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv, "torch": torch.__version__}
    parts = PARTS if args.part == "all" else (args.part,)
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            t0 = time.perf_counter()
            fn = {"tokens": part_tokens, "eplb": part_eplb, "faults": part_faults}[part]
            results[part] = fn(args, Path(tmp) / part)
            results[part]["part_s"] = time.perf_counter() - t0
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({p: results[p] for p in parts}, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
