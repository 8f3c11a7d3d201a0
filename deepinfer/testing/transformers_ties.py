"""transformers' DeepSeek-V4 indexer with deepinfer's tie rule, for parity checks and benchmarks.

deepinfer's contract breaks exact ties of the indexer's top-k towards the lower entry id.
transformers' DeepseekV4Indexer uses torch.topk, whose order among tied scores (an indexer score
is exactly 0 whenever every head's q.k <= 0, common with few index heads) depends on the row's
length, so its generate and a one-pass forward disagree with each other. Inside
`stable_indexer_topk()` its top-k takes ties in index order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _stable_topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
    """torch.topk with exact ties in index order (lower index first), through a stable sort."""
    order = x.sort(dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


@contextmanager
def stable_indexer_topk() -> Iterator[None]:
    """Within the block, transformers' DeepseekV4Indexer picks its top-k with exact ties going to
    the lower entry id (torch.Tensor.topk is swapped only while its forward runs)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    real = hf.DeepseekV4Indexer.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = torch.Tensor.topk
        torch.Tensor.topk = _stable_topk  # type: ignore[method-assign,assignment]
        try:
            return real(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = saved  # type: ignore[method-assign]

    hf.DeepseekV4Indexer.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        hf.DeepseekV4Indexer.forward = real  # type: ignore[method-assign]
