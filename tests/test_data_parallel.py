"""Data parallelism started by the engine, `LLM(path, data_parallel_size=2,
enable_expert_parallel=True)`, over two gloo worker processes on the CPU: outputs equal one process
holding every expert (greedy, seeded and unseeded sampling, an expert count the ranks do not
divide, two-batch overlap); faults (a worker that raises, is killed, or falls out of step) fail the
call naming the rank and the cause within a bounded time and leave no process behind, as do
KeyboardInterrupt, interpreter exit and a killed calling process; the external launch (two local
"nodes" with torchrun's environment) gives the same tokens; the command line, bench/bench_dp.py
at toy sizes, and a backend's fused expert exchange (collectives.expert_exchange).

Each spawned group imports torch in every process: the groups are few, and their limits catch
hangs, not slowness.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.data_parallel import DataParallelEngine, DataParallelError, balance
from deepinfer.parallel.expert_parallel import ExpertParallel
from deepinfer.reference.backend import ReferenceCollectives
from deepinfer.testing.checkpoints import tiny_config, write_random_checkpoint

REPO = Path(__file__).resolve().parents[1]
HANG_S = 300  # a subprocess past this hangs (sized for a busy machine, not for speed)
TIMEOUT_S = 5.0  # distributed_timeout_s of the fault cases
LIMIT_S = 60.0  # the most a fault may take to end the call, on a busy machine
ARGS: dict[str, Any] = {"backend": "reference", "dtype": "float32", "block_size": 8, "max_model_len": 128}
PROMPTS = [[5 + (7 * i + 3 * j) % 120 for j in range(n)] for i, n in enumerate([9, 20, 4, 13, 6])]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    # 7 routed experts over 2 ranks: 4 and 3
    cfg = tiny_config(
        num_nextn_predict_layers=0, num_hidden_layers=3, hidden_size=128, moe_intermediate_size=64,
        n_routed_experts=7, n_group=1, topk_group=1,
    )  # fmt: skip
    return str(write_random_checkpoint(tmp_path_factory.mktemp("dp") / "ckpt", cfg, seed=6))


def _requests() -> list[dict[str, Any]]:
    return [{"prompt_token_ids": p} for p in PROMPTS]


def _sampled() -> list[SamplingParams]:
    """Seeded and unseeded sampling (unseeded requests draw from the engine's seed, in order)."""
    return [
        SamplingParams(
            temperature=1.0, top_k=20, max_tokens=10, ignore_eos=True, seed=7 * i if i % 2 else None
        )
        for i in range(len(PROMPTS))
    ]


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(ckpt: str) -> dict[str, list[list[int]]]:
    """One process holding every expert."""
    single = LLM(ckpt, seed=3, **ARGS)
    return {
        "greedy": _tokens(single.generate(_requests(), GREEDY, use_tqdm=False)),
        "sampled": _tokens(single.generate(_requests(), _sampled(), use_tqdm=False)),
    }


def _gone(pids: list[int]) -> bool:
    """No process of these ids runs (an exited one nobody reaped yet, a zombie, counts as gone)."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:  # it ended meanwhile
            continue
        if state != "Z":
            return False
    return True


def _faults(directory: str, rank: int, llm: LLM) -> None:
    """Rank 1's faults, each armed by a file in `directory` (removed when it fires): "raise"
    raises in its next forward, "kill" SIGKILLs the process in its next forward, "diverge" makes
    its next generate call twice (one call more than the other ranks)."""
    if rank != 1:
        return
    engine, folder = llm.llm_engine, Path(directory)

    def fires(name: str) -> bool:
        armed = folder / name
        if armed.exists():
            armed.unlink()
            return True
        return False

    def forward(real: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if fires("raise"):
                raise RuntimeError("injected fault")
            if fires("kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return wrapped

    engine.step = forward(engine.step)  # type: ignore[method-assign]
    engine.worker.idle = forward(engine.worker.idle)  # type: ignore[method-assign]
    generate = llm.generate

    def diverging(*args: Any, **kwargs: Any) -> Any:
        if fires("diverge"):
            generate(*args, **kwargs)
        return generate(*args, **kwargs)

    llm.generate = diverging  # type: ignore[method-assign]


def _engine(ckpt: str, tmp_path: Path, **kwargs: Any) -> DataParallelEngine:
    from deepinfer.engine.args import engine_config, resolve_engine_config

    args = {**ARGS, "data_parallel_size": 2, "enable_expert_parallel": True, "seed": 3, **kwargs}
    config = resolve_engine_config(engine_config(ckpt, args))
    return DataParallelEngine(config, LLM.from_engine, setup=functools.partial(_faults, str(tmp_path)))


def _timed(llm: LLM, params: Any = GREEDY) -> tuple[Any, float]:
    start = time.monotonic()
    try:
        return llm.generate(_requests(), params, use_tqdm=False), time.monotonic() - start
    except Exception as exc:
        return exc, time.monotonic() - start


def test_balance_spreads_the_cost_and_keeps_prompt_order() -> None:
    assert balance([10, 1, 1, 8, 3], 2) == [[0, 1, 2], [3, 4]]  # loads 12 and 11
    assert balance([], 3) == [[], [], []]
    assert balance([5], 2) == [[0], []]
    bounds = [ExpertParallel(r, 3).expert_bounds(8) for r in range(3)]
    assert bounds[0] == [0, 3, 6, 8]
    with pytest.raises(ValueError, match="at least as many routed experts"):
        ExpertParallel(0, 4).expert_bounds(3)


def test_outputs_equal_one_process_and_a_raising_worker_fails_the_call(
    ckpt: str, expected: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    engine = _engine(ckpt, tmp_path)
    llm = LLM.from_engine(engine)
    pids = list(engine.worker_pids)
    try:
        assert _tokens(llm.generate(_requests(), GREEDY, use_tqdm=False)) == expected["greedy"]
        outputs = llm.generate(_requests(), _sampled(), use_tqdm=False)
        assert _tokens(outputs) == expected["sampled"]
        assert [o.prompt_token_ids for o in outputs] == PROMPTS  # prompt order
        assert len({o.request_id for o in outputs}) == len(PROMPTS)

        # a request a rank refuses: its own error type, the global prompt index; nothing ran
        bad = [*_requests()[:3], {"prompt_token_ids": [999999]}]
        with pytest.raises(ValueError, match=r"^prompt 3: token id 999999 is outside the vocabulary"):
            llm.generate(bad, GREEDY, use_tqdm=False)

        # a worker that raises in a step and lives: the call fails naming it, the workers go on
        (tmp_path / "raise").touch()
        error, took = _timed(llm)
        assert isinstance(error, DataParallelError), error
        assert str(error).startswith("data-parallel rank 1 failed: RuntimeError: injected fault"), error
        assert took < LIMIT_S
        assert not (tmp_path / "raise").exists()
        print(f"\na raising worker: the call failed after {took:.2f} s")
        assert _tokens(llm.generate(_requests(), GREEDY, use_tqdm=False)) == expected["greedy"]
    finally:
        engine.close()
    assert _gone(pids)
    with pytest.raises(DataParallelError, match="workers were stopped: close"):
        llm.generate(_requests(), GREEDY, use_tqdm=False)


def test_two_batch_overlap_equals_one_process_and_a_diverging_worker_ends_the_job(
    ckpt: str, expected: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    engine = _engine(ckpt, tmp_path, enable_two_batch_overlap=True, distributed_timeout_s=TIMEOUT_S)
    llm = LLM.from_engine(engine)
    pids = list(engine.worker_pids)
    try:
        assert _tokens(llm.generate(_requests(), GREEDY, use_tqdm=False)) == expected["greedy"]
        assert _tokens(llm.generate(_requests(), _sampled(), use_tqdm=False)) == expected["sampled"]
        (tmp_path / "diverge").touch()  # rank 1 calls generate once more than rank 0
        error, took = _timed(llm)
        assert isinstance(error, DataParallelError), error
        message = str(error)
        assert message.startswith(
            "data-parallel rank 1 failed: RuntimeError: the expert-parallel group is broken"
        )
        assert (
            f"rank 0 did not call generate a 4th time within distributed_timeout_s={TIMEOUT_S:g} s" in message
        )
        assert message.endswith("every worker was stopped")
        assert took < LIMIT_S
        print(f"\na diverging worker: the job ended after {took:.2f} s")
        assert _gone(pids)
        with pytest.raises(DataParallelError, match="workers were stopped: data-parallel rank 1 failed"):
            llm.generate(_requests(), GREEDY, use_tqdm=False)
    finally:
        engine.close()


def test_a_killed_worker_ends_the_job(ckpt: str, tmp_path: Path) -> None:
    engine = _engine(ckpt, tmp_path, distributed_timeout_s=TIMEOUT_S)
    llm = LLM.from_engine(engine)
    pids = list(engine.worker_pids)
    try:
        (tmp_path / "kill").touch()
        error, took = _timed(llm)
        assert isinstance(error, DataParallelError), error
        assert str(error) == (
            "data-parallel rank 1 was killed by SIGKILL during generate; every worker was stopped"
        )
        assert took < LIMIT_S
        assert _gone(pids)
        print(f"\na killed worker: the job ended after {took:.2f} s")
    finally:
        engine.close()


INTERRUPT_SCRIPT = """
import json, os, signal, sys, threading, time
from deepinfer import LLM, SamplingParams

# Ctrl-C as in a terminal, whatever this process inherited: a parent that ignores SIGINT (a test
# runner's worker may) passes SIG_IGN on, and Python then installs no KeyboardInterrupt handler
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
args = dict(backend="reference", dtype="float32", block_size=8, max_model_len=128,
            data_parallel_size=2, enable_expert_parallel=True)
llm = LLM(sys.argv[1], **args)
first = list(llm.data_parallel.worker_pids)
params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
prompts = [{"prompt_token_ids": [5 + i, 7, 9]} for i in range(4)]
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
interrupted = "no KeyboardInterrupt within 120 s"
try:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until Ctrl-C lands inside a call
        llm.generate(prompts, params, use_tqdm=False)
except KeyboardInterrupt:
    interrupted = llm.data_parallel.closed
second = LLM(sys.argv[1], **args)  # left running: stopped at interpreter exit
tokens = second.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
print(json.dumps({"first": first, "second": list(second.data_parallel.worker_pids),
                  "interrupted": interrupted, "tokens": tokens[0].outputs[0].token_ids}))
"""


def _run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `script` with python -c; a hang fails the test with the threads' stacks, which the
    script writes to stderr (faulthandler) 30 s before it is killed."""
    dump = f"import faulthandler\nfaulthandler.dump_traceback_later({HANG_S - 30})\n"
    try:
        return subprocess.run(
            [sys.executable, "-c", dump + script, *args],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"the script hung for {HANG_S} s; its threads {HANG_S - 30} s in:\n{err[-6000:]}")


def test_keyboard_interrupt_and_interpreter_exit_leave_no_process(ckpt: str) -> None:
    done = _run_script(INTERRUPT_SCRIPT, ckpt)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["interrupted"] == "KeyboardInterrupt during generate"
    assert len(result["tokens"]) == 3
    deadline = time.monotonic() + 30
    while not _gone(result["first"] + result["second"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(result["first"] + result["second"])


KILLED_SCRIPT = """
import json, os, signal, sys
from deepinfer import LLM

llm = LLM(sys.argv[1], backend="reference", dtype="float32", max_model_len=128, data_parallel_size=2,
          enable_expert_parallel=True)
print(json.dumps(llm.data_parallel.worker_pids), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs, no pipe is closed in order
"""


def test_workers_exit_when_the_calling_process_is_killed(ckpt: str) -> None:
    done = _run_script(KILLED_SCRIPT, ckpt)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    pids = json.loads(done.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 30
    while not _gone(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(pids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_external_launch_two_nodes(ckpt: str) -> None:
    """torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 1 on one machine: its environment."""
    script = REPO / "docs" / "examples" / "torchrun_data_parallel.py"
    port = str(_free_port())
    procs = []
    for node in range(2):
        env = {
            **os.environ, "RANK": str(node), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }  # fmt: skip
        cmd = [sys.executable, str(script), "--model", ckpt, "--backend", "reference", "--dtype", "float32"]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    records = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=HANG_S)
            assert p.returncode == 0, err[-3000:]
            records += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        for p in procs:
            p.kill()
    single = LLM(ckpt, **ARGS)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5 + (7 * i + 3 * j) % 120 for j in range(4 + 3 * i)] for i in range(5)]
    want = _tokens(single.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert sorted((r["index"], r["rank"]) for r in records) == [(i, i % 2) for i in range(5)]
    assert [r["token_ids"] for r in sorted(records, key=lambda r: r["index"])] == want


def test_engine_arguments(ckpt: str) -> None:
    with pytest.raises(ValueError, match="enable_two_batch_overlap needs enable_expert_parallel"):
        LLM(ckpt, enable_two_batch_overlap=True, **ARGS)
    with pytest.raises(ValueError, match=r"external_launcher.*enable_expert_parallel=True"):
        LLM(ckpt, distributed_executor_backend="external_launcher", **ARGS)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
        try:
            LLM(ckpt, enable_expert_parallel=True, distributed_executor_backend="external_launcher", **ARGS)
        finally:
            os.environ.update(env)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        LLM(ckpt, data_parallel_size=0, **ARGS)


def test_command_line_generate_and_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deepinfer.entrypoints.cli import main

    tiny = str(REPO / "model" / "tiny")
    common = ["--model", tiny, "--prompt", "Hello there", "--prompt", "A B C", "--prompt", "x"]
    common += [
        "--temperature",
        "0",
        "--max-tokens",
        "4",
        "--json",
        "--backend",
        "reference",
        "--dtype",
        "float32",
    ]
    assert main(["generate", *common]) == 0
    single = capsys.readouterr().out
    assert main(["generate", *common, "--data-parallel-size", "2", "--enable-expert-parallel"]) == 0
    assert capsys.readouterr().out == single  # same records, in prompt order
    assert main(["generate", *common, "--data-parallel-size", "2"]) == 0  # two whole replicas
    assert capsys.readouterr().out == single
    # run-batch over two workers: the same result lines as one process
    src = tmp_path / "requests.jsonl"
    bodies = [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0},
        ),
        ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}),
    ]
    src.write_text("".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}) + "\n"
        for i, (url, body) in enumerate(bodies)
    ))  # fmt: skip
    engine = ["--model", tiny, "--backend", "reference", "--dtype", "float32"]
    results = []
    for extra in ([], ["--data-parallel-size", "2", "--enable-expert-parallel"]):
        out_file = tmp_path / f"results{len(extra)}.jsonl"
        assert main(["run-batch", "-i", str(src), "-o", str(out_file), *engine, *extra]) == 0
        lines = [json.loads(line) for line in out_file.read_text().splitlines()]
        assert [r["custom_id"] for r in lines] == ["r0", "r1", "r2"] and all(
            r["error"] is None for r in lines
        )
        results.append([r["response"]["body"]["choices"] for r in lines])
    assert results[0] == results[1]
    capsys.readouterr()
    out = tmp_path / "bench.json"
    bench = [
        "bench",
        "--random-config",
        "tiny",
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "4",
    ]
    bench += ["--backend", "reference", "--dtype", "float32", "-dp", "2", "--enable-expert-parallel"]
    assert main([*bench, "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["data_parallel_size"] == 2 and result["num_requests"] == 4
    assert result["total_num_tokens"] == 4 * (8 + 4)


def test_bench_dp_runs_at_toy_sizes(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "bench_dp.py"),
        "--toy",
        "--skip-big-on-one",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    one, two = result["runs"]
    assert (one["data_parallel_size"], two["data_parallel_size"]) == (1, 2)
    assert one["output_tokens_per_s"] > 0 and two["output_tokens_per_s"] > 0
    # decode graphs on every rank, expert-parallel ones included (the toy max_num_seqs 8: 1 .. 8)
    assert one["graph_buckets"] == two["graph_buckets"] == [1, 2, 4, 8]
    assert two["async_scheduling"] and "on (4 buckets up to 8), async" in done.stdout
    assert result["speedup_two_over_one"] == two["total_tokens_per_s"] / one["total_tokens_per_s"]
    big = result["big_model"]
    assert big["weight_bytes_per_rank_of_two"] < big["weight_bytes_one_device"]
    assert big["two_devices"]["fp8"] and big["two_devices"]["elapsed_s"] > 0
    assert "two devices / one" in done.stdout


class _LocalExchange(ReferenceCollectives):
    """A fused exchange in a world of one, as collectives.expert_exchange documents it: each
    (token, expert) pair through experts(), weighted and summed per token."""

    calls = 0

    def expert_exchange(self, num_experts: int, x: torch.Tensor, top_k: int) -> Any:
        def exchange(
            x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, local: range, experts: Any
        ) -> Any:
            type(self).calls += 1
            t, k = ids.shape
            out = experts(x.repeat_interleave(k, dim=0), ids.reshape(-1) - local.start)  # (T*K, Dm)
            return (out.view(t, k, -1).float() * weights.float().unsqueeze(-1)).sum(1).to(x.dtype)

        return exchange


def test_a_fused_exchange_serves_the_moe_exchange_and_keeps_its_failure_promise() -> None:
    from deepinfer.backend.types import BackendOptions
    from deepinfer.parallel.exchanges import log_exchanges
    from deepinfer.parallel.expert_parallel import dispatch_combine

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 4, generator=g), torch.rand(5, 2, generator=g)
    ids = torch.randint(0, 3, (5, 2), generator=g)
    scale = torch.tensor([1.0, -2.0, 0.5])

    def experts(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return rows * scale[local_ids].unsqueeze(-1)

    collectives = _LocalExchange(BackendOptions(), torch.device("cpu"))
    want = (x.unsqueeze(1) * scale[ids].unsqueeze(-1) * w.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(dispatch_combine(collectives, x, w, ids, [0, 3], 0, experts), want)
    assert _LocalExchange.calls == 1

    def failing(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("expert failed")

    with log_exchanges() as log, pytest.raises(RuntimeError, match="expert failed"):
        dispatch_combine(collectives, x, w, ids, [0, 3], 0, failing)
    assert (log.done, log.open) == (1, False)  # the exchange completed before the error was raised
