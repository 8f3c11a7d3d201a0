"""Attention data parallelism started by the engine: `LLM(path, data_parallel_size=N, ...)`.

The calling process keeps no model. It spawns N worker processes (torch.multiprocessing's spawn
start method), one per device; worker r makes its backend on device r, joins torch.distributed
with the backend's collective backend (nccl with a CUDA device each, hccl on Ascend, gloo on the
CPU) and builds the per-rank engine of enable_expert_parallel as it is (LLMEngine: 1/N of the
routed experts, all_to_all dispatch and combine, deepinfer.parallel.rank_sync). Without expert
parallelism each worker is a whole replica and no group is made.

A generate call: the requests get their seeds in prompt order as one engine would draw them (so
seeded and unseeded sampling give what one process gives), are balanced over the ranks (longest
first, to the least loaded rank, by prompt + output tokens), every worker runs one generate call
with its share (possibly none: its rank still joins the MoE exchanges), and the outputs come back
in prompt order.

Faults end the call, never hang it:
- a worker that raises (and lives): every rank raises at the same step (rank_sync); the call
  raises naming the rank and its error, and the workers go on serving;
- a worker that dies (killed, crashed): the call raises at once naming the rank and how it ended;
- ranks whose group is broken (a rank fell out of step: a stall, a different number of calls):
  each learns of it within distributed_timeout_s and the call raises with the reason;
- the other workers not answering within 2 * distributed_timeout_s + 5 s of the first failure.
In the last three cases, and on KeyboardInterrupt, every worker is stopped and later calls raise.
Workers are stopped at close(), when the engine is garbage-collected, at interpreter exit, and
within a second of the calling process dying; they ignore SIGINT, which the calling process
handles.

External launch (`distributed_executor_backend="external_launcher"`, vLLM's semantics): every
rank is a process of its own running the same script (torchrun, several nodes included);
external_launch() joins the group from torchrun's environment and each rank serves the prompts
it is given.

Layering: this is the executor LLM runs for data_parallel_size > 1, above the engine and below
the offline API. The API hands it the wrapper each rank serves its calls through (make_llm:
LLM.from_engine, pickled to the workers), so this module never imports deepinfer.api.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import random
import re
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from deepinfer.config import EngineConfig
from deepinfer.log import progress_bar

if TYPE_CHECKING:
    from deepinfer.backend.ops import Backend
    from deepinfer.engine.images import ImageSetup
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine.outputs import RequestOutput
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class RankLLM(Protocol):
    """The offline API over one rank's engine (deepinfer.api.LLM), which a worker serves with."""

    @property
    def llm_engine(self) -> LLMEngine: ...

    def generate(
        self, prompts: list[Any], sampling_params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]: ...


# Wraps a rank's engine in the offline API (LLM.from_engine: picklable, sent to each worker).
MakeLLM = Callable[["LLMEngine"], RankLLM]
# What a worker runs after its LLM is built (tests inject faults with it): setup(rank, llm).
WorkerSetup = Callable[[int, RankLLM], None]
_PROMPT_INDEX = re.compile(r"^prompt (\d+): ")


# --------------------------------------------------------------------------- balancing


def request_cost(prompt: Any, params: SamplingParams) -> int:
    """Tokens a request is expected to cost: its prompt (token ids, or text at ~4 characters a
    token) plus its outputs (max_tokens, 256 when unbounded), times its completions."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        n_in = len(prompt["prompt_token_ids"])
    else:
        text = prompt.get("prompt", "") if isinstance(prompt, dict) else prompt
        n_in = len(text) // 4 + 1 if isinstance(text, str) else 1
    n_out = params.max_tokens if params.max_tokens is not None else 256
    return (n_in + n_out) * params.num_sequences


def balance(costs: Sequence[int], ranks: int) -> list[list[int]]:
    """Request indices for each rank: the costliest first, each to the least loaded rank (ties:
    the lowest rank); each rank's indices in prompt order."""
    loads = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        loads[r] += costs[i]
        shares[r].append(i)
    return [sorted(s) for s in shares]


# --------------------------------------------------------------------------- the worker


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent(parent_pid: int) -> None:
    """Exit this process soon after the process that spawned it is gone (killed: no pipe to
    close, no exit handler), even in the middle of a call: a daemon thread polls the parent id."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="deepinfer-dp-parent-watch", daemon=True).start()


def _backend_for_rank(config: EngineConfig, device_index: int) -> Backend:
    from deepinfer.backend.registry import get_backend
    from deepinfer.backend.types import BackendOptions

    options = BackendOptions(
        device_index=device_index, batch_invariant=config.batch_invariant, max_model_len=config.max_model_len
    )
    return get_backend(config.backend, options)


def _error_reply(exc: BaseException, rank: int, indices: Sequence[int] = ()) -> dict[str, Any]:
    """An exception as a message the parent can rebuild: its type name, its message (a local
    "prompt i: " turned into the global index) and its traceback."""
    message = str(exc)
    match = _PROMPT_INDEX.match(message)
    if match and int(match.group(1)) < len(indices):
        message = f"prompt {indices[int(match.group(1))]}: {message[match.end() :]}"
    return {
        "error": message,
        "type": type(exc).__name__,
        "user": isinstance(exc, (ValueError, TypeError)),
        "traceback": "".join(traceback.format_exception(exc)),
        "rank": rank,
    }


@dataclass(frozen=True)
class RandomWeights:
    """Workers build a random-weight model of this config.json instead of loading config.model
    (deepinfer.testing.random_model; benchmarks)."""

    config_file: str
    fp8: bool = False
    by_name: bool = False  # each tensor seeded by its name: every rank's experts are one model's


def _engine_for_rank(config: EngineConfig, backend: Backend, random: RandomWeights | None) -> LLMEngine:
    from deepinfer.engine.llm_engine import LLMEngine

    if random is None:
        return LLMEngine(config, backend=backend)
    from deepinfer.parallel.expert_parallel import ExpertParallel
    from deepinfer.testing.random_model import random_model

    micro_batches = 2 if config.enable_two_batch_overlap else 1
    ep = (
        ExpertParallel.from_torch_distributed(micro_batches, config.eplb)
        if config.enable_expert_parallel
        else None
    )
    model = random_model(
        Path(random.config_file), backend, config.torch_dtype, config.seed,
        config.gpu_memory_utilization, ep, random.fp8, by_name=random.by_name,
    )  # fmt: skip
    return LLMEngine(config, model=model, backend=backend)


def _worker_main(
    rank: int,
    config: EngineConfig,
    port: int,
    conn: Connection,
    make_llm: MakeLLM,
    setup: WorkerSetup | None,
    random: RandomWeights | None,
    parent_pid: int,
) -> None:
    """One data-parallel rank: build the engine, then serve ("generate", ...) messages until
    ("stop",) or the parent's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the calling process's to handle
    _die_with_parent(parent_pid)
    os.environ["LOCAL_RANK"] = str(rank)
    import torch.distributed as dist

    try:
        backend = _backend_for_rank(config, rank)
        if config.enable_expert_parallel:
            dist.init_process_group(
                backend.collectives.dist_backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=config.data_parallel_size,
                timeout=timedelta(seconds=config.distributed_timeout_s),
            )
        llm = make_llm(_engine_for_rank(config, backend, random))
        if setup is not None:
            setup(rank, llm)
        engine = llm.llm_engine
        conn.send({
            "vocab_size": engine.vocab_size, "backend": engine.backend.name, "pid": os.getpid(),
            "graph_buckets": sorted(engine.worker.decode_graphs), "async_scheduling": engine.async_scheduling,
            "images": engine.requests.images,
        })  # fmt: skip
    except BaseException as exc:
        conn.send(_error_reply(exc, rank))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if message[0] == "stop":
            break
        _, prompts, params, indices = message
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            reply: dict[str, Any] = {"outputs": outputs, "num_preemptions": engine.scheduler.num_preemptions}
            if engine.expert_balancer is not None:  # EPLB: the busiest rank's share, per rearrangement
                reply["eplb_shares"] = list(engine.expert_balancer.shares)
        except BaseException as exc:
            reply = _error_reply(exc, rank, indices)
            sync = engine.expert_parallel.sync if engine.expert_parallel is not None else None
            reply["broken"] = sync is not None and sync.broken is not None
        conn.send(reply)
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# --------------------------------------------------------------------------- the calling process


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection


def _how_it_ended(process: BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop_workers(workers: list[_Worker], graceful: bool) -> None:
    """Stop every worker and wait for it: ("stop",) first when graceful, then SIGTERM, SIGKILL."""
    if graceful:
        for w in workers:
            with contextlib.suppress(Exception):
                w.conn.send(("stop",))
        deadline = time.monotonic() + 10
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
    for w in workers:
        w.process.join(5)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(5)
    for w in workers:
        with contextlib.suppress(Exception):
            w.conn.close()


class DataParallelError(RuntimeError):
    """A data-parallel job failed: a rank raised, died, or fell out of step."""


class DataParallelEngine:
    """The calling process's side of data_parallel_size worker processes (see the module).

    make_llm: wraps each worker's engine in the offline API (deepinfer.api.LLM.from_engine).
    setup: run in each worker once its LLM is built, setup(rank, llm) (a picklable function).
    random_weights: the workers build random weights of that config instead of loading a
    checkpoint (config.model then only supplies a tokenizer, if it has one)."""

    def __init__(
        self,
        config: EngineConfig,
        make_llm: MakeLLM,
        setup: WorkerSetup | None = None,
        random_weights: RandomWeights | None = None,
    ) -> None:
        from deepinfer.engine.tokenizer import Tokenizer

        if getattr(mp.current_process(), "_inheriting", False):  # a spawned worker re-running __main__
            raise RuntimeError(
                "data_parallel_size > 1 spawns worker processes, which import the main script again: "
                "create the LLM under `if __name__ == '__main__':`"
            )
        self.config = config
        self.size = config.data_parallel_size
        tok_dir = Path(config.tokenizer or config.model)
        self.tokenizer: Tokenizer | None = (
            Tokenizer(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        )
        self.closed: str | None = None  # why the workers were stopped
        self.num_preemptions = 0
        # EPLB: the busiest rank's share over each interval before a rearrangement (last call)
        self.eplb_shares: list[float] | None = None
        self._seed_rng = random.Random(config.seed)
        self._next_id = 0
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._workers: list[_Worker] = []
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            process = ctx.Process(
                target=_worker_main,
                args=(rank, config, port, child, make_llm, setup, random_weights, os.getpid()),
                name=f"deepinfer-dp-rank{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self._workers.append(_Worker(rank, process, parent))
        # stopped when this object is collected or at interpreter exit, whichever comes first
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, True)
        logger.info("data parallelism: %d worker processes started", self.size)
        start = time.perf_counter()
        ready = self._gather("start")
        self.vocab_size: int = ready[0]["vocab_size"]
        self.backend_name: str = ready[0]["backend"]
        self.worker_pids: list[int] = [r["pid"] for r in ready]
        # the decode graphs every rank captured (none: eager steps) and whether it schedules ahead
        self.graph_buckets: list[int] = ready[0]["graph_buckets"]
        self.async_scheduling: bool = ready[0]["async_scheduling"]
        self.images: ImageSetup | None = ready[0]["images"]  # how the model takes images (chat's parts)
        logger.info("data parallelism: %d ranks ready in %.1f s", self.size, time.perf_counter() - start)

    # ------------------------------------------------------------------ calls

    def generate(
        self, prompts: list[Any], params: list[SamplingParams], use_tqdm: bool | Callable[..., Any] = True
    ) -> list[RequestOutput]:
        """One generate call over the ranks: outputs in prompt order (see the module)."""
        from deepinfer.engine.sampling_params import SamplingParams

        if self.closed is not None:
            raise DataParallelError(f"the data-parallel workers were stopped: {self.closed}")
        state = self._seed_rng.getstate()
        seeded = []
        for i, p in enumerate(params):  # the seeds one engine would draw, in prompt order
            try:
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling params must be SamplingParams, got {type(p).__name__}")
                q = p.for_request()
            except (ValueError, TypeError) as exc:
                self._seed_rng.setstate(state)
                raise type(exc)(f"prompt {i}: {exc}") from exc
            if q.seed is None:
                q.seed = self._seed_rng.getrandbits(63)
            seeded.append(q)
        shares = balance([request_cost(p, q) for p, q in zip(prompts, seeded)], self.size)
        with self._ending_on_interrupt("generate"):
            for w, share in zip(self._workers, shares):
                message = ("generate", [prompts[i] for i in share], [seeded[i] for i in share], share)
                try:
                    w.conn.send(message)
                except OSError as exc:  # a worker that is gone: its death is read below
                    logger.debug("rank %d: send failed: %s", w.rank, exc)
        with progress_bar(use_tqdm, len(prompts), "Processed prompts") as bar:
            try:
                replies = self._gather("generate", lambda r: bar.update(len(shares[r])))
            except (ValueError, TypeError):
                self._seed_rng.setstate(state)  # as one engine: a refused call changes nothing
                raise
        outputs: list[Any] = [None] * len(prompts)
        self.num_preemptions = 0
        self.eplb_shares = replies[0].get("eplb_shares")
        for share, reply in zip(shares, replies):
            self.num_preemptions += reply["num_preemptions"]
            for i, out in zip(share, reply["outputs"]):
                out.request_id = str(self._next_id + i)
                outputs[i] = out
        self._next_id += len(prompts)
        return outputs

    def default_sampling_params(self) -> SamplingParams:
        """As LLMEngine.default_sampling_params (it reads only the config's files)."""
        from deepinfer.engine.llm_engine import LLMEngine

        return LLMEngine.default_sampling_params(self)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the workers (also done at garbage collection and at interpreter exit)."""
        if self.closed is None:
            self.closed = "close() was called"
        self._finalizer()

    def _end(self, reason: str) -> None:
        """Stop every worker at once after a fault; later calls raise with `reason`."""
        if self.closed is None:
            self.closed = reason
        self._finalizer.detach()
        _stop_workers(self._workers, graceful=False)

    # ------------------------------------------------------------------ replies

    def _gather(self, what: str, on_reply: Callable[[int], object] | None = None) -> list[dict[str, Any]]:
        """Every worker's reply to the last message, in rank order; raises (naming the rank and
        the cause) if one failed, died, or the others did not answer in time after a failure."""
        replies: dict[int, dict[str, Any]] = {}
        pending = {w.rank: w for w in self._workers}
        first_failure: float | None = None
        # after a failure in a call the others raise at the same step; a failed start ends the job
        grace = 2 * self.config.distributed_timeout_s + 5
        with self._ending_on_interrupt(what):
            while pending:
                timeout = None if first_failure is None else first_failure + grace - time.monotonic()
                if timeout is not None and timeout <= 0:
                    late = ", ".join(str(r) for r in sorted(pending))
                    self._raise(replies, f"rank(s) {late} did not answer within {grace:g} s of the failure")
                handles: list[Any] = [w.conn for w in pending.values()]
                handles += [w.process.sentinel for w in pending.values()]
                for handle in wait(handles, timeout):
                    w = next(w for w in pending.values() if handle in (w.conn, w.process.sentinel))
                    if w.rank not in pending:
                        continue
                    reply = self._read(w)
                    if reply is None:  # it died: the job ends now
                        w.process.join(5)
                        reason = f"data-parallel rank {w.rank} {_how_it_ended(w.process)} during {what}"
                        if what == "start":
                            reason += " (its error, if any, is on stderr)"
                        self._end(reason)
                        raise DataParallelError(f"{reason}; every worker was stopped")
                    del pending[w.rank]
                    replies[w.rank] = reply
                    if "error" in reply and what != "generate":
                        self._raise(replies, f"could not {what}")
                    if "error" in reply and first_failure is None:
                        first_failure = time.monotonic()
                    elif "error" not in reply and on_reply is not None:
                        on_reply(w.rank)
        if any("error" in r for r in replies.values()):
            self._raise(replies, None if what == "generate" else f"could not {what}")
        return [replies[r] for r in range(self.size)]

    @contextlib.contextmanager
    def _ending_on_interrupt(self, what: str) -> Iterator[None]:
        """Ctrl-C (or any error of this process) while the workers run `what`: stop them all."""
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, DataParallelError) and self.closed is None:
                self._end(f"{type(exc).__name__} during {what}")
            raise

    @staticmethod
    def _read(w: _Worker) -> dict[str, Any] | None:
        """The worker's reply (its pipe is readable or its process ended), or None if it died
        without one."""
        try:
            if w.conn.poll():
                reply: dict[str, Any] = w.conn.recv()
                return reply
        except (EOFError, OSError):
            pass
        return None

    def _raise(self, replies: dict[int, dict[str, Any]], extra: str | None) -> None:
        """Raise the failure: the error of the rank that caused it (the others' say they failed
        because of another rank), its type kept for a refused request (ValueError, TypeError)."""
        failed = [r for r in replies.values() if "error" in r]
        caused = [r for r in failed if not r["error"].startswith("generate failed on another")] or failed
        cause = caused[0] if caused else None
        broken = extra is not None or any(r.get("broken") for r in failed)
        if cause is None:
            message = f"data-parallel job failed: {extra}"
        else:
            message = f"data-parallel rank {cause['rank']} failed: {cause['type']}: {cause['error']}"
            if extra is not None:
                message += f"; {extra}"
        if broken:
            self._end(message)
            message += "; every worker was stopped"
        if cause is not None and cause["user"] and not broken:
            exc: Exception = (ValueError if cause["type"] != "TypeError" else TypeError)(cause["error"])
            exc.add_note(f"(on data-parallel rank {cause['rank']})")
        else:
            exc = DataParallelError(message)
        if cause is not None:
            exc.add_note(f"traceback on data-parallel rank {cause['rank']}:\n{cause['traceback']}")
        raise exc


# --------------------------------------------------------------------------- external launch


def external_launch(config: EngineConfig) -> Backend:
    """This process's rank of a job launched outside the engine (torchrun: RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT): its backend on device LOCAL_RANK, and the default
    torch.distributed group joined with the backend's collective backend unless the caller
    already made one (then destroyed at exit). ValueError when the group's size is not
    data_parallel_size, or torchrun's environment is missing."""
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = _backend_for_rank(config, local_rank)
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(
                "distributed_executor_backend='external_launcher' runs under torchrun (or with its "
                f"environment variables); {', '.join(missing)} not set"
            )
        dist.init_process_group(
            backend.collectives.dist_backend, timeout=timedelta(seconds=config.distributed_timeout_s)
        )
        atexit.register(_destroy_group)
    if dist.get_world_size() != config.data_parallel_size:
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size}, but the launcher started "
            f"{dist.get_world_size()} ranks (WORLD_SIZE): give data_parallel_size = the number of ranks"
        )
    return backend


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
