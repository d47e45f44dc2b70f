"""Checkpoints carry a format number, the model kind, its config as a dict, a model version and the state dict, so
that loading rebuilds the exact model (as nanoGPT stores ``model_args``). They hold tensors and plain Python values
only and are loaded with ``torch.load(weights_only=True)``: a checkpoint cannot run code when it is read."""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch

from models.autoencoder import AEConfig, Autoencoder
from models.fm import FMConfig, FoundationModel
from models.gru4rec import GRU4RecFM, GRUConfig
from models.vm import VMConfig, VerticalModel

FORMAT = 1          # bump when what a checkpoint holds changes; only this format is read


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded by this code: corrupt, of another format or code version, another kind."""


KINDS = {"fm": (FMConfig, FoundationModel), "ae": (AEConfig, Autoencoder), "vm": (VMConfig, VerticalModel)}
# The FM families this code builds, by the name a checkpoint records (a name, never a module path: reading a
# checkpoint must not import code it names).
FM_FAMILIES = {"transformer": (FMConfig, FoundationModel), "gru4rec": (GRUConfig, GRU4RecFM)}


def _kind_of(model) -> str:
    if fm_family_of(model) is not None:
        return "fm"
    for kind, (_, cls) in KINDS.items():
        if isinstance(model, cls):
            return kind
    raise TypeError(f"not a SOLARIS model: {type(model).__name__}")


def fm_family_of(model) -> str | None:
    """The family name of an FM of this code, a subclass included (None: not one)."""
    return next((name for name, (_, cls) in FM_FAMILIES.items() if isinstance(model, cls)), None)


def model_version(model, kind: str | None = None) -> str:
    """``<kind>-<first 12 hex of sha256 of the weights>``: equal weights, equal version (``kind``: of a model that
    is not one of this code's classes, such as a user's FM)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())   # any dtype
    return f"{kind or _kind_of(model)}-{h.hexdigest()[:12]}"


def save_checkpoint(model, path: str | os.PathLike, extra: dict | None = None) -> str:
    """Saves ``{kind, config, model_version, state_dict, extra}`` atomically; returns the model version."""
    version = model_version(model)
    # extra as JSON values (numpy scalars become floats), so that the weights-only loader can read it back.
    plain = json.loads(json.dumps(extra or {}, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
    state = {"format": FORMAT, "kind": _kind_of(model), "config": asdict(model.cfg), "model_version": version,
             "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "extra": plain}
    if state["kind"] == "fm":
        state["family"] = fm_family_of(model)
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
        FileNotFoundError: no such file.
        CheckpointError: (a ValueError) the file is not a readable checkpoint (corrupt, truncated, holds code), was
            written in another format or by a code version whose model config differs, or holds another kind of
            model than ``kind``.
    """
    source = path
    if "://" in str(path) and not str(path).startswith("file://"):
        from solaris_jobs.core import uris           # an object store, HDFS: the project's file system layer
        fs, p = uris.filesystem(path)
        try:
            with fs.open_input_stream(p) as f:
                source = io.BytesIO(f.read())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no checkpoint there (train one with `solaris train`)") from None
    elif not Path(str(path).removeprefix("file://")).is_file():
        raise FileNotFoundError(f"{path}: no checkpoint there (train one with `solaris train`)")
    else:
        source = str(path).removeprefix("file://")
    try:
        state = torch.load(source, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable SOLARIS checkpoint ({first[:200]})") from e
    if not isinstance(state, dict) or "kind" not in state or "state_dict" not in state:
        raise CheckpointError(f"{path}: not a SOLARIS checkpoint (no kind and state_dict)")
    fmt = state.get("format")
    if isinstance(fmt, int) and fmt > FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {fmt!r} is newer than this code reads ({FORMAT}); "
                              "upgrade SOLARIS or retrain with this version")
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {fmt!r} is not the one this code reads ({FORMAT}); "
                              "retrain with this version")
    if state["kind"] not in KINDS:
        raise CheckpointError(f"{path}: unknown model kind {state['kind']!r} (expected one of {sorted(KINDS)})")
    if kind is not None and state["kind"] != kind:
        raise CheckpointError(f"{path}: holds a {state['kind']!r} model, expected {kind!r}")
    cfg_cls, model_cls = KINDS[state["kind"]]
    if state["kind"] == "fm":
        family = state.get("family", "transformer")         # checkpoints before #41 hold the transformer FM
        if family not in FM_FAMILIES:
            raise CheckpointError(f"{path}: FM family {family!r} is unknown to this code (it builds "
                                  f"{sorted(FM_FAMILIES)})")
        cfg_cls, model_cls = FM_FAMILIES[family]
    cfg = dict(state["config"])
    if "hidden" in cfg:
        cfg["hidden"] = tuple(cfg["hidden"])
    known = set(cfg_cls.__dataclass_fields__)
    if set(cfg) - known:
        raise CheckpointError(f"{path}: {state['kind']} config fields {sorted(set(cfg) - known)} are unknown to this "
                              "code version (written by another SOLARIS version; retrain with this one)")
    try:
        model = model_cls(cfg_cls(**cfg))
        model.load_state_dict(state["state_dict"])
    except (RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: its weights do not fit this code's {state['kind']} model "
                              f"({str(e).splitlines()[0][:200]}); retrain with this version") from e
    model.eval()
    meta = {k: v for k, v in state.items() if k != "state_dict"}
    return model, meta
