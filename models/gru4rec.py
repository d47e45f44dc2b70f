"""A second FM family (#41), recurrent in the GRU4Rec manner, sharing no model code with ``models.fm`` beyond the
input embeddings: the user's history (item with side features + signal + time gap, oldest first, left-padded) runs
through a GRU; its last state and the mean of its states over the real events summarise the user; a trunk turns
[target, last state, mean state, user, target * last state, counters] (and, with ``target_user``, target * user)
into the interaction embedding h(u, i), read by a label head and a rating head.

It keeps the FM protocol (``models.protocol``): ``forward(b, rows)`` runs the GRU once per distinct history;
``user_embedding`` is the normalised [mean state, user vector]; ``item_embedding`` the item vectors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from models.common import SideEmbedding, counter_features, fm_loss
from models.protocol import WidthsFromConfig
from solaris_jobs.core.contract import N_GAP_BUCKETS, N_SIGNALS


@dataclass
class GRUConfig:
    user_side: dict = field(default_factory=lambda: {"n_ids": 1})
    item_side: dict = field(default_factory=lambda: {"n_ids": 1})
    history_len: int = 50
    d_model: int = 64
    n_layers: int = 1
    d_interaction: int = 128
    dropout: float = 0.1
    rating_weight: float = 0.5
    target_user: bool = False


class GRU4RecFM(WidthsFromConfig, nn.Module):
    mixed_precision: str | None = None          # float32 until a GPU run shows otherwise (benchmarks/gpu_check.py)

    def __init__(self, cfg: GRUConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.items = SideEmbedding(cfg.item_side, d)
        self.users = SideEmbedding(cfg.user_side, d)
        self.signal = nn.Embedding(N_SIGNALS, d, padding_idx=0)
        self.gap = nn.Embedding(N_GAP_BUCKETS, d, padding_idx=0)
        self.gru = nn.GRU(d, d, cfg.n_layers, batch_first=True, dropout=cfg.dropout if cfg.n_layers > 1 else 0.0)
        self.trunk = nn.Sequential(
            nn.Linear((6 if cfg.target_user else 5) * d + 4, 2 * cfg.d_interaction), nn.GELU(), nn.Dropout(cfg.dropout),
            nn.Linear(2 * cfg.d_interaction, cfg.d_interaction), nn.GELU())
        self.label_head = nn.Linear(cfg.d_interaction, 1)
        self.rating_head = nn.Linear(cfg.d_interaction, 1)

    def summarise(self, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(last state, mean state over the real events), each (B, d), of the batch's histories (B, L), which are
        left-padded, oldest first. The GRU runs over each history's real events only (packed), so the padding
        before them changes nothing; an empty history runs one zero step (the "no history" state)."""
        items = b["hist_item"]
        B, L = items.shape
        real = items > 0
        lengths = real.sum(1)
        x = (self.items(items) + self.signal(b["hist_signal"]) + self.gap(b["hist_gap"])) * real.unsqueeze(-1)
        # Left-aligned: row i's events at 0 .. len-1 (the oldest first), zeros after.
        idx = (torch.arange(L, device=items.device) + (L - lengths).unsqueeze(1)) % L
        x = x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.clamp(min=1).cpu(), batch_first=True,
                                                   enforce_sorted=False)
        out, last = self.gru(packed)
        states, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=L)   # zeros past the end
        return last[-1], states.sum(1) / lengths.clamp(min=1).unsqueeze(-1).to(states.dtype)

    def forward(self, b: dict, rows: torch.Tensor | None = None) -> dict:
        """``logit`` (B,), ``rating`` (B,), ``h`` (B, d_interaction); ``rows`` as ``FoundationModel.forward``."""
        last, mean = self.summarise(b)
        if rows is not None:
            last, mean = last[rows], mean[rows]
        target, user = self.items(b["item"]), self.users(b["user"])
        parts = [target, last, mean, user, target * last, counter_features(b)]
        if self.cfg.target_user:
            parts.insert(5, target * user)
        h = self.trunk(torch.cat(parts, -1))
        return {"logit": self.label_head(h).squeeze(-1), "rating": 1.0 + 4.0 * torch.sigmoid(
            self.rating_head(h).squeeze(-1)), "h": h}

    def user_embedding(self, b: dict) -> torch.Tensor:
        """(B, 2 * d_model): L2-normalised [mean state, user vector], no target item."""
        _, mean = self.summarise(b)
        return F.normalize(torch.cat([mean, self.users(b["user"])], -1), dim=-1)

    def loss(self, out: dict, b: dict) -> torch.Tensor:
        return fm_loss(out, b, self.cfg.rating_weight)
