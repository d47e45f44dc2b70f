"""The request simulator: the candidate set a retrieval stage would hand the ranker for user u at time t.

It stands in for retrieval, so that "a pair will be ranked soon" has a concrete meaning for the pipeline and the
evaluation. Built from the log strictly before a cutoff T (the start of the interval being prepared), it
answers for any request at t >= T, so its answer depends only on the log before t:

* co-visitation: items that followed or preceded the user's ``history_items`` most recent items within
  ``covisit_window`` positions in any user's history, scored by co-occurrence counts (top ``covisit_top`` per
  seed item), up to ``n_candidates - n_popular`` of them;
* recent popularity: the items most often logged in the ``popularity_hours`` before T (then, if the window is
  quiet, the rest by all-time count), filling the set up to ``n_candidates``;
* the item the user actually interacted with, when the caller gives it (replays always contain it).

Ties break by item id, so the output is deterministic.
"""
from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.core.settings import SimulatorConfig

logger = logging.getLogger(__name__)

__all__ = ["RequestSimulator", "SimulatorConfig"]


class RequestSimulator:
    """Candidate sets from the log before ``cutoff``.

    Args:
        events: event-log rows (only those with event_timestamp < cutoff are used).
        cutoff: T, a pandas-parsable UTC time.
        cfg: sizes and windows.
    """

    def __init__(self, events: pa.Table | pd.DataFrame, cutoff, cfg: SimulatorConfig = SimulatorConfig()):
        self.cfg = cfg
        df = events.to_pandas() if isinstance(events, pa.Table) else events
        self.cutoff = pd.Timestamp(cutoff).tz_convert("UTC") if pd.Timestamp(cutoff).tzinfo else \
            pd.Timestamp(cutoff).tz_localize("UTC")
        df = df.loc[df["event_timestamp"] < self.cutoff, ["user_id", "item_id", "event_timestamp"]]
        df = df.sort_values(["user_id", "event_timestamp", "item_id"], kind="stable")
        recent = df.loc[df["event_timestamp"] >= self.cutoff - pd.Timedelta(hours=cfg.popularity_hours)]
        # Items seen in the window first (by count there), then the rest of the log (by all-time count).
        pop = pd.concat([recent["item_id"].value_counts().rename("count").reset_index().assign(tier=0),
                         df["item_id"].value_counts().rename("count").reset_index().assign(tier=1)])
        pop = pop.drop_duplicates("item_id", keep="first")
        pop = pop.sort_values(["tier", "count", "item_id"], ascending=[True, False, True])
        self.popular = pop["item_id"].to_numpy()[: cfg.n_candidates]
        self.covisit = self._covisit(df)
        last = df.drop_duplicates(["user_id", "item_id"], keep="last")
        last = last.groupby("user_id", sort=False).tail(cfg.history_items)
        self.recent = last.assign(weight=1.0)[["user_id", "item_id", "weight"]].rename(columns={"item_id": "seed"})
        logger.info("request simulator at %s: %d events before, %d popular, %d co-visitation pairs", self.cutoff,
                    len(df), len(self.popular), len(self.covisit))

    def _covisit(self, df: pd.DataFrame) -> pd.DataFrame:
        u, i = df["user_id"].to_numpy(), df["item_id"].to_numpy()
        pairs = []
        for lag in range(1, self.cfg.covisit_window + 1):
            same = u[lag:] == u[:-lag]
            a, b = i[lag:][same], i[:-lag][same]
            keep = a != b
            pairs += [np.stack([a[keep], b[keep]], 1), np.stack([b[keep], a[keep]], 1)]
        if not pairs or not sum(len(p) for p in pairs):
            return pd.DataFrame({"seed": [], "item_id": [], "count": []}, dtype="int64")
        p = pd.DataFrame(np.concatenate(pairs), columns=["seed", "item_id"])
        c = p.value_counts().rename("count").reset_index()
        c = c.sort_values(["seed", "count", "item_id"], ascending=[True, False, True])
        return c.groupby("seed", sort=False).head(self.cfg.covisit_top).reset_index(drop=True)

    def candidates(self, users, actual_items=None) -> pd.DataFrame:
        """Candidate sets for a batch of requests.

        Args:
            users: user ids, one per request (a user may appear once).
            actual_items: optional item per request that must be in its set (the item actually interacted with).

        Returns:
            Frame (user_id, item_id, source, retrieval_score): per user up to ``n_candidates`` distinct items
            (plus the actual item), source one of ``covisit``, ``popular``, ``actual``.
        """
        cfg = self.cfg
        req = pd.DataFrame({"user_id": np.asarray(users, dtype=np.int64)})
        if actual_items is not None:
            req["actual"] = np.asarray(actual_items, dtype=np.int64)
        req = req.drop_duplicates("user_id")
        seeds = self.recent.merge(req[["user_id"]], on="user_id")
        cov = seeds.merge(self.covisit, on="seed")
        cov = cov.groupby(["user_id", "item_id"], as_index=False)["count"].sum()
        cov = cov.sort_values(["user_id", "count", "item_id"], ascending=[True, False, True])
        cov = cov.groupby("user_id", sort=False).head(cfg.n_candidates - cfg.n_popular)
        cov = cov.assign(source="covisit", retrieval_score=np.log1p(cov["count"].to_numpy()).astype(np.float32))
        n_pop = len(self.popular)
        pop = pd.DataFrame({"user_id": np.repeat(req["user_id"].to_numpy(), n_pop),
                            "item_id": np.tile(self.popular, len(req)),
                            "rank": np.tile(np.arange(n_pop), len(req))})
        pop = pop.merge(cov[["user_id", "item_id"]], on=["user_id", "item_id"], how="left", indicator=True)
        pop = pop.loc[pop["_merge"] == "left_only"].drop(columns="_merge")
        n_cov = cov.groupby("user_id").size().reindex(req["user_id"]).fillna(0).astype(int)
        room = (cfg.n_candidates - n_cov).reindex(pop["user_id"]).to_numpy()
        pop["k"] = pop.groupby("user_id").cumcount()
        pop = pop.loc[pop["k"].to_numpy() < room]
        pop = pop.assign(source="popular", retrieval_score=(-pop["rank"].to_numpy() / max(n_pop, 1)).astype(np.float32))
        cols = ["user_id", "item_id", "source", "retrieval_score"]
        out = pd.concat([cov[cols], pop[cols]], ignore_index=True)
        if actual_items is not None:
            act = req.rename(columns={"actual": "item_id"}).assign(source="actual", retrieval_score=np.float32(-1))
            act = act.merge(out[["user_id", "item_id"]], on=["user_id", "item_id"], how="left", indicator=True)
            act = act.loc[act["_merge"] == "left_only", cols]
            out = pd.concat([out, act], ignore_index=True)
        return out.sort_values(["user_id", "retrieval_score", "item_id"], ascending=[True, False, True],
                               kind="stable").reset_index(drop=True)
