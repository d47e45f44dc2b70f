"""The vertical model (VM): the small, fast ranker that SOLARIS feeds.

Id and side-feature embeddings of user and item, the user's and item's counters before the event (log counts,
smoothed positive rates), with ``recency`` the log-derived recency inputs every ranker computes from its own
impression log (minutes since the pair / the item was last shown and since the user's previous event, the pair's
shows in the last 1 / 6 / 24 h: ``solaris_jobs.core.model_inputs.recency``), an MLP to one logit. Optionally an FM
slot: a D-dim embedding from the feature store plus a one-hot tier indicator (``core.contract.TIERS``: pair,
item-aware, user aggregate, user state, neighbour, none) and, with ``fm_age``, the age of the served
embedding (``log1p(hours) / 4``; 0 for tier none); rows with no embedding get zeros and tier none. With
``tier_slots`` each tier's embedding has its own input slot (zeros in the others), so that a pair code and a user
aggregate of the same width are not read by the same weights; with ``fm_count`` the number of FM embeddings behind
the served one (1 for a pair, the pairs an aggregate averages, the neighbours) is an input too (``log1p(n) / 4``). Knowledge
distillation (the baseline SOLARIS is compared against) trains the same model on a mix of the label and the FM's
soft label at temperature ``kd_temperature``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from models.common import N_RECENCY_FEATURES, SideEmbedding, counter_features, recency_features
from solaris_jobs.core.contract import TIER_NONE, TIERS  # noqa: F401 (re-exported)

assert TIER_NONE == len(TIERS) - 1        # the embedding tiers first: their slots are one_hot[:, :TIER_NONE]


@dataclass
class VMConfig:
    user_side: dict = field(default_factory=lambda: {"n_ids": 1})
    item_side: dict = field(default_factory=lambda: {"n_ids": 1})
    d_emb: int = 16
    hidden: tuple = (128, 64)
    dropout: float = 0.1
    recency: bool = True             # the log-derived recency inputs (#40: every ranker, baseline included)
    fm_dim: int = 0                  # 0: no FM slot; else the width of the FM embedding input
    fm_age: bool = False             # with the FM slot: the served embedding's age as an input too
    tier_slots: bool = False         # with the FM slot: one input slot per tier (else one slot shared by all tiers)
    fm_count: bool = False           # with the FM slot: the number of embeddings behind the served one as an input
    kd_weight: float = 0.0           # > 0: knowledge distillation, the FM soft label's weight per soft-labelled row
    kd_temperature: float = 1.0      # soft labels sigmoid(fm_logit / T) against sigmoid(logit / T), scaled by T^2


class VerticalModel(nn.Module):
    def __init__(self, cfg: VMConfig):
        super().__init__()
        self.cfg = cfg
        self.users = SideEmbedding(cfg.user_side, cfg.d_emb)
        self.items = SideEmbedding(cfg.item_side, cfg.d_emb)
        width = 3 * cfg.d_emb + 4 + N_RECENCY_FEATURES * int(cfg.recency)
        slots = len(TIERS) - 1 if cfg.tier_slots else 1
        width += cfg.fm_dim * slots + len(TIERS) + int(cfg.fm_age) + int(cfg.fm_count) if cfg.fm_dim else 0
        layers = []
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(cfg.dropout)]
            width = h
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, b: dict) -> dict:
        """b: batch tensors; with an FM slot also ``fm_emb`` (B, fm_dim), ``tier`` (B,) int64, with ``fm_age``
        ``fm_age_h`` (B,) hours and with ``fm_count`` ``fm_count`` (B,) (NaN or anything for tier none: ignored
        there).

        Returns:
            ``logit`` (B,).
        """
        u, i = self.users(b["user"]), self.items(b["item"])                 # (B, d_emb) each
        parts = [u, i, u * i, counter_features(b)]
        if self.cfg.recency:
            parts.append(recency_features(b))
        if self.cfg.fm_dim:
            B = u.shape[0]
            emb = b.get("fm_emb")
            tier = b.get("tier")
            if emb is None:
                emb = u.new_zeros(B, self.cfg.fm_dim)
                tier = torch.full((B,), TIER_NONE, dtype=torch.long, device=u.device)
            one_hot = F.one_hot(tier, len(TIERS)).float()
            if self.cfg.tier_slots:
                emb = (emb.unsqueeze(1) * one_hot[:, :TIER_NONE, None]).flatten(1)   # (B, tiers x fm_dim)
            parts += [emb, one_hot]
            served = (tier != TIER_NONE).float()
            for on, key in ((self.cfg.fm_age, "fm_age_h"), (self.cfg.fm_count, "fm_count")):
                if on:
                    x = b.get(key)
                    x = u.new_zeros(B) if x is None else torch.nan_to_num(x.float(), nan=0.0).clamp(min=0.0)
                    parts.append((torch.log1p(x) / 4.0 * served).unsqueeze(-1))
        return {"logit": self.mlp(torch.cat(parts, -1)).squeeze(-1)}

    def loss(self, out: dict, b: dict) -> torch.Tensor:
        """BCE on the label; with ``kd_weight`` a > 0, knowledge distillation per soft-labelled row: a row with the
        FM's soft label (``fm_logit`` at temperature ``kd_temperature``, or ``fm_prob`` at T = 1; finite) counts
        ``(1 - a) x BCE(label) + a x T^2 x BCE(soft label)``, a row without one (NaN) its label's BCE; the mean over
        the rows. So a is the soft label's share of each row that has one, whatever share of the batch those are
        (mixing the two means per batch would weight a soft-labelled row by a over that share)."""
        known = b["label"] >= 0
        if self.cfg.kd_weight <= 0:
            return F.binary_cross_entropy_with_logits(out["logit"][known], b["label"][known])
        a, T = self.cfg.kd_weight, self.cfg.kd_temperature
        soft = torch.sigmoid(b["fm_logit"] / T) if "fm_logit" in b else b["fm_prob"]
        has = torch.isfinite(soft)
        lab = F.binary_cross_entropy_with_logits(out["logit"], b["label"].clamp(0, 1), reduction="none")
        kd = F.binary_cross_entropy_with_logits(out["logit"] / T, torch.where(has, soft, 0.0), reduction="none")
        per_row = (torch.where(known, lab, 0.0) * torch.where(has, 1 - a, 1.0)
                   + torch.where(has, a * T * T * kd, 0.0))
        return per_row[known | has].mean()
