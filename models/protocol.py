"""What SOLARIS needs of a foundation model, and nothing more (#41): the contract the refresh's inference, the
autoencoder's training and the evaluation call an FM through, so that an FM of another family (or a user's own)
runs through them unchanged.

An FM is a ``torch.nn.Module`` with:

- ``forward(b, rows=None) -> {"logit": (B,), "h": (B, width)}``: for a batch of (user, target item) rows with the
  users' histories (``solaris_jobs.core.model_inputs.Examples.batch``), the click logit (the KD teacher's soft
  label) and the interaction embedding ``h`` the autoencoder codes and the store serves. ``rows`` (a (B,) index into
  the batch's ``hist_*`` inputs, which then hold one row per distinct user): every row of a user shares one
  history, so an FM encodes each history once (the refresh's embed step passes it); the outputs must equal those
  of the batch with each row's history repeated;
- ``user_embedding(b) -> (B, user_width)``: a user-level vector from the history alone (no target), for the
  neighbour step's KNN and the user-state tier;
- ``item_embedding(ids) -> (N, item_width)``: the FM's item vectors (the item-aware fallback weighs a user's cached
  pair codes by the target item's cosine similarity to theirs);
- attributes ``width``, ``user_width``, ``item_width`` (the output widths), ``history_len`` (events of history it
  reads) and ``mixed_precision`` (a torch dtype name it may run inference in on a GPU, or None).

Its version (a hash of its weights), device placement and training end live in its checkpoint and
``solaris_jobs.pipeline.model_refs``. ``check_fm`` runs an FM once on a probe batch and refuses it, naming the FM
and the check, when an output has the wrong shape or width or is not finite: before anything is written.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class FMProtocol(Protocol):
    width: int
    user_width: int
    item_width: int
    history_len: int
    mixed_precision: str | None

    def forward(self, b: dict, rows: torch.Tensor | None = None) -> dict: ...

    def user_embedding(self, b: dict) -> torch.Tensor: ...

    def item_embedding(self, ids: torch.Tensor) -> torch.Tensor: ...


class WidthsFromConfig:
    """The protocol's attributes of an FM whose config has ``d_model``, ``d_interaction`` and ``history_len`` and
    whose item embedding is ``self.items`` (both families here): h is ``d_interaction`` wide, the user embedding
    ``2 x d_model`` ([history summary, user vector]), the items ``d_model``."""

    @property
    def width(self) -> int:
        return self.cfg.d_interaction

    @property
    def user_width(self) -> int:
        return 2 * self.cfg.d_model

    @property
    def item_width(self) -> int:
        return self.cfg.d_model

    @property
    def history_len(self) -> int:
        return self.cfg.history_len

    def item_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """(N, d_model): the items' embeddings (id and side features)."""
        return self.items(ids)


class FMRefused(ValueError):
    """An FM that does not keep the protocol's contract: the message names the FM and the check."""


def probe_batch(history_len: int, users: int = 3, per_user: int = 2) -> tuple[dict, torch.Tensor, dict]:
    """A small batch in the model-input format (every id 1, the one id any vocabulary has besides the padding 0;
    full, partial and empty histories; counters), its ``rows``
    index for ``forward(rows=...)`` and the users' own batch (one row per user, for ``user_embedding``): what
    ``check_fm`` runs an FM on."""
    from solaris_jobs.core.contract import N_GAP_BUCKETS
    rng = np.random.default_rng(0)
    n = users * per_user
    hist = np.ones((users, history_len), np.int64)
    hist[1, : history_len // 2] = 0                          # a shorter history
    hist[-1] = 0                                             # a user without history
    b = {"user": np.ones(n, np.int64), "item": np.ones(n, np.int64),
         "hist_item": hist, "hist_signal": np.where(hist > 0, rng.integers(1, 3, hist.shape), 0),
         "hist_gap": np.where(hist > 0, rng.integers(1, N_GAP_BUCKETS, hist.shape), 0),
         **{k: rng.integers(0, 5, n).astype(np.float32) for k in
            ("user_cnt", "user_known", "user_pos", "item_cnt", "item_known", "item_pos")}}
    pairs = {k: torch.as_tensor(v) for k, v in b.items()}
    per_user_batch = {"user": torch.ones(users, dtype=torch.int64),
                      **{k: v for k, v in pairs.items() if k.startswith("hist_")}}
    return pairs, torch.as_tensor(np.repeat(np.arange(users), per_user)), per_user_batch


def check_fm(fm, name: str) -> None:
    """Runs ``fm`` once on a probe batch (on its own device, in inference mode) and checks the protocol's outputs.

    Raises:
        FMRefused: an attribute is missing, or an output has the wrong shape or width, or is not finite; the message
            names ``name`` (the FM's checkpoint) and the check.
    """
    import numbers
    missing = [a for a in ("width", "user_width", "item_width", "history_len")
               if not isinstance(getattr(fm, a, None), numbers.Integral)]
    missing += [a for a in ("mixed_precision",) if not hasattr(fm, a)]
    missing += [m for m in ("forward", "user_embedding", "item_embedding") if not callable(getattr(fm, m, None))]
    if missing:
        raise FMRefused(f"{name}: not an FM of the protocol (models.protocol): missing or not an integer: "
                        f"{', '.join(missing)}")
    dev = next(iter(fm.parameters()), torch.empty(0)).device
    b, rows, ub = probe_batch(int(fm.history_len))
    b, rows, ub = {k: v.to(dev) for k, v in b.items()}, rows.to(dev), {k: v.to(dev) for k, v in ub.items()}
    hist = {k: v[rows] for k, v in b.items() if k.startswith("hist_")}
    calls = {"forward(rows=...)": lambda: fm(b, rows=rows), "forward": lambda: fm({**b, **hist}),
             "user_embedding": lambda: fm.user_embedding(ub), "item_embedding": lambda: fm.item_embedding(b["item"])}
    got = {}
    with torch.inference_mode():
        for what, call in calls.items():
            try:
                got[what] = call()
            except Exception as e:                  # any failure on the probe is the FM's, named
                raise FMRefused(f"{name}: {what} raised {type(e).__name__}: {e} on a probe batch") from e
    shared, repeated = got["forward(rows=...)"], got["forward"]
    if not isinstance(shared, dict) or not isinstance(repeated, dict):
        raise FMRefused(f"{name}: forward returned {type(shared).__name__}, not a dict with logit and h")
    outputs = {"forward h": (shared.get("h"), (len(rows), fm.width)),
               "forward logit": (shared.get("logit"), (len(rows),)),
               "user_embedding": (got["user_embedding"], (len(ub["user"]), fm.user_width)),
               "item_embedding": (got["item_embedding"], (len(b["item"]), fm.item_width))}
    for what, (out, shape) in outputs.items():
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise FMRefused(f"{name}: {what} has shape {got}, not {shape} (the FM's declared widths)")
        if not torch.isfinite(out.float()).all():
            raise FMRefused(f"{name}: {what} is not finite on a probe batch (NaN or infinity)")
    if not all(isinstance(repeated.get(k), torch.Tensor) and repeated[k].shape == shared[k].shape
               and torch.allclose(shared[k].float(), repeated[k].float(), rtol=1e-4, atol=1e-5) for k in ("h", "logit")):
        raise FMRefused(f"{name}: forward(rows=...) differs from the batch with each row's history repeated: the "
                        f"shared-history path must give the same outputs")
