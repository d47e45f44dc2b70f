"""A ranker integration, end to end: the VM scores one request's candidates with the SOLARIS features read through
the tiered serving client. What a production ranker does with its own feature pipeline, in a few lines.

The VM's log-derived inputs (user's and item's events and positives, and the recency inputs: when this pair and
this item were last shown, the pair's recent shows, the user's previous event, all before the request) come from
the event log here (``Counters``), by the code that built them for training; a production ranker reads them from
its own features.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from solaris_jobs.core.contract import vm_embedding_version
from solaris_jobs.online.reader import FeatureReader


class Counters:
    """The VM's counter and recency inputs from the event log strictly before ``at`` (the same code as training)."""

    def __init__(self, root, at):
        from solaris_jobs.core.events import read_events
        from solaris_jobs.core.model_inputs import EventIndex, recency
        self._recency = recency
        self.at_us = pd.Timestamp(at).value // 1000 if pd.Timestamp(at).tzinfo else \
            pd.Timestamp(at, tz="UTC").value // 1000
        self.index = EventIndex(read_events(root, end=at))

    def __call__(self, user: int, items: np.ndarray) -> dict:
        n = len(items)
        users, items, ts = np.full(n, user, np.int64), np.asarray(items, np.int64), np.full(n, self.at_us, np.int64)
        return {**self.index.counters(users, items, ts), **self._recency(self.index, users, items, ts)}


@dataclass
class Ranking:
    items: np.ndarray
    scores: np.ndarray          # P(click), (N,)
    tiers: list[str]            # the feature tier of each candidate ("none" without FM features)
    features_ms: float          # the online-store read (0 without FM features)
    model_ms: float             # the VM forward pass

    def table(self, top: int | None = None) -> pd.DataFrame:
        df = pd.DataFrame({"item_id": self.items, "score": self.scores, "tier": self.tiers})
        df = df.sort_values("score", ascending=False, kind="stable").reset_index(drop=True)
        return df.head(top) if top else df


class Ranker:
    """Scores requests with a VM checkpoint, taking SOLARIS features from ``reader`` when the VM has an FM slot.

    Raises:
        ValueError: the reader serves another embedding version or width than the VM was trained with.
    """

    def __init__(self, vm_path, reader: FeatureReader | None, counters, threads: int = 1):
        import torch

        from models import load_checkpoint
        torch.set_num_threads(threads)
        self.vm, self.meta = load_checkpoint(vm_path, kind="vm")
        self.fm_dim = self.vm.cfg.fm_dim
        self.version = vm_embedding_version(self.meta)
        if reader is not None and self.fm_dim:
            if reader.version != self.version or reader.dim != self.fm_dim:
                raise ValueError(f"{vm_path}: the VM takes embeddings {self.version} of width {self.fm_dim}; "
                                 f"the reader serves {reader.version} of width {reader.dim}")
        self.reader, self.counters = reader, counters

    def score(self, user_id: int, item_ids, now, use_features: bool = True) -> Ranking:
        import torch

        from models import batch_to_tensors
        from solaris_jobs.core.contract import TIER_NONE, TIERS
        items = np.asarray(item_ids, np.int64)
        b = {"user": np.full(len(items), user_id, np.int64), "item": items, **self.counters(user_id, items)}
        t0 = time.perf_counter()
        tiers = np.full(len(items), TIER_NONE, np.int64)
        if self.fm_dim and use_features and self.reader is not None:
            f = self.reader.read(user_id, items, now)
            b["fm_emb"], tiers = f.embeddings, f.tiers
            b["tier"] = tiers
            if self.vm.cfg.fm_age:
                b["fm_age_h"] = f.ages_s / 3600.0
            if self.vm.cfg.fm_count:
                b["fm_count"] = f.counts.astype(np.float32)
        t1 = time.perf_counter()
        with torch.inference_mode():
            scores = torch.sigmoid(self.vm(batch_to_tensors(b))["logit"]).numpy()
        t2 = time.perf_counter()
        return Ranking(items, scores, [TIERS[t] for t in tiers], (t1 - t0) * 1000, (t2 - t1) * 1000)
