"""LLMEngine: requests in, one step at a time (schedule, run, postprocess), outputs out."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from deepinfer.backend.ops import Backend
from deepinfer.backend.registry import get_backend
from deepinfer.backend.types import BackendOptions
from deepinfer.config import EngineConfig
from deepinfer.engine.kv_cache import BlockManager, cdiv, num_blocks_from_memory
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import ScheduledBatch, Scheduler
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured import StructuredOutputs
from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, read_json_file
from deepinfer.parallel.expert_parallel import ExpertParallel


def _ids(value: object) -> list[int]:
    """An eos_token_id field (int, list or tuple) as a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return []


def check_model_dir(path: str | Path) -> Path:
    """The checkpoint directory, or a clear FileNotFoundError."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return p


class LLMEngine:
    """Owns the backend, the model, the KV pool, the scheduler and the sampler."""

    def __init__(self, config: EngineConfig, model: Any = None, backend: Backend | None = None) -> None:
        """Load config.model (a checkpoint directory) on the backend config.backend names.
        `model` (with the `backend` it was built on) may pass an already built model, e.g. random
        weights for benchmarks; the directory then only supplies the tokenizer, if it has one."""
        self.config = config
        self.expert_parallel = (
            ExpertParallel.from_torch_distributed() if config.enable_expert_parallel else None
        )
        if backend is None:
            device_index = int(os.environ.get("LOCAL_RANK", "0")) if self.expert_parallel else 0
            options = BackendOptions(device_index=device_index, batch_invariant=config.batch_invariant)
            backend = get_backend(config.backend, options)
        self.backend = backend
        if model is None:
            from deepinfer.models.loader import load_model

            path = check_model_dir(config.model)
            model = load_model(str(path), self.backend, config.torch_dtype, self.expert_parallel)
            self.tokenizer: Tokenizer | None = (
                Tokenizer(path) if (path / "tokenizer.json").is_file() else None
            )
        else:
            path = Path(config.model)
            self.tokenizer = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
        self.model = model
        mc = model.config
        self.vocab_size: int = mc.vocab_size
        self.max_model_len = self._resolve_max_model_len(config.max_model_len, mc.max_position_embeddings)
        self.eos_token_ids = self._eos_ids(path, mc)

        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_draft_confidence = config.min_draft_confidence
        if self.num_speculative_tokens and getattr(model, "num_mtp_layers", 0) < 1:
            raise ValueError(
                f"speculative_config asks for MTP drafts but {config.model} has no MTP layer "
                "(num_nextn_predict_layers is 0, or its weights are missing)"
            )
        bs = config.block_size
        num_blocks = self._num_kv_blocks()
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        spec = model.kv_cache_spec(num_blocks, bs)
        kv_caches = self.backend.device.allocate_kv_cache(spec, model.num_kv_layers)
        # the MTP head's own cache: same blocks and block tables as the model's layers
        mtp_caches = self.backend.device.allocate_kv_cache(spec, 1) if self.num_speculative_tokens else []
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.backend, kv_caches, bs, mtp_caches)
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and accepted
        self.num_accepted_tokens = 0
        self.sampler = Sampler(self.backend, self.eos_token_ids)
        self._structured: StructuredOutputs | None = None  # made at the first structured request
        self._seed_rng = random.Random(config.seed)
        self._next_id = 0

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _resolve_max_model_len(requested: int | None, max_positions: int) -> int:
        if requested is None:
            return max_positions
        if requested > max_positions:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's max_position_embeddings={max_positions}"
            )
        return requested

    def _eos_ids(self, path: Path, mc: Any) -> list[int]:
        """EOS ids from the model config, generation_config.json and the tokenizer."""
        ids = _ids(getattr(mc, "eos_token_id", None))
        gen = path / "generation_config.json"
        if gen.is_file():
            content = read_json_file(gen)
            if not isinstance(content, dict):
                raise ValueError(f"{gen} must hold a JSON object")
            ids += _ids(content.get("eos_token_id"))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted({i for i in ids if 0 <= i < self.vocab_size})

    def _num_kv_blocks(self) -> int:
        c, bs = self.config, self.config.block_size
        one = self.model.kv_cache_spec(1, bs)
        layers = self.model.num_kv_layers + (1 if self.num_speculative_tokens else 0)
        bytes_per_block = one.bytes_per_token * bs * layers
        if c.num_gpu_blocks_override is not None:
            num_blocks = c.num_gpu_blocks_override
        else:
            if c.kv_cache_memory_bytes is not None:
                num_blocks = c.kv_cache_memory_bytes // bytes_per_block
            else:
                free, total = self.backend.device.memory_info()
                num_blocks = num_blocks_from_memory(free, total, c.gpu_memory_utilization, bytes_per_block)
            # Never more than every request slot at full length could use.
            num_blocks = min(num_blocks, c.max_num_seqs * cdiv(self.max_model_len, bs))
        if num_blocks * bs < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks of {bs}, "
                f"{bytes_per_block} bytes each), fewer than max_model_len={self.max_model_len}; "
                "lower max_model_len, or give the cache more memory (gpu_memory_utilization, "
                "kv_cache_memory_bytes, num_gpu_blocks_override)"
            )
        return num_blocks

    # ------------------------------------------------------------------ requests

    def make_sequence(self, prompt: str | dict[str, Any] | list[int], params: SamplingParams) -> Sequence:
        """Validate and tokenise one request (ValueError / TypeError if it cannot be served)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text: str | None
        if (
            isinstance(prompt, dict)
            and "prompt_token_ids" not in prompt
            and isinstance(prompt.get("prompt"), str)
        ):
            prompt = prompt["prompt"]  # {"prompt": text}, vLLM's TextPrompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.config.model} has no tokenizer.json: pass {{'prompt_token_ids': [...]}}"
                )
            if prompt == "":
                raise ValueError("the prompt is empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        else:
            raise TypeError(
                "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}"
            )
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise TypeError("prompt_token_ids must be a list of ints")
        if len(ids) == 0:
            raise ValueError("the prompt is empty (no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.max_model_len:  # one of exactly max_model_len gets one token (vLLM)
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        bad = [t for t in params.stop_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {self.vocab_size}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        grammar = None
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer; this model directory has none")
            if self._structured is None:
                self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
            grammar = self._structured.matcher(params.structured_outputs)

        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(seed)
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
        seq = Sequence(str(self._next_id), text, list(ids), params, generator, detok)
        seq.grammar = grammar
        self._next_id += 1
        return seq

    def make_sequences(self, prompts: list[Any], params: list[SamplingParams]) -> list[Sequence]:
        """make_sequence for every request, all or nothing: the first bad request raises with
        its index ("prompt 3: ..."), and the engine's seed stream and request ids are left as
        they were, so a failed call does not change what the next one generates."""
        state, next_id = self._seed_rng.getstate(), self._next_id
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                seqs.append(self.make_sequence(prompt, p))
            except (ValueError, TypeError) as exc:
                self._seed_rng.setstate(state)
                self._next_id = next_id
                raise type(exc)(f"prompt {i}: {exc}") from exc
        return seqs

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> None:
        self.scheduler.abort_all()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Sequence]:
        """Schedule, run, sample, postprocess. Returns the sequences that finished.

        With speculative decoding a request that carries k draft tokens gets 1 + k logits rows: the
        token after its last one is sampled from the first as usual; while the token just sampled
        equals the next draft, that draft was right and the token after it is sampled from the
        next row (once the previous one is appended, so penalties, grammars and the request's
        random stream see the same history as in plain decoding). Sampling first and comparing
        after is exact: the emitted tokens follow the model's distribution whatever the drafts.
        Then the MTP head drafts the next ones."""
        batch = self.scheduler.schedule()
        assert len(batch) > 0, "scheduler made no progress"  # the pool holds max_model_len
        starts = [s.num_computed_tokens for s in batch.seqs]
        logits = self.runner.run(batch)  # (rows, V): 1 + draft rows per sampling request
        self.scheduler.advance(batch)
        finished: list[Sequence] = []
        sampling, first_rows, drafted = [], [], []  # drafted: (seq, logits row of its 1st draft)
        row = 0
        for seq, nd in zip(batch.seqs, batch.num_draft_tokens):
            if seq.num_computed_tokens == seq.num_tokens:
                sampling.append(seq)
                first_rows.append(row)
                if nd:
                    drafted.append((seq, row + 1))
                    self.num_draft_tokens += nd
                row += 1 + nd
        accepted: dict[int, int] = {}  # id(seq) -> drafts accepted this step
        if sampling:
            self._sample_and_append(logits[first_rows] if drafted else logits, sampling, finished)
        j, pending = 0, drafted
        while pending:  # draft j was right if the token just sampled equals it
            right = [(s, r) for s, r in pending if not s.is_finished and s.token_ids[-1] == s.draft[j]]
            for seq, _ in right:
                self.scheduler.accept_draft(seq)
                accepted[id(seq)] = accepted.get(id(seq), 0) + 1
            self.num_accepted_tokens += len(right)
            if right:
                self._sample_and_append(logits[[r for _, r in right]], [s for s, _ in right], finished)
            j += 1
            pending = [(s, r + 1) for s, r in right if len(s.draft) > j]
        for seq in batch.seqs:
            seq.draft = []
        if self.num_speculative_tokens:
            self._propose(batch, starts, accepted)
        return finished

    def _sample_and_append(
        self, logits: torch.Tensor, seqs: list[Sequence], finished: list[Sequence]
    ) -> None:
        tokens, logprobs = self.sampler(logits, seqs)
        for seq, token, lp in zip(seqs, tokens, logprobs):
            if self._append(seq, token, lp):
                self.scheduler.finish(seq)
                finished.append(seq)

    def _propose(self, batch: ScheduledBatch, starts: list[int], accepted: dict[int, int]) -> None:
        """Run the MTP head over the positions computed this step whose next token is now known,
        and give each request that reached its last known token drafts for the next step (no
        more than fit below max_model_len, cut at the first the head is not confident of)."""
        seqs, spans, rows, ks = [], [], [], []  # ks: drafts wanted (0: not at its last token yet)
        row = 0
        for seq, start, n, nd in zip(batch.seqs, starts, batch.num_new_tokens, batch.num_draft_tokens):
            valid = n - nd + accepted.get(id(seq), 0)  # positions holding real tokens
            end = min(start + valid, seq.num_tokens - 1)
            if not seq.is_finished and end > start:
                k = 0
                if end == seq.num_tokens - 1:  # draft positions num_tokens .. num_tokens + k - 1
                    k = min(self.num_speculative_tokens, self.max_model_len - seq.num_tokens)
                    # the chain writes the head's cache at num_tokens - 1 .. num_tokens + k - 2
                    if k > 1 and not self.block_manager.allocate(seq, k):
                        k = 1
                seqs.append(seq)
                spans.append((start, end))
                rows.append(row)
                ks.append(k)
            row += n
        if not seqs:
            return
        drafts = self.runner.propose(seqs, spans, rows, [max(k, 1) for k in ks])
        for seq, k, chain in zip(seqs, ks, drafts):
            for token, prob in chain[:k]:
                if prob < self.min_draft_confidence:
                    break
                seq.draft.append(token)

    def _append(self, seq: Sequence, token: int, lp: dict[int, Logprob] | None) -> bool:
        """Add a sampled token, detokenise, check stop conditions. True if seq finished."""
        seq.token_ids.append(token)
        p = seq.params
        if lp is not None:
            if self.tokenizer is not None:
                lp = {t: Logprob(v.logprob, v.rank, self.tokenizer.decode([t], False)) for t, v in lp.items()}
            seq.output_logprobs.append(lp)
            seq.cumulative_logprob += lp[token].logprob
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            raise RuntimeError(f"request {seq.request_id}: token {token} was sampled against its grammar")
        n_out = seq.num_output_tokens
        # Nothing stops the request within its first min_tokens tokens (the sampler bans EOS and
        # stop_token_ids there; a stop string must end after them), as in vLLM.
        may_stop = n_out > p.min_tokens
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif may_stop and p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.grammar is not None and seq.grammar.is_terminated():  # accepted its end (EOS)
            seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            # The stopping token stays in token_ids; its text only with include_stop_str_in_output.
            if seq.detokenizer is not None:
                if p.include_stop_str_in_output:
                    seq.output_text += seq.detokenizer.step(token)
                seq.output_text += seq.detokenizer.flush()
            return True
        new_text = seq.detokenizer.step(token) if seq.detokenizer else ""
        seq.output_text += new_text
        if may_stop and p.stop_strings and new_text:
            hit = find_stop(seq.output_text, len(new_text), p.stop_strings)
            if hit is not None:
                end = hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)
                seq.output_text = seq.output_text[:end]
                seq.finish_reason, seq.stop_reason = "stop", hit[1]
                return True
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            if seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.flush()
            return True
        return False

    @staticmethod
    def to_output(seq: Sequence) -> RequestOutput:
        want_lp = seq.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if want_lp else None,
            logprobs=seq.output_logprobs if want_lp else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], finished=seq.is_finished
        )

    def _count_ranks(self, flag: bool) -> int:
        assert self.expert_parallel is not None
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.runner.device)
        return int(self.backend.collectives.all_reduce(t).item())

    def all_ranks(self, flag: bool) -> bool:
        """flag on every expert-parallel rank (this rank's flag without expert parallelism)."""
        if self.expert_parallel is None:
            return flag
        return self._count_ranks(flag) == self.expert_parallel.world_size

    def any_rank(self, flag: bool) -> bool:
        return flag if self.expert_parallel is None else self._count_ranks(flag) > 0

    def run_to_completion(self, seqs: Iterable[Sequence], progress: Any = None) -> None:
        """Add seqs and step until every request is done. On any error (or Ctrl-C) the
        requests still in flight are dropped, so the engine is ready for the next call."""
        for seq in seqs:
            self.add(seq)
        try:
            while True:
                busy = self.has_unfinished()
                if self.expert_parallel is not None:  # ranks step together: MoE layers exchange
                    if not self.any_rank(busy):
                        break
                    if not busy:
                        self.runner.run_idle()
                        continue
                elif not busy:
                    break
                finished = self.step()
                if progress is not None and finished:
                    progress.update(len(finished))
        except BaseException:
            self.abort_all()
            raise
