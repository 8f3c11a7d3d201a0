"""Speculative decoding against plain decoding, side by side in one run.

    python bench/bench_spec.py --model model/tiny --out bench/results/DIR                # H200
    python bench/bench_spec.py --model model/tiny --out DIR --small --backend reference  # CPU, seconds

For each batch size B (1, 8, 32, 128; --small: 1, 4): B greedy requests (EOS ignored) of
--new-tokens output tokens each, from prompts of --prompt-len tokens cut from the corpus'
held-out files (train/train_tiny.py's rule) with the model's tokenizer, or random token ids when
the model has none. Plain decoding (graphs and async scheduling where the backend has them) and
every speculative configuration run the same requests: the DFlash (DSpark) drafter of MODEL/dflash/
(k = 3, 5: --dflash-k), the MTP head chained (k = 1, 2, 3) and the block drafter (k = 1 .. 5, at
most its block size), each without and with confidence scheduling
(--threshold; --schedule measured: expected tokens per ms on the step times the engine measures
at start-up, or --schedule budget with --step-token-budget). A configuration whose drafter the
model lacks is listed as skipped, with the reason, in the table. Speculative steps of up to 64 requests replay
verification graphs (forward, then draw + acceptance + the drafter's next block: the block
drafter's pass, or the MTP head over the verified rows and chained k - 1 times), chained so that
the host reads step N while step N + 1 runs; larger batches step eagerly. graph_steps = the share
of a row's speculative steps that replayed graphs; drafted_steps = the share of all its engine
steps (prefill included) that drafted or verified drafts (scheduled rows: the rest were plain
steps the policy chose, without the drafter), probes = how many of them were probes (measured
policy: the drafter's first block after plain steps).

Output tokens per second = B * new tokens / wall time of the generate call (prefill included;
the median of at least --repeats calls, more until they add up to --min-seconds, each after a
full garbage collection), after a warm-up call of the same batch; each row's plain figure
is timed on the plain engine (kept alive beside the speculative one) just before that row's
speculative call. plain_fastest_tok_s: the row's fastest plain call (plain decoding of model/tiny
at batch 1 is host-bound and follows the host's speed, which drifts up to 2x between calls); the
median speculative figure over it is the conservative speed-up.
mean_accepted = tokens emitted per request per step (1 + accepted drafts): output tokens /
(output tokens - accepted drafts). The outputs of every speculative run are compared with plain
decoding's (greedy): on the CPU a mismatch stops the run; on a GPU the number of requests that
differ is recorded in each row (a verification pass may round a near-tie differently from a
one-row decode step; tests/ check exactness on the reference backend).

Writes OUT/spec.json (rows {"device", "drafter", "k", "scheduled", "batch", "plain_tok_s",
"spec_tok_s", "mean_accepted", "graph_steps", "drafted_steps", "probes",
"requests_differing_from_plain"}), OUT/spec.md
(the table) and OUT/spec.svg (speed-up against batch size, one line per configuration).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.dflash import has_dflash  # noqa: E402
from deepinfer.models.dflash import read_config as read_dflash_config  # noqa: E402


def prompts_for(model_dir: Path, count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: windows of the held-out corpus files, tokenised with
    the model's tokenizer; random ids in [4, vocab) without one."""
    rng = random.Random(seed)
    if not (model_dir / "tokenizer.json").is_file():
        return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(count)]
    from tokenizers import Tokenizer

    sys.path.insert(0, str(ROOT / "train"))
    from train_tiny import stdlib_files

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    _, held, _ = stdlib_files(None)
    ids = [
        i for enc in tok.encode_batch([t for _, t in held[:64]], add_special_tokens=False) for i in enc.ids
    ]
    if len(ids) <= length:
        raise ValueError(f"the held-out files give {len(ids)} tokens, fewer than one prompt ({length})")
    starts = [rng.randrange(0, len(ids) - length) for _ in range(count)]
    return [ids[s : s + length] for s in starts]


def configurations(
    args: argparse.Namespace, has_mtp: bool, block_size: int, dflash_block: int = 0
) -> tuple[list[dict[str, Any]], list[str]]:
    """(speculative configurations to run, reasons for those skipped). dflash_block: the DFlash
    drafter's block size (0: none in MODEL/dflash/)."""
    runs, skipped = [], []
    drafters = (("dflash", args.dflash_k), ("dspark", args.block_k), ("mtp", args.mtp_k))
    for drafter, ks in drafters:  # DFlash, then the block drafter, then MTP
        for k in ks:
            if drafter == "mtp" and not has_mtp:
                skipped.append(f"mtp k={k}: the model has no MTP layer")
                continue
            if drafter == "dflash" and k > dflash_block:
                why = (
                    "no dflash/ beside the model"
                    if dflash_block == 0
                    else f"its block size is {dflash_block}"
                )
                skipped.append(f"dflash k={k}: {why}")
                continue
            if drafter == "dspark" and k > block_size:
                why = (
                    "no drafter beside the model"
                    if block_size == 0
                    else f"the drafter's block size is {block_size}"
                )
                skipped.append(f"dspark k={k}: {why}")
                continue
            for scheduled in {"both": (False, True), "off": (False,), "on": (True,)}[args.scheduling]:
                spec: dict[str, Any] = {"method": drafter, "num_speculative_tokens": k}
                if scheduled:
                    spec.update(
                        confidence_scheduling=True,
                        min_draft_confidence=args.threshold,
                        schedule=args.schedule,
                    )
                    if args.schedule == "budget":
                        spec["step_token_budget"] = args.step_token_budget
                runs.append(spec)
    return runs, skipped


MAX_CALLS = 25  # timed calls per engine and figure at most (min_seconds asks for more)


class Timing(NamedTuple):
    tok_s: float  # output tok/s (the median call)
    tokens: list[list[int]]  # the last call's outputs
    accepted: int  # drafts accepted in the last call
    graph_share: float  # share of its speculative steps that replayed graphs
    drafted_share: float  # share of its engine steps that drafted (the others: plain steps)
    probes: int  # of its drafting steps, probes (the measured policy's first after plain steps)
    beside_tok_s: float  # `beside`'s output tok/s (0.0 without)
    beside_fastest_tok_s: float  # `beside`'s fastest call, in output tok/s (0.0 without)
    pair_ratio: float  # median over adjacent pairs of beside's wall / llm's wall
    walls: list[float]  # seconds per call, in call order
    beside_walls: list[float]  # seconds per `beside` call, in call order
    # the process' CPU time over the wall time per call, in call order (on the H200 about 1.0
    # in every call: the host spins while it waits for the device)
    beside_cpu_shares: list[float]
    cpu_shares: list[float]


def timed(
    llm: LLM,
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    beside: LLM | None = None,
    min_seconds: float = 0.0,
) -> Timing:
    """The Timing of a generate call: the median wall time of at least `repeats` calls after a
    warm-up call, more (up to MAX_CALLS) until each engine's calls add up to min_seconds. With
    `beside` (plain decoding), its calls alternate with llm's, so that drift on the machine
    reaches both medians alike. A full collection runs before each call, outside the timing."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]

    cpu_shares: dict[int, list[float]] = {id(llm): [], id(beside): []}

    def call(engine_llm: LLM) -> tuple[float, Any]:
        gc.collect()
        start, cpu = time.perf_counter(), time.process_time()
        out = engine_llm.generate(batch, params, use_tqdm=False)
        engine_llm.llm_engine.backend.device.synchronize()
        wall = time.perf_counter() - start
        cpu_shares[id(engine_llm)].append((time.process_time() - cpu) / wall)
        return wall, out

    for warm in (llm, beside):
        if warm is not None:
            warm.generate(batch, params, use_tqdm=False)
    engine = llm.llm_engine
    spec = engine.speculative
    walls: list[float] = []
    beside_walls: list[float] = []
    while len(walls) < MAX_CALLS and (
        len(walls) < repeats or min(sum(walls), sum(beside_walls) if beside else min_seconds) < min_seconds
    ):
        if beside is not None:
            beside_walls.append(call(beside)[0])
        accepted = engine.num_accepted_tokens
        steps = (
            (spec.num_steps, spec.num_graph_steps, spec.num_plain_steps, spec.num_probes)
            if spec
            else (0,) * 4
        )
        wall, out = call(llm)
        walls.append(wall)
    tokens = [list(r.outputs[0].token_ids) for r in out]
    total = len(prompts) * new_tokens
    median = sorted(walls)[len(walls) // 2]
    beside_tok_s = total / sorted(beside_walls)[len(beside_walls) // 2] if beside_walls else 0.0
    beside_fastest = total / min(beside_walls) if beside_walls else 0.0
    pairs = sorted(p / w for p, w in zip(beside_walls, walls, strict=False))
    pair_ratio = pairs[len(pairs) // 2] if pairs else 0.0
    ran, graphs = (spec.num_steps - steps[0], spec.num_graph_steps - steps[1]) if spec else (0, 0)
    share = graphs / ran if ran else 0.0
    plain_steps = spec.num_plain_steps - steps[2] if spec else 0
    probes = spec.num_probes - steps[3] if spec else 0
    return Timing(
        total / median,
        tokens,
        engine.num_accepted_tokens - accepted,
        share,
        ran / (ran + plain_steps) if ran + plain_steps else 0.0,
        probes,
        beside_tok_s,
        beside_fastest,
        pair_ratio,
        [round(w, 4) for w in walls],
        [round(w, 4) for w in beside_walls],
        [round(x, 3) for x in cpu_shares[id(beside)]],
        [round(x, 3) for x in cpu_shares[id(llm)]],
    )


def profiled(llm: LLM, prompts: list[list[int]], new_tokens: int, out_dir: Path) -> dict[str, Any]:
    """One generate call under torch.profiler (device activity): per engine step, the wall
    time, the device's busy time and its kernels (bench_e2e.analyse_trace). Empty on a CPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if llm.llm_engine.backend.device.device().type != "cuda":
        return {}
    from bench_e2e import analyse_trace

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    engine = llm.llm_engine
    steps = {"n": 0}
    real = engine.step

    def counted() -> Any:
        steps["n"] += 1
        return real()

    engine.step = counted  # type: ignore[method-assign]
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        del engine.step
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "trace.json"
    prof.export_chrome_trace(str(path))
    res = analyse_trace(json.loads(path.read_text()), steps["n"])
    path.unlink()
    res["top_kernels"] = res.get("top_kernels", [])[:12]
    return {
        "steps": steps["n"],
        "wall_per_step_ms": wall * 1e3 / steps["n"],
        **res,
    }


# The engine's parts whose host time host_split measures: (owner attribute path, method name).
HOST_PARTS = [
    ("scheduler", "schedule"),
    ("runner.inputs", "prepare"),
    ("runner", "forward"),
    ("runner", "verify_launch"),
    ("runner", "verify_read"),
    ("speculative", "_append_verified"),
    ("speculative", "_propose"),
    ("", "_process_in_flight"),
    ("outputs", "process"),
    ("", "_launch_draw"),
]


def host_split(llm: LLM, batch: list[dict[str, Any]], params: SamplingParams) -> dict[str, float]:
    """One generate call (no profiler) with perf_counter around the engine's parts: milliseconds
    per engine step in each (verify_read and _process_in_flight include the wait for the device;
    a part called inside another counts in both), and the wall time per step."""
    engine = llm.llm_engine
    spent: dict[str, float] = {}
    patched: list[tuple[Any, str]] = []
    for path, name in [*HOST_PARTS, ("", "step")]:
        owner: Any = engine
        for attr in filter(None, path.split(".")):
            owner = getattr(owner, attr, None)
        if owner is None or not hasattr(owner, name):
            continue
        real = getattr(owner, name)

        def timed_part(*a: Any, _real: Any = real, _key: str = f"{path}.{name}".strip("."), **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                spent[_key] = spent.get(_key, 0.0) + time.perf_counter() - t
                if _key == "step":
                    spent["steps"] = spent.get("steps", 0.0) + 1

        setattr(owner, name, timed_part)
        patched.append((owner, name))
    try:
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        engine.backend.device.synchronize()
        wall = time.perf_counter() - start
    finally:
        for owner, name in patched:
            delattr(owner, name)
    n = max(spent.pop("steps", 1.0), 1.0)
    return {"wall": wall * 1e3 / n, **{k: v * 1e3 / n for k, v in sorted(spent.items())}}


def svg_plot(rows: list[dict[str, Any]], title: str) -> str:
    """Speed-up (spec / plain tok/s) against batch size (log2 axis), one polyline per configuration."""
    w, h, left, right, top, bottom = 760, 420, 60, 250, 30, 50
    batches = sorted({r["batch"] for r in rows})
    speedups: list[float] = [r["spec_tok_s"] / r["plain_tok_s"] for r in rows] + [1.0]
    lo, hi = min(speedups) * 0.9, max(speedups) * 1.1
    bx = {b: left + (w - left - right) * (i / max(1, len(batches) - 1)) for i, b in enumerate(batches)}

    def y(v: float) -> float:
        return top + (h - top - bottom) * (1 - (v - lo) / (hi - lo))

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
              "#bcbd22", "#17becf"]  # fmt: skip
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="18" font-size="13">{title}</text>',
        f'<line x1="{left}" y1="{y(1.0):.1f}" x2="{w - right}" y2="{y(1.0):.1f}" '
        'stroke="#999" stroke-dasharray="4"/>',
        f'<text x="{left - 5}" y="{y(1.0) + 4:.1f}" text-anchor="end">1.0x</text>',
        f'<text x="{left - 5}" y="{y(hi) + 10:.1f}" text-anchor="end">{hi:.2f}x</text>',
        f'<text x="{left - 5}" y="{y(lo):.1f}" text-anchor="end">{lo:.2f}x</text>',
    ]
    for b in batches:
        out.append(f'<text x="{bx[b]:.1f}" y="{h - bottom + 18}" text-anchor="middle">{b}</text>')
    out.append(f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">batch size</text>')
    keys = sorted({(r["drafter"], r["k"], r["scheduled"]) for r in rows})
    for i, key in enumerate(keys):
        pts = sorted(
            (r["batch"], r["spec_tok_s"] / r["plain_tok_s"])
            for r in rows
            if (r["drafter"], r["k"], r["scheduled"]) == key
        )
        color = colors[i % len(colors)]
        path = " ".join(f"{bx[b]:.1f},{y(s):.1f}" for b, s in pts)
        dash = "" if key[2] else ' stroke-dasharray="6 3"'
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        label = f"{key[0]} k={key[1]}{' scheduled' if key[2] else ''}"
        ly = top + 14 * i
        out.append(
            f'<line x1="{w - right + 10}" y1="{ly}" x2="{w - right + 30}" y2="{ly}" '
            f'stroke="{color}" stroke-width="2"{dash}/>'
        )
        out.append(f'<text x="{w - right + 35}" y="{ly + 4}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def markdown(rows: list[dict[str, Any]], skipped: list[str], header: str) -> str:
    nan = float("nan")
    lines = [
        header,
        "",
        "| drafter | k | scheduled | batch | plain tok/s | spec tok/s | speed-up | median of pair ratios "
        "| against the fastest plain call | plain tok/s, timed first | mean accepted | graph steps "
        "| drafted steps (probes) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        fastest = r["spec_tok_s"] / r.get("plain_fastest_tok_s", nan)
        lines.append(
            f"| {r['drafter']} | {r['k']} | {'yes' if r['scheduled'] else 'no'} | {r['batch']} | "
            f"{r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['spec_tok_s'] / r['plain_tok_s']:.2f}x | "
            f"{r.get('speedup_pairs', 0.0):.2f}x | {fastest:.2f}x | "
            f"{r.get('plain_first_tok_s', 0.0):.1f} | "
            f"{r['mean_accepted']:.2f} | {r.get('graph_steps', 0.0):.0%} | "
            f"{r.get('drafted_steps', 0.0):.0%} ({r.get('probes', 0)}) |"
        )
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


T0 = time.perf_counter()


def profile_run(
    args: argparse.Namespace,
    plain: LLM,
    runs: list[dict[str, Any]],
    common: dict[str, Any],
    prompts: list[list[int]],
) -> None:
    """--profile: at the first batch size, plain decoding and every configuration, all kept alive:
    first each one's host_split (a warm-up call, then --profile-calls timed calls, the engines
    taking turns, to catch the plain engine's slow and fast calls), then each one's call under
    torch.profiler (it comes last: on the H200, plain decoding at batch 1 timed 1056 to 1666 tok/s
    after the profiler had run in the process, 2231 to 3250 in a run without it).
    Writes OUT/profile.json."""
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    engines: list[tuple[Any, LLM]] = [("plain", plain)]
    engines += [(spec, LLM(str(args.model), **common, speculative_config=spec)) for spec in runs]
    results: list[dict[str, Any]] = [
        {"config": c, "batch": len(prompts), "host_split": []} for c, _ in engines
    ]
    for _, llm in engines:
        llm.generate(batch, params, use_tqdm=False)
    for _ in range(args.profile_calls):
        for res, (_, llm) in zip(results, engines):
            gc.collect()
            res["host_split"].append(host_split(llm, batch, params))
            print(json.dumps({"config": res["config"], **res["host_split"][-1]}), flush=True)
    for res, (_, llm) in zip(results, engines):
        res.update(profiled(llm, prompts, args.new_tokens, args.out))
        summary = {k: v for k, v in res.items() if k not in ("top_kernels", "host_split")}
        print(json.dumps(summary), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(results, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "model" / "tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--device-name", default=None, help='the "device" of the rows (default: H200 on CUDA, else cpu)'
    )
    ap.add_argument("--small", action="store_true", help="batches 1 and 4, few tokens: a CPU run of seconds")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--mtp-k", type=int, nargs="*", default=None, help="MTP chain lengths (default 1 2 3)")
    ap.add_argument("--block-k", type=int, nargs="*", default=None, help="block drafter k (default 1..5)")
    ap.add_argument(
        "--dflash-k",
        type=int,
        nargs="*",
        default=None,
        help="DFlash (DSpark) drafter k (default 3 5; --small: 2)",
    )
    ap.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="min_draft_confidence when scheduled (default: 0.3 with --schedule budget; 0 with measured, "
        "whose rule verifies every draft below the width it picks, as a padding row costs what a draft does)",
    )
    ap.add_argument(
        "--schedule",
        choices=("measured", "budget"),
        default="measured",
        help="confidence scheduling's policy",
    )
    ap.add_argument(
        "--step-token-budget", type=int, default=64, help="step_token_budget with --schedule budget"
    )
    ap.add_argument(
        "--scheduling", choices=("both", "off", "on"), default="both",
        help="each configuration without and with confidence scheduling (both), or only one of them",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="least timed calls per figure (their median)")
    ap.add_argument(
        "--min-seconds",
        type=float,
        default=None,
        help=f"more calls (up to {MAX_CALLS}) until each engine's timed calls of a figure add up to this"
        " (default 1; --small: 0)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="a run of its own (no timed rows): per engine at the first batch, host_split, then a profile",
    )
    ap.add_argument("--profile-calls", type=int, default=1, help="--profile: host_split calls per engine")
    ap.add_argument(
        "--time-budget", type=float, default=None, help="seconds: later configurations are skipped (listed)"
    )
    ap.add_argument(
        "--gpu-log",
        action="store_true",
        help="sample the GPU's clocks, power and load every 200 ms into OUT/gpu_log.csv (nvidia-smi), and "
        "stamp each row with its start and end (unix seconds), to see what the plain figure's drift follows",
    )
    args = ap.parse_args(argv)
    if args.threshold is None:
        args.threshold = 0.3 if args.schedule == "budget" else 0.0
    args.batches = args.batches or ([1, 4] if args.small else [1, 8, 32, 128])
    args.new_tokens = args.new_tokens or (8 if args.small else 128)
    if args.min_seconds is None:
        args.min_seconds = 0.0 if args.small else 1.0
    args.prompt_len = args.prompt_len or (16 if args.small else 64)
    args.mtp_k = args.mtp_k if args.mtp_k is not None else ([1, 2] if args.small else [1, 2, 3])
    args.block_k = args.block_k if args.block_k is not None else ([2, 5] if args.small else [1, 2, 3, 4, 5])
    args.dflash_k = args.dflash_k if args.dflash_k is not None else ([2] if args.small else [3, 5])

    common: dict[str, Any] = {
        "backend": args.backend,
        "dtype": args.dtype,
        "max_num_seqs": max(args.batches),
        "max_model_len": args.prompt_len + args.new_tokens + 16,
        "seed": args.seed,
    }
    plain = LLM(str(args.model), **common)
    engine = plain.llm_engine
    model = engine.model
    device = args.device_name or ("H200" if engine.backend.device.device().type == "cuda" else "cpu")
    drafter = getattr(model, "drafter", None)
    dflash_block = read_dflash_config(args.model).block_size if has_dflash(args.model) else 0
    runs, skipped = configurations(
        args, model.num_mtp_layers > 0, drafter.block_size if drafter else 0, dflash_block
    )
    print(f"backend {engine.backend.name}, device {device}; {len(runs)} configurations", flush=True)

    prompts = {
        b: prompts_for(args.model, b, args.prompt_len, engine.vocab_size, args.seed + b) for b in args.batches
    }
    if args.profile:  # a run of its own: no timed rows
        profile_run(args, plain, runs, common, prompts[args.batches[0]])
        return []
    base = {}
    for b in args.batches:
        first = timed(plain, prompts[b], args.new_tokens, args.repeats, None, args.min_seconds)
        tok_s, tokens = first.tok_s, first.tokens
        base[b] = (tok_s, tokens)
        print(f"plain B={b}: {tok_s:.1f} tok/s", flush=True)

    rows: list[dict[str, Any]] = []
    header = (
        f"Speculative decoding on {device} ({args.model.name}, backend {engine.backend.name}): "
        f"{args.new_tokens} greedy output tokens per request from {args.prompt_len}-token held-out prompts; "
        f"scheduled = confidence threshold {args.threshold}, "
        + (
            f"step_token_budget {args.step_token_budget}."
            if args.schedule == "budget"
            else "drafts chosen on the measured step times."
        )
    )
    args.out.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after every configuration: a run cut short keeps what it measured
        (args.out / "spec.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "spec.md").write_text(markdown(rows, skipped, header))
        if rows:
            (args.out / "spec.svg").write_text(svg_plot(rows, f"speculative / plain output tok/s, {device}"))

    sampler = gpu_sampler(args.out / "gpu_log.csv") if args.gpu_log else None
    for spec in runs:
        if args.time_budget is not None and time.perf_counter() - T0 > args.time_budget:
            skipped.append(
                f"{spec['method']} k={spec['num_speculative_tokens']}"
                f"{' scheduled' if spec.get('confidence_scheduling') else ''}: over the time budget"
            )
            continue
        llm = LLM(str(args.model), **common, speculative_config=spec)
        for b in args.batches:
            # plain decoding timed in alternation with it: the two figures of a row are medians of
            # interleaved calls (a baseline timed once, first, drifted by up to 1.5x on a shared
            # CPU; timed just before, still up to 2x between rows on an H200)
            started = time.time()
            timing = timed(llm, prompts[b], args.new_tokens, args.repeats, plain, args.min_seconds)
            tok_s, tokens, accepted = timing.tok_s, timing.tokens, timing.accepted
            # Exact in exact arithmetic; on a GPU a verification pass (1 + k rows) may round a
            # near-tie differently from a one-row decode step, so differences are counted, not hidden.
            differ = sum(t != u for t, u in zip(tokens, base[b][1], strict=True))
            if differ and device == "cpu":
                raise RuntimeError(f"{spec} at batch {b}: outputs differ from plain decoding")
            total = b * args.new_tokens
            row = {
                "device": device,
                "drafter": spec["method"],
                "k": spec["num_speculative_tokens"],
                "scheduled": bool(spec.get("confidence_scheduling", False)),
                "schedule": spec.get("schedule") if spec.get("confidence_scheduling") else None,
                "batch": b,
                "plain_tok_s": round(timing.beside_tok_s, 2),
                "spec_tok_s": round(tok_s, 2),
                # the same calls as pairs (plain, then speculative): the median of their ratios,
                # and the plain figure timed alone before any speculative engine existed
                "speedup_pairs": round(timing.pair_ratio, 3),
                "plain_first_tok_s": round(base[b][0], 2),
                # the row's fastest plain call: plain decoding at a host-bound batch follows the
                # host's speed, which drifts up to 2x between calls (docs/speculative.md); the
                # median speculative figure over this one is the conservative speed-up
                "plain_fastest_tok_s": round(timing.beside_fastest_tok_s, 2),
                "mean_accepted": round(total / (total - accepted), 3),
                "graph_steps": round(timing.graph_share, 3),
                "drafted_steps": round(timing.drafted_share, 3),
                "probes": timing.probes,
                "requests_differing_from_plain": differ,
            }
            if sampler is not None:
                row.update(started=round(started, 2), ended=round(time.time(), 2))
                # per call, in call order: what the plain figure's drift follows
                row.update(plain_walls=timing.beside_walls, spec_walls=timing.walls)
                row.update(plain_cpu_share=timing.beside_cpu_shares, spec_cpu_share=timing.cpu_shares)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
        write()
    del plain
    write()
    if sampler is not None:
        sampler.terminate()
    return rows


def gpu_sampler(path: Path) -> subprocess.Popen[bytes] | None:
    """nvidia-smi writing timestamp, SM and memory clocks, power and load every 200 ms to `path`
    (None where there is no nvidia-smi). Read-only queries: the card's settings are left alone."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        print("--gpu-log: no nvidia-smi here", flush=True)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    query = "timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu"
    cmd = [smi, f"--query-gpu={query}", "--format=csv", "-lms", "200", "-f", str(path)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
