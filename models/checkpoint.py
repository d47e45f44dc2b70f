"""Checkpoints carry the model kind, its config as a dict, a model version and the state dict, so that loading
rebuilds the exact model (as nanoGPT stores ``model_args``)."""
from __future__ import annotations

import hashlib
import io
import os
from dataclasses import asdict
from pathlib import Path

import torch

from models.autoencoder import AEConfig, Autoencoder
from models.fm import FMConfig, FoundationModel
from models.vm import VMConfig, VerticalModel

KINDS = {"fm": (FMConfig, FoundationModel), "ae": (AEConfig, Autoencoder), "vm": (VMConfig, VerticalModel)}


def _kind_of(model) -> str:
    for kind, (_, cls) in KINDS.items():
        if isinstance(model, cls):
            return kind
    raise TypeError(f"not a SOLARIS model: {type(model).__name__}")


def model_version(model) -> str:
    """``<kind>-<first 12 hex of sha256 of the weights>``: equal weights, equal version."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return f"{_kind_of(model)}-{h.hexdigest()[:12]}"


def save_checkpoint(model, path: str | os.PathLike, extra: dict | None = None) -> str:
    """Saves ``{kind, config, model_version, state_dict, extra}`` atomically; returns the model version."""
    version = model_version(model)
    state = {"kind": _kind_of(model), "config": asdict(model.cfg), "model_version": version,
             "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "extra": extra or {}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return version


def load_checkpoint(path: str | os.PathLike, map_location="cpu", kind: str | None = None):
    """Rebuilds the model from a checkpoint, in eval mode.

    Returns:
        (model, checkpoint dict without the state dict).

    Raises:
        ValueError: the file holds another kind of model than ``kind``.
    """
    state = torch.load(path, map_location=map_location, weights_only=False)
    if kind is not None and state["kind"] != kind:
        raise ValueError(f"{path}: holds a {state['kind']!r} model, expected {kind!r}")
    cfg_cls, model_cls = KINDS[state["kind"]]
    cfg = state["config"]
    if "hidden" in cfg:
        cfg["hidden"] = tuple(cfg["hidden"])
    model = model_cls(cfg_cls(**cfg))
    model.load_state_dict(state["state_dict"])
    model.eval()
    meta = {k: v for k, v in state.items() if k != "state_dict"}
    return model, meta
