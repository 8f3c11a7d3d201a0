"""DeepSeek-V4.1's Engram: hashed n-gram embeddings gated into the residual streams of a few
encoder layers (facts: /work/shared/reference/deepseek-v4.1.md, section 1.9).

Per token at position p, the n-gram ids are the compressed ids of tokens p, p-1, ..., p-G+1
(G = engram_max_ngram_size; the pad id before the start of the request). The compressed
vocabulary merges tokens whose text is equal once normalised (NFKC, NFD, accents stripped,
lowercase, whitespace runs collapsed); it is built from the checkpoint's tokenizer.json when
engram_compressed_vocab_size is set, else it is the identity (DeepSeek's loader does the same).
An Engram layer has C = (G - 1) * Hg table heads (n-gram sizes 2..G, Hg heads each), head c a
table of its own prime size (primes above engram_vocab_size, unique over every layer and head in
config order); heads are stacked in one table (R, Dh) of the layer. Per layer, in the order the
block runs them:
  e = rows of the token's C heads, side by side   (T, C * Dh)    small.engram_lookup
  [k_1 .. k_N | v] = wkv e                        (T, N + 1, Dm) gemm (Linear)
  R_n += g_n v, g_n = gate(R_n, k_n)              (T, N, Dm)     small.engram_gate
on the streams after the previous sublayer's post mix, before the attention's pre mix.

The tables are kept as stored: float rows in the model's dtype, or DeepSeek's FP8 rows (e4m3
with one UE8M0 scale per 32 values of a row, `embed.scale`) that the lookup dequantises into
the streams' dtype, exactly (a quarter of the checkpoint stays one byte a value in memory).
They are weights on the device (counted in its memory like any weight), or, with
the ENGRAM_HOST_TABLES switch (deepinfer.envs) on a backend whose lookup reads host memory
(Capabilities.reads_host_tables), in pinned host memory: each step's lookup gathers the rows it
needs from there on the device (cuda: the kernel reads them through their mapped address), with
no host read in the forward, so decode graphs keep them. DeepSeek's engine keeps them in host
memory too and fetches rows through DeepEP's EngramBuffer. Loading still passes each table
through device memory once (the checkpoint reader lands tensors on the device). With the
ENGRAM_PREFETCH switch the model starts every Engram layer's lookup at the start of its forward
(small.engram_prefetch: the ids depend on the input tokens only; the cuda backend runs them on a
side stream, so the reads overlap the layers before each Engram layer) and each layer waits for
its own rows (small.engram_wait), as DeepSeek's engine does.

Symbols: T tokens, G max n-gram size, Hg heads per n-gram size, C heads of a layer, Dh a row's
width, N hc_mult streams, Dm hidden.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from deepinfer.backend.ops import Backend
from deepinfer.backend.types import PendingRows
from deepinfer.models.config import ModelConfig
from deepinfer.models.config_v41 import EngramConfig
from deepinfer.models.layers import Linear
from deepinfer.models.weights import WeightSource


def next_prime(n: int) -> int:
    """The smallest prime above n (trial division by 6k +- 1: table sizes are near 5e7, so at
    most about 2,400 divisions a candidate)."""
    candidate = max(n + 1, 2)
    while True:
        if candidate in (2, 3) or (candidate % 2 and candidate % 3 and _no_factor_from_5(candidate)):
            return candidate
        candidate += 1


def _no_factor_from_5(n: int) -> bool:
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


def table_sizes(engram: EngramConfig) -> dict[int, list[int]]:
    """Layer -> its C head sizes (n-gram size major): for each n-gram size the next Hg primes
    above engram_vocab_size - 1, skipping primes any earlier layer or head took."""
    taken: set[int] = set()
    out: dict[int, list[int]] = {}
    for layer in engram.layer_ids:
        sizes: list[int] = []
        for _ in range(2, engram.max_ngram_size + 1):
            prime = engram.vocab_size - 1
            for _ in range(engram.n_heads):
                prime = next_prime(prime)
                while prime in taken:
                    prime = next_prime(prime)
                taken.add(prime)
                sizes.append(prime)
        out[layer] = sizes
    return out


def hash_multipliers(layer: int, max_ngram_size: int, hash_vocab: int) -> torch.Tensor:
    """(G,) odd int64 multipliers of layer `layer`: NumPy's default generator seeded 10007 * layer,
    integers below (int64 max // hash_vocab) // 2, times 2 plus 1 (DeepSeek's; a product with
    an id below hash_vocab stays within int64)."""
    bound = max(1, (np.iinfo(np.int64).max // hash_vocab) // 2)
    rng = np.random.default_rng(10007 * layer)
    draws = rng.integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
    return torch.from_numpy(draws * 2 + 1)


def compressed_vocabulary(tokenizer_file: Path) -> list[int]:
    """Raw token id -> compressed id over the tokenizer's vocabulary: each token decoded alone
    (special tokens kept) and normalised; equal texts share the id of the first. A token whose
    text is not valid UTF-8 on its own keeps its vocabulary spelling as its key."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_file))
    space = "\ue000"  # a token that is one space stays one space
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), space),
            normalizers.Strip(),
            normalizers.Replace(space, " "),
        ]
    )
    ids: dict[str, int] = {}
    out = []
    for token in range(tok.get_vocab_size()):
        text = tok.decode([token], skip_special_tokens=False)
        key = tok.id_to_token(token) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(ids.setdefault(str(key), len(ids)))
    return out


def vocabulary_table(engram: EngramConfig, vocab_size: int, root: Path | None) -> tuple[torch.Tensor, int]:
    """(V,) int64 raw -> compressed ids and the vocabulary size the hash multipliers are bounded
    by: the compressed vocabulary of `root`/tokenizer.json when engram_compressed_vocab_size is
    set (its size must match; ids past the tokenizer's vocabulary map to the compressed pad), else
    the identity over vocab_size. ValueError naming what is missing or inconsistent."""
    size = engram.compressed_vocab_size
    if not size:
        return torch.arange(vocab_size, dtype=torch.int64), vocab_size
    file = None if root is None else root / "tokenizer.json"
    if file is None or not file.is_file():
        where = "" if root is None else f" in {root}"
        raise ValueError(
            f"text_config.engram_compressed_vocab_size is {size}: Engram's compressed vocabulary is "
            f"built from the checkpoint's tokenizer.json, which is missing{where}"
        )
    try:
        table = compressed_vocabulary(file)
    except Exception as exc:  # tokenizers raises its own exception types
        raise ValueError(f"{file}: cannot build Engram's compressed vocabulary: {exc}") from exc
    found = max(table, default=-1) + 1
    if found != size:
        raise ValueError(
            f"{file} normalises to {found} distinct tokens, but text_config.engram_compressed_vocab_size "
            f"is {size}: the hash tables were built for another tokenizer"
        )
    if len(table) > vocab_size:
        raise ValueError(f"{file} has {len(table)} tokens, more than vocab_size {vocab_size}")
    pad = table[engram.pad_token_id] if engram.pad_token_id < len(table) else engram.pad_token_id
    full = torch.full((vocab_size,), pad, dtype=torch.int64)
    full[: len(table)] = torch.tensor(table, dtype=torch.int64)
    return full, size


def ngram_ids(
    input_ids: torch.Tensor, history: torch.Tensor, positions: torch.Tensor, vocab: torch.Tensor, pad: int
) -> torch.Tensor:
    """(T, G) compressed ids of tokens p, p-1, ..., p-G+1 of each token: input_ids (T,) and
    history (T, G-1) raw ids (tokens p-1, ..., p-G+1; any valid id before the start), positions
    (T,); `pad` where p - r < 0, and for image ids (>= the vocabulary: DeepSeek's sentinel for
    image tokens; which value it is DeepSeek's code does not say, pad here). Device only."""
    raw = torch.cat([input_ids[:, None], history], dim=1)
    back = torch.arange(raw.shape[1], device=raw.device)
    text = raw < vocab.shape[0]  # ids past the vocabulary are images': they read as pad
    ids = torch.where(text, vocab[raw.clamp(max=vocab.shape[0] - 1)], pad)
    return torch.where(positions[:, None] >= back, ids, pad)


class Engram(nn.Module):
    """One Engram layer: its stacked table, the projection to N keys and a value, the fused gate
    weight (q_weight * k_weight). forward(streams, ngram_ids) -> the gated streams."""

    sizes: torch.Tensor  # (C,) int64 head sizes
    multipliers: torch.Tensor  # (G,) int64
    table: torch.Tensor  # (R, Dh): floats, or FP8 rows (e4m3)
    scales: torch.Tensor | None  # (R, Dh / 32) UE8M0 bytes of FP8 rows
    gate_weight: torch.Tensor  # (N, Dm) float32

    def __init__(
        self, backend: Backend, config: ModelConfig, engram: EngramConfig, layer: int, sizes: list[int],
        hash_vocab: int, hc_mult: int, host_table: bool = False,
    ) -> None:  # fmt: skip
        """host_table: the table in pinned host memory (the backend reads host tables)."""
        super().__init__()
        self.backend, self.layer, self.hc_mult = backend, layer, hc_mult
        self.dim, self.eps = config.hidden_size, config.rms_norm_eps
        self.rows, self.head_dim, self.host_table = sum(sizes), engram.head_dim, host_table
        device = backend.device.device()
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.int64, device=device))
        multipliers = hash_multipliers(layer, engram.max_ngram_size, hash_vocab).to(device)
        self.register_buffer("multipliers", multipliers)
        self.register_buffer("table", torch.empty(0, device="meta"))  # (R, Dh)
        self.register_buffer("scales", None)  # (R, Dh / 32) uint8, FP8 rows only
        self.register_buffer("gate_weight", torch.empty(0, device="meta"))  # (N, Dm) float32
        self.wkv = Linear(backend, len(sizes) * engram.head_dim, (hc_mult + 1) * self.dim)

    def prefetch(self, ngram_ids: torch.Tensor, dtype: torch.dtype) -> PendingRows:
        """Start the lookup of this layer's rows (small.engram_prefetch), FP8 rows into `dtype`."""
        return self.backend.small.engram_prefetch(
            ngram_ids, self.multipliers, self.sizes, self.table, scales=self.scales, dtype=dtype
        )

    def forward(
        self,
        streams: torch.Tensor,
        ngram_ids: torch.Tensor,
        image_mask: torch.Tensor | None = None,
        rows: PendingRows | None = None,
    ) -> torch.Tensor:
        """image_mask (T,) bool: image tokens are masked out (their streams pass unchanged).
        rows: this layer's prefetch of the step (waited for here); None: the lookup here."""
        small = self.backend.small
        if rows is not None:
            e = small.engram_wait(rows)
        else:
            e = small.engram_lookup(
                ngram_ids, self.multipliers, self.sizes, self.table, scales=self.scales, dtype=streams.dtype
            )  # (T, C*Dh), FP8 rows dequantised
        kv = self.wkv(e.to(streams.dtype)).view(-1, self.hc_mult + 1, self.dim)
        gated = small.engram_gate(streams, kv, self.gate_weight, self.eps)
        return gated if image_mask is None else torch.where(image_mask[:, None, None], streams, gated)

    def load(self, reader: WeightSource, prefix: str, dtype: torch.dtype) -> None:
        shape = (self.hc_mult, self.dim)
        q = reader.get(f"{prefix}.q_weight", shape, torch.float32)
        k = reader.get(f"{prefix}.k_weight", shape, torch.float32)
        self.gate_weight = q * k
        shape = (self.rows, self.head_dim)
        stored = reader.fp8_rows(f"{prefix}.embed", shape)  # FP8 rows kept as stored
        table, scales = (
            (reader.get(f"{prefix}.embed.weight", shape, dtype), None) if stored is None else stored
        )
        if self.host_table:
            self.table = self._pinned(table)
            self.scales = None if scales is None else self._pinned(scales)
        else:
            self.table, self.scales = table, scales
        self.wkv.load(reader, f"{prefix}.wkv", dtype)

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        host = self.backend.device.pinned_empty(tuple(t.shape), t.dtype)
        return host.copy_(t)
