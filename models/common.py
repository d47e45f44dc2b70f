"""Pieces shared by the models: side-feature embeddings and batch conversion."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from solaris_jobs.core.contract import RECENCY_INPUTS, RECENCY_MINUTES


class SideEmbedding(nn.Module):
    """Embeds an id together with its side features: id embedding + sum of categorical embeddings + mean of
    multi-valued embeddings. The lookup tables are buffers, so a checkpoint carries them.

    Args:
        side: ``{"n_ids": int, "categorical": {col: vocab}, "multi": {col: [vocab, width]}}``, and ``"sparse":
            true`` for sparse or hashed int64 ids: a sorted ``vocab`` buffer of the n_ids - 1 known ids maps an id
            to its row (its position + 1; 0 for an unknown id) instead of the id being the row.
        dim: output width.
    """

    def __init__(self, side: dict, dim: int):
        super().__init__()
        self.n_ids = int(side["n_ids"])
        self.cat_cols = list(side.get("categorical", {}))
        self.multi_cols = list(side.get("multi", {}))
        self.ids = nn.Embedding(self.n_ids, dim, padding_idx=0)
        self.cats = nn.ModuleList(nn.Embedding(int(v), dim) for v in side.get("categorical", {}).values())
        self.multis = nn.ModuleList(nn.Embedding(int(v[0]), dim, padding_idx=0)
                                    for v in side.get("multi", {}).values())
        for emb in [self.ids, *self.cats, *self.multis]:
            # Small init: ids never seen in training (new users at test time) stay near zero, not random noise.
            nn.init.normal_(emb.weight, std=0.01)
        self.sparse = bool(side.get("sparse", False))
        if self.sparse:
            self.register_buffer("vocab", torch.zeros(self.n_ids - 1, dtype=torch.long))
        self.register_buffer("cat_table", torch.zeros(self.n_ids, len(self.cat_cols), dtype=torch.long))
        for c, v in side.get("multi", {}).items():
            self.register_buffer(f"multi_{c}", torch.zeros(self.n_ids, int(v[1]), dtype=torch.long))

    def set_tables(self, cat: np.ndarray, multi: dict, vocab: np.ndarray | None = None) -> None:
        """Loads the side lookup tables built by ``solaris_jobs.core.model_inputs.side_tables`` (and, for sparse
        ids, the sorted id vocabulary)."""
        if self.sparse:
            self.vocab.copy_(torch.as_tensor(vocab, dtype=torch.long))
        self.cat_table.copy_(torch.as_tensor(cat, dtype=torch.long))
        for c in self.multi_cols:
            getattr(self, f"multi_{c}").copy_(torch.as_tensor(multi[c], dtype=torch.long))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (...,) int64, any id >= n_ids (or, sparse, not in the vocabulary) is unknown (row 0). Returns
        (..., dim)."""
        if self.sparse and len(self.vocab):
            pos = torch.searchsorted(self.vocab, ids).clamp(max=len(self.vocab) - 1)
            ids = torch.where(self.vocab[pos] == ids, pos + 1, torch.zeros_like(ids))
        ids = torch.where((ids >= 0) & (ids < self.n_ids), ids, torch.zeros_like(ids))
        out = self.ids(ids)
        if self.cat_cols:
            codes = self.cat_table[ids]                                     # (..., C)
            for j, emb in enumerate(self.cats):
                out = out + emb(codes[..., j].clamp(0, emb.num_embeddings - 1))
        for c, emb in zip(self.multi_cols, self.multis):
            vals = getattr(self, f"multi_{c}")[ids].clamp(0, emb.num_embeddings - 1)   # (..., W)
            mask = (vals > 0).unsqueeze(-1).float()
            out = out + (emb(vals) * mask).sum(-2) / mask.sum(-2).clamp(min=1.0)
        return out


def batch_to_tensors(batch: dict, device: torch.device | str = "cpu") -> dict:
    """Numpy batch from ``Examples.batch`` to tensors on ``device`` (ints to int64, floats to float32)."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        t = torch.from_numpy(v.astype(np.int64) if v.dtype.kind in "iub" else v.astype(np.float32))
        out[k] = t.to(device, non_blocking=True)
    return out


def counter_features(b: dict) -> torch.Tensor:
    """(B, 4): log counts and smoothed positive rates of the user and the item before the event."""
    prior = 0.5
    u_rate = (b["user_pos"] + prior) / (b["user_known"] + 1.0)
    i_rate = (b["item_pos"] + prior) / (b["item_known"] + 1.0)
    return torch.stack([torch.log1p(b["user_cnt"]) / 5.0, u_rate, torch.log1p(b["item_cnt"]) / 5.0, i_rate], -1)


N_RECENCY_FEATURES = len(RECENCY_INPUTS) + len(RECENCY_MINUTES)


def recency_features(b: dict) -> torch.Tensor:
    """(B, 9): the log-derived recency inputs (``RECENCY_INPUTS``): each "minutes since" as ``log1p(minutes) / 10``
    with a never-seen flag (NaN in, 0 and flag 1 out), each windowed count of the pair's shows as ``log1p / 3``."""
    cols = []
    for k in RECENCY_INPUTS:
        v = b[k].float()
        if k in RECENCY_MINUTES:
            never = torch.isnan(v)
            cols += [torch.log1p(torch.nan_to_num(v, nan=0.0).clamp(min=0.0)) / 10.0, never.float()]
        else:
            cols.append(torch.log1p(v.clamp(min=0.0)) / 3.0)
    return torch.stack(cols, -1)


def fm_loss(out: dict, b: dict, rating_weight: float) -> torch.Tensor:
    """An FM's training loss: BCE on known labels plus ``rating_weight`` x MSE on known ratings (scaled to 0-1)."""
    import torch.nn.functional as F
    known = b["label"] >= 0
    loss = F.binary_cross_entropy_with_logits(out["logit"][known], b["label"][known])
    rated = b["rating"] > 0
    if rated.any():
        loss = loss + rating_weight * F.mse_loss(out["rating"][rated] / 5, b["rating"][rated] / 5)
    return loss
