"""The foundation model: a sequence model over the user's recent history with attention to the target item.

History tokens are (item with its side features) + (signal: rating or label) + (time-gap bucket) + position,
encoded by a small transformer with a learned "empty history" token in front. The target item attends over the
encoded history (DIN-style target attention). A shared trunk turns [target, attended history, mean history,
user, target * attended, counters] (and, with ``target_user``, target * user: the user's lasting taste for the
item, which a product term carries better than an MLP on the concatenation) into the interaction embedding
h(u, i); two heads read it: the positive label (logit) and the rating (1-5, where the data has one).

The user-level embedding (no target) is the normalised [mean encoded history, user vector]: what the KNN
fallback clusters on.
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
class FMConfig:
    user_side: dict = field(default_factory=lambda: {"n_ids": 1})
    item_side: dict = field(default_factory=lambda: {"n_ids": 1})
    history_len: int = 50
    d_model: int = 64
    n_heads: int = 2
    n_layers: int = 2
    d_interaction: int = 128
    dropout: float = 0.1
    rating_weight: float = 0.5
    target_user: bool = False       # the trunk also takes target * user (#40's search chooses it on validation)


class FoundationModel(WidthsFromConfig, nn.Module):
    # The reduced precision its inference may run in on a GPU (autocast), once ``benchmarks/gpu_check.py`` has shown
    # its codes within tolerance of float32's on a GPU; None (float32) until a GPU run has shown it.
    mixed_precision: str | None = None

    def __init__(self, cfg: FMConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.items = SideEmbedding(cfg.item_side, d)
        self.users = SideEmbedding(cfg.user_side, d)
        self.signal = nn.Embedding(N_SIGNALS, d, padding_idx=0)
        self.gap = nn.Embedding(N_GAP_BUCKETS, d, padding_idx=0)
        self.pos = nn.Embedding(cfg.history_len + 1, d)
        self.empty = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, cfg.n_heads, 2 * d, cfg.dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.query = nn.Linear(d, d)
        self.trunk = nn.Sequential(
            nn.Linear((6 if cfg.target_user else 5) * d + 4, 2 * cfg.d_interaction), nn.GELU(), nn.Dropout(cfg.dropout),
            nn.Linear(2 * cfg.d_interaction, cfg.d_interaction), nn.GELU(),
        )
        self.label_head = nn.Linear(cfg.d_interaction, 1)
        self.rating_head = nn.Linear(cfg.d_interaction, 1)

    def encode_history(self, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns encoded tokens (B, L+1, d) with the empty token first, and the padding mask (B, L+1)."""
        items = b["hist_item"]                                              # (B, L)
        B, L = items.shape
        x = self.items(items) + self.signal(b["hist_signal"]) + self.gap(b["hist_gap"])
        x = torch.cat([self.empty.expand(B, 1, -1), x], 1)                  # (B, L+1, d)
        x = x + self.pos(torch.arange(L + 1, device=x.device))
        pad = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=x.device), items == 0], 1)
        return self.norm(self.encoder(x, src_key_padding_mask=pad)), pad

    @staticmethod
    def _mean(enc: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        keep = (~pad).unsqueeze(-1).float()
        return (enc * keep).sum(1) / keep.sum(1)                            # (B, d); empty token always kept

    def forward(self, b: dict, rows: torch.Tensor | None = None) -> dict:
        """b: batch tensors (see ``solaris_jobs.core.model_inputs.Examples.batch``).

        Args:
            rows: None, or a (B,) int64 index into the history inputs (``hist_*``), which then hold one row per
                distinct history (U, L): batch row j reads history ``rows[j]``. The history encoder (the costly
                part, independent of the target) then runs U times instead of B, and only target attention and
                the trunk run per row; the outputs are those of the batch with each row's history repeated. The
                refresh's FM inference passes it: every pair of a user shares the user's history at the cutoff.

        Returns:
            ``logit`` (B,), ``rating`` (B,), ``h`` the interaction embedding (B, d_interaction).
        """
        enc, pad = self.encode_history(b)
        mean = self._mean(enc, pad)
        if rows is not None:
            enc, pad, mean = enc[rows], pad[rows], mean[rows]
        target = self.items(b["item"])                                      # (B, d)
        scores = torch.einsum("bd,bld->bl", self.query(target), enc) / enc.shape[-1] ** 0.5
        attn = scores.masked_fill(pad, float("-inf")).softmax(-1)
        attended = torch.einsum("bl,bld->bd", attn, enc)                    # (B, d)
        user = self.users(b["user"])
        parts = [target, attended, mean, user, target * attended, counter_features(b)]
        if self.cfg.target_user:
            parts.insert(5, target * user)
        z = torch.cat(parts, -1)
        h = self.trunk(z)                                                   # (B, d_interaction)
        return {"logit": self.label_head(h).squeeze(-1), "rating": 1.0 + 4.0 * torch.sigmoid(
            self.rating_head(h).squeeze(-1)), "h": h}

    def user_embedding(self, b: dict) -> torch.Tensor:
        """(B, 2 * d_model): L2-normalised [mean encoded history, user vector], no target item."""
        enc, pad = self.encode_history(b)
        return F.normalize(torch.cat([self._mean(enc, pad), self.users(b["user"])], -1), dim=-1)

    def loss(self, out: dict, b: dict) -> torch.Tensor:
        return fm_loss(out, b, self.cfg.rating_weight)
