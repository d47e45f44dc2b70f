"""Autoencoder that compresses the FM's interaction embedding h(u, i) to the D dims the VM takes (default 32), and,
with ``d_user``, the FM's user embedding (no target) to the same D dims: the user-state tier's code."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AEConfig:
    d_in: int = 128
    d_code: int = 32
    d_hidden: int = 64
    d_user: int = 0             # > 0: a second coder for the FM's user embedding (of this width) to d_code dims


class Coder(nn.Module):
    """Standardises its input with the training set's mean and std (buffers), then encoder -> code -> decoder."""

    def __init__(self, d_in: int, d_code: int, d_hidden: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d_in))
        self.register_buffer("std", torch.ones(d_in))
        self.encoder = nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_code))
        self.decoder = nn.Sequential(nn.Linear(d_code, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_in))

    def set_scale(self, x: torch.Tensor) -> None:
        """Sets the standardisation from a sample x (N, d_in)."""
        self.mean.copy_(x.mean(0))
        self.std.copy_(x.std(0).clamp(min=1e-6))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, d_in) -> code (B, d_code)."""
        return self.encoder((x - self.mean) / self.std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (code (B, d_code), reconstruction of standardised x (B, d_in))."""
        code = self.encode(x)
        return code, self.decoder(code)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        _, rec = self(x)
        return F.mse_loss(rec, (x - self.mean) / self.std)

    def explained_variance(self, x: torch.Tensor) -> float:
        """1 - reconstruction MSE / variance, on standardised x: the share of x the code keeps."""
        z = (x - self.mean) / self.std
        _, rec = self(x)
        return float(1.0 - ((rec - z) ** 2).sum() / ((z - z.mean(0)) ** 2).sum())


class Autoencoder(Coder):
    """The pair coder (h(u, i) -> D) itself, with the user coder (user embedding -> D) as ``user`` when
    ``cfg.d_user``; one checkpoint, one version, so that every code the store serves names one autoencoder."""

    def __init__(self, cfg: AEConfig):
        super().__init__(cfg.d_in, cfg.d_code, cfg.d_hidden)
        self.cfg = cfg
        self.user = Coder(cfg.d_user, cfg.d_code, cfg.d_hidden) if cfg.d_user else None

    def encode_user(self, u: torch.Tensor) -> torch.Tensor:
        """The FM's user embedding (B, d_user) -> its code (B, d_code)."""
        if self.user is None:
            raise ValueError("this autoencoder has no user coder (trained without the FM's user embeddings)")
        return self.user.encode(u)
