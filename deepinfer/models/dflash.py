"""DSpark (DeepSeek's DFlash module): the block drafter conditioned on the target by KV injection
(reference/deepseek-v4.1.md, sections 1.10 and 1.11), here with blocks of the target's kind
(DeepSeek-V2 / V3: MLA attention, DeepSeek MoE).

Symbols: T target tokens of a step, R requests drafting, B block slots, L draft layers, n target
layers read, Dm hidden, V vocab, r Markov rank, C + R' an MLA cache row (latent + rope key).

Conditioning (KV injection), inside the target's own forward (prefill, decode and verification
steps alike, so inside their graphs too):
  trunk_j   the target's residual stream entering layer target_layer_ids[j] (its attention input
            before the norm), (T, Dm) for each of the n layers
  u         project_norm(projection([trunk_0 | ... | trunk_{n-1}]))          (T, n Dm) -> (T, Dm)
  for each draft layer i: u's MLA cache row (kv_a_proj_with_mqa, kv_a_layernorm, rope at the
  token's position) is written into draft layer i's cache at the token's slot. These are the keys
  and values the draft sees for the context; no separate draft prefill exists.

Draft step (t = the last position the target has computed, x the token drawn at t + 1):
  slots s = 0 .. B-1 at positions t+1+s hold [x, noise, ..., noise]              (R, B)
  h = embed(slots) -> L blocks (MLA attention + the drafter's own MoE), each slot's K written at
  t+1+s first; every slot attends the injected rows 0..t and ALL B slots' rows: bidirectional
  inside the block (each slot is a one-row query whose KV length is t+1+B)
  h_s       the last block's residual stream (pre-norm)                           (R, B, Dm)
  logits_s  lm_head(norm(h_s)) + markov_w2(markov_w1[prev_s])                     (R, B, V)
            prev_0 = x, prev_s = draft_{s-1}: the only sequential part, a rank-r lookup a slot
  c_s       sigmoid(accept_rate([h_s ; markov_w1[prev_s]]) / T_s): the chance draft s is accepted
            given drafts < s were; the engine's confidence is the prefix product c_0 ... c_s
The embedding and the LM head are the target's (tied; not stored with the drafter).

Files: DIR/dflash/config.json (DFlashConfig) and DIR/dflash/model.safetensors with DeepSeek's
layout of names (`mtp.{i}.*`): mtp.0 holds projection and project_norm, every mtp.{i} a block
(input_layernorm, self_attn.*, post_attention_layernorm, mlp.*: the target's names), the last one
norm, markov_w1, markov_w2 and accept_rate.proj.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import AttentionMetadata, PagedKVCache
from deepinfer.models.config import ModelConfig
from deepinfer.models.forward_batch import ForwardBatch
from deepinfer.models.layers import Linear, RMSNorm

if TYPE_CHECKING:
    from deepinfer.models.deepseek import DecoderLayer
    from deepinfer.models.weights import WeightSource

DIRECTORY = "dflash"  # beside the model's files
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class DFlashConfig:
    """The drafter's shape (DeepSeek's config keys: num_nextn_predict_layers, dspark_*)."""

    num_layers: int  # L: num_nextn_predict_layers
    block_size: int  # B: slots per block (DeepSeek's runtime default 5)
    target_layer_ids: tuple[int, ...]  # dspark_target_layer_ids: the trunks injected
    markov_rank: int  # r: dspark_markov_rank
    noise_token_id: int  # dspark_noise_token_id: the B - 1 slots after the emitted token
    n_routed_experts: int  # the drafter's own MoE: dspark_n_routed_experts
    num_experts_per_tok: int  # dspark_num_experts_per_tok
    moe_intermediate_size: int
    n_shared_experts: int = 1
    # T_s: one value for every slot, or B values (DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE)
    confidence_temperature: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "markov_rank", "n_routed_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"dflash config: {name} must be a positive integer, got {value!r}")
        if not 1 <= self.block_size <= 32:
            raise ValueError(f"dflash config: block_size must be in [1, 32], got {self.block_size}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"dflash config: num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts "
                f"{self.n_routed_experts}"
            )
        if not self.target_layer_ids:
            raise ValueError("dflash config: target_layer_ids must name at least one target layer")
        temps = self.confidence_temperature
        if len(temps) not in (1, self.block_size) or any(not float(x) > 0 for x in temps):
            raise ValueError(
                f"dflash config: confidence_temperature must be one positive value or {self.block_size}, "
                f"got {list(temps)}"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "dflash config") -> DFlashConfig:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        data = dict(data)
        for key in ("target_layer_ids", "confidence_temperature"):
            if key in data:
                value = data[key]
                data[key] = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        try:
            return cls(**data)
        except TypeError as exc:  # a required key missing
            raise ValueError(f"{where}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_layer_ids"], out["confidence_temperature"] = (
            list(self.target_layer_ids),
            list(self.confidence_temperature),
        )
        return out

    def block_config(self, target: ModelConfig) -> ModelConfig:
        """The target's config with the drafter's own MoE (every draft layer routed, no group
        limit): what each draft block is built from."""
        return dataclasses.replace(
            target,
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            n_shared_experts=self.n_shared_experts,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            moe_layer_freq=1,
        )


class DFlashDrafter(nn.Module):
    """The drafter's L blocks and heads over the backend contract (module docstring)."""

    def __init__(
        self, target: ModelConfig, config: DFlashConfig, backend: Backend, cos_sin: torch.Tensor
    ) -> None:
        """cos_sin: the target's rope table (P, R) float32; the draft blocks use it too."""
        super().__init__()
        from deepinfer.models.deepseek import DecoderLayer  # the target's block kind

        bad = [i for i in config.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ValueError(
                f"dflash config: target_layer_ids {bad} are not layers of the target "
                f"(0 .. {target.num_hidden_layers - 1})"
            )
        self.config, self.backend, self.cos_sin = config, backend, cos_sin
        dm, eps = target.hidden_size, target.rms_norm_eps
        self.hidden_size, self.vocab_size = dm, target.vocab_size
        block = config.block_config(target)
        self.projection = Linear(backend, len(config.target_layer_ids) * dm, dm)
        self.project_norm = RMSNorm(backend, dm, eps)
        self.layers = nn.ModuleList(DecoderLayer(block, backend, 0) for _ in range(config.num_layers))
        for layer in self.blocks:
            # the block's queries read rows this layer writes in the same forward (the other
            # slots): the prefill op, not mla_decode_and_uv, whose rows must predate the forward
            layer.self_attn.decode_kernel = False
        self.norm = RMSNorm(backend, dm, eps)
        r = config.markov_rank
        self.register_buffer("markov_w1", torch.empty(0, device="meta"))  # (V, r) an embedding
        self.markov_w2 = Linear(backend, r, target.vocab_size)  # (V, r)
        self.accept_rate = Linear(backend, dm + r, 1)  # (1, Dm + r)
        temps = config.confidence_temperature
        temps = temps * config.block_size if len(temps) == 1 else temps
        self.temperature = [float(x) for x in temps]  # (B,) T_s

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def blocks(self) -> list[DecoderLayer]:
        return [cast("DecoderLayer", layer) for layer in self.layers]

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    # ------------------------------------------------------------------ KV injection

    def inject(
        self,
        trunks: torch.Tensor,
        batch: ForwardBatch,
        caches: list[PagedKVCache],
    ) -> None:
        """trunks (T, n, Dm): the target's trunks at target_layer_ids for the step's tokens ->
        each draft layer's cache row at batch.slot_mapping (slot -1: padding, no row)."""
        t = trunks.shape[0]
        if t == 0:  # an idle forward (expert parallelism: a rank without requests): no rows
            return
        u = self.project_norm(self.projection(trunks.reshape(t, -1)))  # (T, n Dm) -> (T, Dm)
        for layer, cache in zip(self.blocks, caches):
            attn = layer.self_attn
            kv = attn.kv_a_proj_with_mqa(u)  # (T, C + R')
            self.backend.kv_cache.write_mla_kv(
                cache, kv, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps, batch.positions, self.cos_sin,
                attn.interleaved, batch.slot_mapping,
            )  # fmt: skip

    # ------------------------------------------------------------------ the draft step

    def block_batch(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        tables: torch.Tensor,
        limit: torch.Tensor,
        block_size: int,
        max_seq_len: int,
    ) -> ForwardBatch:
        """Device only (graph-safe): the block step's inputs. tokens (R,) the emitted tokens at
        positions start (R,); tables (R, MB) the requests' block tables; limit (R,) the positions
        below which a row may be written (their blocks). Slot s sits at start + s (clamped below
        limit; a slot at or past it writes no row); each slot is a one-row query whose KV length
        is min(start + B, limit): it sees the injected context and every slot of its block.
        max_seq_len: a host upper bound of those lengths (AttentionMetadata's host copies)."""
        r, b, dev = tokens.shape[0], self.block_size, tokens.device
        pos = start[:, None] + torch.arange(b, device=dev)  # (R, B)
        write = pos < limit[:, None]
        pos = torch.minimum(pos, (limit - 1).clamp(min=0)[:, None])
        table = tables.long()
        col = (pos // block_size).clamp(max=table.shape[1] - 1)
        slots = torch.where(write, table.gather(1, col) * block_size + pos % block_size, -1)  # (R, B)
        noise = torch.full((r, b - 1), self.config.noise_token_id, dtype=tokens.dtype, device=dev)
        ids = torch.cat([tokens[:, None], noise], dim=1)  # (R, B)
        # (R,); at least 1: a padding request of a graph step (limit 0) reads one row, discarded
        kv_len = torch.minimum(start + b, limit).clamp(min=1).to(torch.int32)
        n = r * b
        attn = AttentionMetadata(
            block_tables=tables.repeat_interleave(b, dim=0), seq_lens=kv_len.repeat_interleave(b),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens_host=(max_seq_len,) * n, query_lens_host=(1,) * n, max_query_len=1,
            max_seq_len=max_seq_len,
        )  # fmt: skip
        rows = torch.arange(n, device=dev)
        return ForwardBatch(
            input_ids=ids.reshape(-1), positions=pos.reshape(-1), slot_mapping=slots.reshape(-1), attn=attn,
            logits_indices=rows,
        )  # fmt: skip

    def block_states(
        self, fb: ForwardBatch, embed: torch.Tensor, caches: list[PagedKVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The L blocks over the block step fb -> (h pre-norm (R B, Dm), norm(h) (R B, Dm))."""
        x = nn.functional.embedding(fb.input_ids, embed)  # (R B, Dm)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, caches):
            x, residual = layer(x, residual, fb, cache, self.cos_sin)
        assert residual is not None
        normed, h = self.norm.add(x, residual)
        return h, normed

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev (R,) token ids -> (markov_w1[prev] (R, r), markov_w2 of it (R, V) float32)."""
        low = nn.functional.embedding(prev, self.markov_w1)
        return low, self.markov_w2(low).float()

    def draft(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        tables: torch.Tensor,
        limit: torch.Tensor,
        caches: list[PagedKVCache],
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        k: int,
        max_seq_len: int,
        logits_out: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device only (graph-safe): k greedy drafts per request and their confidences (prefix
        products of c_s, non-increasing). Arguments as block_batch's; caches: one per draft
        layer (block size from their spec). -> (drafts (R, k) int64, confidences (R, k) float32).
        logits_out: when given, each slot's final logits (R, V) float32 are appended (tests)."""
        if not 1 <= k <= self.block_size:
            raise ValueError(f"the DFlash drafter proposes 1..{self.block_size} tokens per block, not {k}")
        r, b = tokens.shape[0], self.block_size
        fb = self.block_batch(tokens, start, tables, limit, caches[0].spec.block_size, max_seq_len)
        h, normed = self.block_states(fb, embed, caches)
        base = self.backend.gemm.linear(normed, lm_head).float().view(r, b, -1)  # (R, B, V)
        h = h.view(r, b, -1)
        prev, drafts, confs = tokens, [], []
        conf = torch.ones(r, dtype=torch.float32, device=tokens.device)
        for s in range(k):  # the sequential part: a rank-r lookup per slot
            low, bias = self.markov(prev)
            logits = base[:, s] + bias  # (R, V)
            feats = torch.cat([h[:, s], low.to(h.dtype)], dim=-1)  # (R, Dm + r)
            c = torch.sigmoid(self.accept_rate(feats).float()[:, 0] / self.temperature[s])
            conf = conf * c
            prev = logits.argmax(dim=-1)
            drafts.append(prev)
            confs.append(conf)
            if logits_out is not None:
                logits_out.append(logits)
        return torch.stack(drafts, dim=1), torch.stack(confs, dim=1)

    # ------------------------------------------------------------------ loading

    def load(self, reader: WeightSource, dtype: torch.dtype) -> None:
        """DeepSeek's names (module docstring): mtp.0.projection, ..., mtp.{L-1}.accept_rate."""
        last = f"mtp.{self.num_layers - 1}"
        self.projection.load(reader, "mtp.0.projection", dtype)
        self.project_norm.load(reader, "mtp.0.project_norm.weight", dtype)
        for i, layer in enumerate(self.blocks):
            layer.load(reader, f"mtp.{i}", dtype)
        self.norm.load(reader, f"{last}.norm.weight", dtype)
        shape = (self.vocab_size, self.config.markov_rank)
        self.markov_w1 = reader.get(f"{last}.markov_w1.weight", shape, dtype)
        self.markov_w2.load(reader, f"{last}.markov_w2", dtype)
        self.accept_rate.load(reader, f"{last}.accept_rate.proj", dtype)


def has_dflash(root: str | Path) -> bool:
    return (Path(root) / DIRECTORY / CONFIG_FILE).is_file()


def read_config(root: str | Path) -> DFlashConfig:
    path = Path(root) / DIRECTORY / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path} cannot be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return DFlashConfig.from_dict(data, str(path))


def save_dflash(root: str | Path, config: DFlashConfig, tensors: dict[str, torch.Tensor]) -> Path:
    """Write DIR/dflash/config.json and DIR/dflash/model.safetensors -> that directory."""
    from safetensors.torch import save_file

    d = Path(root) / DIRECTORY
    d.mkdir(parents=True, exist_ok=True)
    (d / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    save_file(
        {n: t.detach().cpu().contiguous() for n, t in sorted(tensors.items())}, str(d / "model.safetensors")
    )
    return d


def check_block_kind(target: ModelConfig) -> None:
    """The drafter's blocks are the target's kind: DeepSeek-V2 / V3 here."""
    if target.v4 is not None or target.v41 is not None:
        raise ValueError(
            f"the DFlash drafter in {DIRECTORY}/ is built of DeepSeek-V2/V3 blocks; {target.model_type} "
            "checkpoints are not supported by it yet"
        )
