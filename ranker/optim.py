"""Row-sparse Adam for embedding tables.

Each step updates only the rows whose ids the batch looked up ("lazy" Adam, the
semantics of ``torch.optim.SparseAdam``: untouched rows keep their moments), with one
``unique`` + ``index_add`` to merge duplicate ids and ``index_select`` / ``index_copy``
for the moments. ``torch.optim.SparseAdam`` measured ≈20 ms per step here on three
tables of a 50k-item catalog (its coalesce and ``sparse_mask`` dominate); this is a
few ms, and training is mostly optimizer steps on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class RowSparseAdam(torch.optim.Optimizer):
    """Adam over the touched rows of 2-D parameters with sparse gradients
    (``embedding_bag(sparse=True)`` / ``embedding(sparse=True)``). Dense gradients are
    accepted too (every row is then "touched")."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                if grad.is_sparse:
                    raw = grad._indices()[0]
                    rows, inverse = torch.unique(raw, return_inverse=True)
                    g = torch.zeros((rows.shape[0], p.shape[1]), dtype=p.dtype, device=p.device).index_add_(0, inverse, grad._values())
                else:
                    rows = torch.arange(p.shape[0], device=p.device)
                    g = grad
                m = state["m"].index_select(0, rows).mul_(b1).add_(g, alpha=1 - b1)
                v = state["v"].index_select(0, rows).mul_(b2).addcmul_(g, g, value=1 - b2)
                state["m"].index_copy_(0, rows, m)
                state["v"].index_copy_(0, rows, v)
                step = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt_().add_(eps))
                p.index_add_(0, rows, step, alpha=-lr)


def linear_decay(optimizers: Iterable[torch.optim.Optimizer], steps: int, final: float) -> list[torch.optim.lr_scheduler.LambdaLR]:
    """One scheduler per optimizer that scales its rate linearly from 1 to ``final`` over
    ``steps`` steps (and keeps ``final`` after); call ``step()`` after each optimizer step.

    One pass over the log is all these models get (a second one memorises the id
    tables), so the late, small steps are what averages out the batch noise: decaying
    to 0 measured +0.002 DLRM AUC on a 50k-item catalog.
    """
    steps = max(1, steps)
    return [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - (1.0 - final) * min(s, steps) / steps) for opt in optimizers]
