"""LLMEngine: requests in, one step at a time (schedule, launch, process), outputs out.

A step: the scheduler picks the work, the worker (deepinfer.engine.worker) lays it out on the
device and launches the forward (a graph replay where one serves it), the host then processes
the PREVIOUS step's results (async scheduling: its tokens were copied back while this step's
forward was queued), and the draw of this step is launched with every request's history up to
date. Without async scheduling the step's own tokens are processed right away. Steps with
drafts take the same loop: the speculative decoder launches them and processes their results
(every token in flight is processed first); chained verification steps overlap as async ones.

Expert-parallel ranks schedule their step before the status exchange that starts it
(deepinfer.parallel.rank_sync), where each says how many decode rows it asks for: when every
rank's step is a decode batch that fits a graph (or no forward), every rank replays the graph of
the smallest bucket that holds the largest batch (an idle rank with every row padding), its MoE
exchanges of fixed shapes captured inside; otherwise every rank runs eagerly, with the
host-sized exchanges. With speculative decoding a rank plans its whole step first (drafts
limited, results in flight processed) and a step with drafts asks for DRAFTS: every rank then
runs eagerly, and where the drafter's forwards make MoE exchanges (the MTP head), every rank
makes them too, idle forwards of the head on a rank whose step drafts nothing.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.registry import get_backend
from deepinfer.backend.types import BackendOptions
from deepinfer.config import EngineConfig
from deepinfer.engine.args import EngineArgs, backend_choice_reason
from deepinfer.engine.images import image_setup
from deepinfer.engine.kv_cache import GroupedBlockManager
from deepinfer.engine.output_processor import OutputProcessor, SampledStep
from deepinfer.engine.requests import (
    Requests,
    check_model_dir,
    default_sampling_params,
    eos_token_ids,
    load_tokenizer,
    resolve_max_model_len,
)
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import ScheduledBatch, Scheduler
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.speculative import EagerStep, SpeculativeDecoder, VerifyStep
from deepinfer.engine.worker import ForwardOutput, Worker
from deepinfer.log import configure_logging
from deepinfer.model_config import ServedModelConfig
from deepinfer.models.interface import CausalLM
from deepinfer.parallel.eplb import ExpertBalancer
from deepinfer.parallel.exchanges import current_log, log_exchanges
from deepinfer.parallel.expert_parallel import ExpertParallel
from deepinfer.parallel.rank_sync import DRAFTS

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """A step to launch: its batch (None: a chained verification step, its inputs on the
    device), whether it verifies drafts, and the forward the expert-parallel ranks agreed on
    (bucket: the graph to replay; eager: host-sized exchanges)."""

    batch: ScheduledBatch | None
    drafts: bool = False
    bucket: int | None = None
    eager: bool = False


Launched = ForwardOutput | VerifyStep | EagerStep  # a launched step, before its draw
InFlight = SampledStep | VerifyStep | EagerStep  # a step's results, before the host reads them


def _backend(config: EngineConfig, expert_parallel: bool) -> Backend:
    """The backend config.backend names, on this rank's device (LOCAL_RANK) with expert parallelism."""
    device_index = int(os.environ.get("LOCAL_RANK", "0")) if expert_parallel else 0
    options = BackendOptions(
        device_index=device_index, batch_invariant=config.batch_invariant, max_model_len=config.max_model_len
    )
    backend = get_backend(config.backend, options)
    if logger.isEnabledFor(logging.INFO):
        logger.info("backend %s: %s", backend.name, backend_choice_reason(config.backend))
    return backend


def _expert_parallel(config: EngineConfig) -> ExpertParallel | None:
    """This rank's expert-parallel group (enable_expert_parallel), over torch.distributed."""
    if not config.enable_expert_parallel:
        return None
    return ExpertParallel.from_torch_distributed(2 if config.enable_two_batch_overlap else 1, config.eplb)


class LLMEngine:
    """Owns the requests, the scheduler and the output processing; the worker owns the device."""

    def __init__(
        self, config: EngineConfig, model: CausalLM | None = None, backend: Backend | None = None
    ) -> None:
        """Load config.model (a checkpoint directory) on the backend config.backend names.
        `model` (with the `backend` it was built on) may pass an already built model, e.g. random
        weights for benchmarks; the directory then only supplies the tokenizer, if it has one."""
        configure_logging()
        self.config = config
        logger.info("engine arguments (those not at their defaults): %s", config.changed())
        self.expert_parallel = _expert_parallel(config)
        ep = self.expert_parallel is not None
        self.backend = backend if backend is not None else _backend(config, ep)
        path = Path(config.model) if model is not None else check_model_dir(config.model)
        if model is None:
            from deepinfer.models.loader import load_model

            dflash = config.speculative_method == "dflash"  # its caches and injection only when asked
            model = load_model(
                str(path), self.backend, config.torch_dtype, self.expert_parallel, dflash=dflash
            )
        self.tokenizer = load_tokenizer(config, path)
        self.model, mc = model, model.config
        self.vocab_size: int = mc.vocab_size
        self.max_model_len = n = resolve_max_model_len(config.max_model_len, mc.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(path, mc, self.tokenizer, self.vocab_size)
        self.async_scheduling = config.async_scheduling
        self.sampler = Sampler(self.backend, self.eos_token_ids)
        self.worker = w = Worker(config, model, self.backend, self.sampler, n, ep)
        bs, prefix_caching = config.block_size, config.enable_prefix_caching  # the pools' blocks, on the host
        self.block_manager = GroupedBlockManager(
            w.kv_groups, w.pool_blocks, bs, prefix_caching, w.ring_prefix_pool
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.outputs = OutputProcessor(self.scheduler, self.tokenizer, self.eos_token_ids, n)
        self.speculative = (
            SpeculativeDecoder(w, self.scheduler, self.sampler, self.outputs, n)
            if config.num_speculative_tokens
            else None
        )
        self.requests = Requests(
            config, self.tokenizer, self.vocab_size, n, self.eos_token_ids, image_setup(mc, config)
        )
        self.in_flight: InFlight | None = None  # the last step's results, not yet processed
        # expert parallelism: the next step, planned before the status exchange (_plan's result)
        self.planned: tuple[list[Sequence], StepPlan | None] | None = None
        self.draft_exchanges = 0  # MoE exchanges of one MTP head forward (expert parallelism)
        # EPLB: the counts of every MoE layer and their rearrangements (deepinfer.parallel.eplb)
        group = self.expert_parallel
        self.expert_balancer: ExpertBalancer | None = None
        if group is not None and group.eplb is not None:
            self.expert_balancer = ExpertBalancer.of_model(model, group.eplb, group.rank, group.world_size)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """vLLM's: the engine of EngineArgs(model, ...). Drive it with LLM.from_engine(engine)
        .generate(...); its step() is deepinfer's (finished Sequences), not vLLM's request loop."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"from_engine_args takes an EngineArgs, got {type(engine_args).__name__}")
        return cls(engine_args.create_engine_config())

    @functools.cached_property
    def model_config(self) -> ServedModelConfig:
        """The served model as vLLM's ModelConfig names it (deepinfer.model_config)."""
        return ServedModelConfig.of_engine(self.config, self.model.config, self.max_model_len)

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's request loop (add_request / step / has_unfinished_requests) is not served:
        a clear error that says what to call instead."""
        raise ValueError(
            "LLMEngine.add_request() is not supported: deepinfer's engine step() is not vLLM's "
            "request loop; wrap the engine with LLM.from_engine(engine) and call generate() or chat() "
            "(one call serves every request with continuous batching)"
        )

    @property
    def num_draft_tokens(self) -> int:
        return self.speculative.num_draft_tokens if self.speculative else 0

    @property
    def num_accepted_tokens(self) -> int:
        return self.speculative.num_accepted_tokens if self.speculative else 0

    # ------------------------------------------------------------------ requests

    def make_sequence(self, prompt: str | dict[str, Any] | list[int], params: SamplingParams) -> Sequence:
        """Validate and tokenise one request (Requests.make_sequence)."""
        return self.requests.make_sequence(prompt, params)

    def make_sequences(self, prompts: list[Any], params: list[SamplingParams]) -> list[Sequence]:
        """make_sequence for every request, all or nothing (Requests.make_sequences)."""
        return self.requests.make_sequences(prompts, params)

    def default_sampling_params(self) -> SamplingParams:
        """A generate() call's sampling parameters when it passes none (requests.default_sampling_params)."""
        return default_sampling_params(self.config)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (GroupedBlockManager.reset_prefix_cache): True once done, False
        while requests hold blocks (between calls none do)."""
        return self.block_manager.reset_prefix_cache()

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def abort_all(self) -> None:
        """Drop every request (after an error in a step): finish_reason "abort"."""
        self.in_flight = None
        self.planned = None
        if self.speculative is not None:
            self.speculative.chain = None
        for seq in self.scheduler.abort_all():
            if seq.finish_reason is None:
                seq.finish_reason = "abort"

    to_output = staticmethod(OutputProcessor.to_output)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Schedule, launch, process the previous step's results, launch the draw -> the requests
        that finished (with async scheduling or chained verification steps, the previous step's)."""
        if self.speculative is not None:
            self.speculative.tick()
        finished, plan = self.planned or self._plan()
        self.planned = None
        if plan is None:  # nothing to launch: only results in flight are left
            assert self.in_flight is not None or not self.scheduler.has_unfinished(), (
                "scheduler made no progress"
            )
            return finished + self._process_in_flight()
        launched = self._launch(plan)
        finished += self._process_in_flight()
        self.in_flight = self.worker.draw(launched) if isinstance(launched, ForwardOutput) else launched
        if not self._overlaps(launched):
            finished += self._process_in_flight()
        return finished

    def _plan(self) -> tuple[list[Sequence], StepPlan | None]:
        """The next step (None: nothing to launch), and the requests that finished when a step
        with drafts had every token in flight processed first."""
        spec, finished = self.speculative, []
        if spec is not None and spec.chain is not None:  # its next step, unless the chain ends
            return [], StepPlan(None, drafts=True) if spec.chain_goes_on() else None
        drafts = spec is not None and spec.wants_step()
        if spec is not None and drafts:  # drafts: every token on the host first
            finished = self._process_in_flight()
            spec.limit_drafts()
        elif spec is not None:  # confidence scheduling left no room for drafts: a plain step
            spec.drop_drafts()
        plan = StepPlan(self.scheduler.schedule(), drafts=drafts)
        assert plan.batch is not None
        return finished, plan if len(plan.batch) else None

    def _launch(self, plan: StepPlan) -> Launched:
        if plan.drafts:
            assert self.speculative is not None
            return self.speculative.launch(plan.batch)
        assert plan.batch is not None
        if self.speculative is not None:
            self.speculative.plain_launched(plan.batch)
        out = self.worker.forward(plan.batch, plan.bucket, plan.eager)
        self.scheduler.advance(plan.batch)
        return out

    def _overlaps(self, launched: Launched) -> bool:
        """Whether the step's results wait for the next step: async plain steps, chained ones."""
        if isinstance(launched, ForwardOutput):
            return self.async_scheduling
        return self.speculative is not None and self.speculative.chain is not None

    def _process_in_flight(self) -> list[Sequence]:
        done, self.in_flight = self.in_flight, None
        if done is None:
            return []
        if isinstance(done, SampledStep):
            return self.outputs.process(done)
        assert self.speculative is not None
        return self.speculative.process(done)

    # ------------------------------------------------------------------ a generate call

    def start_call(self, build: Callable[[], list[Sequence]]) -> list[Sequence]:
        """The start of a generate call: its requests, built by `build`, once every
        expert-parallel rank starts the call too. A rank whose `build` raises tells the others,
        which raise RuntimeError naming that rank and error, and raises its own error.
        RuntimeError if the ranks' group is broken, or breaks because a rank does not come
        within distributed_timeout_s (deepinfer.parallel.rank_sync)."""
        try:
            seqs = build()
        except BaseException as exc:
            self._all_ranks(exc)
            raise
        if not self._all_ranks(None):  # raises, naming the rank, where another could not start
            raise RuntimeError("generate failed on another expert-parallel rank")
        return seqs

    def _all_ranks(self, error: BaseException | None) -> bool:
        """Whether the call starts on every expert-parallel rank (error None: this one does)."""
        if self.expert_parallel is None:
            return error is None
        return self.expert_parallel.sync.start_call(self.config.distributed_timeout_s, error)

    def run_to_completion(
        self, seqs: Iterable[Sequence], on_finished: Callable[[list[Sequence]], None] | None = None
    ) -> None:
        """Add seqs and step until every request is done, calling on_finished with the requests
        each step finished (e.g. a progress bar's update). On any error (or Ctrl-C) the
        requests still in flight are dropped (reported as "abort"), so the engine is ready for
        the next call.

        Expert parallelism: the ranks step together, each step after a status exchange, until
        none has requests left; a rank without any runs forwards with no tokens, for the MoE
        exchanges (graph replays of padding rows when the others replay graphs). A step that
        raises on one rank raises on every rank at the next exchange, naming that rank and its
        error (deepinfer.parallel.rank_sync)."""
        if self.speculative is not None:
            self.speculative.untimed()
        refused = []
        for seq in seqs:
            if seq.is_finished:  # refused before it started (an image it cannot take)
                refused.append(seq)
            else:
                self.add(seq)
        if refused and on_finished is not None:
            on_finished(refused)
        try:
            while (finished := self._step_all_ranks()) is not None:
                if on_finished is not None and finished:
                    on_finished(finished)
        except BaseException:
            self.abort_all()
            raise

    def _step_all_ranks(self) -> list[Sequence] | None:
        """One step (expert parallelism: of every rank, after the status exchange) -> the
        requests that finished; None once no rank has requests left."""
        busy, ep = self.has_unfinished(), self.expert_parallel
        if ep is None:
            return self.step() if busy else None
        sync, worker = ep.sync, self.worker
        if sync.exchanges_per_forward is None:  # count a forward's exchanges (and the MTP head's)
            sync.run_forward(worker.idle, worker.idle)
            if worker.draft_exchanges:
                with log_exchanges() as log:
                    worker.idle_draft(1)
                self.draft_exchanges = log.done
        rows = sync.start_step(busy, functools.partial(self._plan_step, busy))
        if rows is None:  # no rank has requests left
            return None
        if self.expert_balancer is not None:  # every rank passed this exchange: the same steps
            self.expert_balancer.step(self.backend.collectives)
        bucket = self.worker.agreed_bucket(rows)
        # a step with drafts on any rank: every rank runs the MTP head k times after its forward
        drafting = DRAFTS in rows and self.draft_exchanges > 0
        assert sync.exchanges_per_forward is not None
        head = self.config.num_speculative_tokens * self.draft_exchanges if drafting else 0
        total = sync.exchanges_per_forward + head  # the MoE exchanges every rank makes this step

        def idle(bucket: int | None = bucket) -> None:
            self.worker.idle(bucket)
            if drafting:
                self.worker.idle_draft()

        if not busy:  # the other ranks still step: this one joins their MoE exchanges
            sync.run_forward(idle, idle, total)
            return []

        def step() -> list[Sequence]:
            proposals = worker.num_proposals
            finished = self.step()
            log = current_log()
            if drafting and worker.num_proposals == proposals:  # the head's exchanges, after the forward's
                if log is not None and log.done == 0 and not log.whole:
                    worker.idle(bucket)  # no forward of its own (only results in flight)
                worker.idle_draft()
            return finished

        assert self.planned is not None
        plan = self.planned[1]
        if plan is not None:
            plan.bucket, plan.eager = bucket, bucket is None
        finished: list[Sequence] = sync.run_forward(step, idle, total)
        return finished

    def _plan_step(self, busy: bool) -> int:
        """Expert parallelism, before the status exchange: plan this rank's step (when busy: drafts
        limited, results in flight processed where the step drafts, the batch scheduled) -> the
        rows it asks for (Worker.rows_asked)."""
        self.planned = self._plan() if busy else None
        plan = self.planned[1] if self.planned is not None else None
        if plan is None:
            return self.worker.rows_asked(None)
        return self.worker.rows_asked(plan.batch, plan.drafts)
