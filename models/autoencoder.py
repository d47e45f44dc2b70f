"""Autoencoder that compresses the FM's interaction embedding h(u, i) to the D dims the VM takes (default 32)."""
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


class Autoencoder(nn.Module):
    """Standardises h with the training set's mean and std (buffers), then encoder -> code -> decoder."""

    def __init__(self, cfg: AEConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("mean", torch.zeros(cfg.d_in))
        self.register_buffer("std", torch.ones(cfg.d_in))
        self.encoder = nn.Sequential(nn.Linear(cfg.d_in, cfg.d_hidden), nn.GELU(), nn.Linear(cfg.d_hidden, cfg.d_code))
        self.decoder = nn.Sequential(nn.Linear(cfg.d_code, cfg.d_hidden), nn.GELU(), nn.Linear(cfg.d_hidden, cfg.d_in))

    def set_scale(self, h: torch.Tensor) -> None:
        """Sets the standardisation from a sample of embeddings h (N, d_in)."""
        self.mean.copy_(h.mean(0))
        self.std.copy_(h.std(0).clamp(min=1e-6))

    def encode(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, d_in) -> code (B, d_code)."""
        return self.encoder((h - self.mean) / self.std)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (code (B, d_code), reconstruction of standardised h (B, d_in))."""
        code = self.encode(h)
        return code, self.decoder(code)

    def loss(self, h: torch.Tensor) -> torch.Tensor:
        _, rec = self(h)
        return F.mse_loss(rec, (h - self.mean) / self.std)

    def explained_variance(self, h: torch.Tensor) -> float:
        """1 - reconstruction MSE / variance, on standardised h: the share of h the code keeps."""
        z = (h - self.mean) / self.std
        _, rec = self(h)
        return float(1.0 - ((rec - z) ** 2).sum() / ((z - z.mean(0)) ** 2).sum())
