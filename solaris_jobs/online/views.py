"""The online feature views, as plain data: the one description that the Feast repo (``feature_repo/``), the
fast materializer and the serving client all read, so that names, fields and TTLs cannot drift apart.

TTLs come from the environment (``solaris_jobs.core.settings.view_ttl``: 24 h for every view by
default; any pandas Timedelta string); ``feast apply``, materialization and serving must see the same values.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

FEATURE_SERVICE = "solaris_v3"     # bump the suffix when a view's schema changes (v2: user_states, v3: pair_fallbacks)

# How a row's model_version is used when served (the Feast tags say it too).
VERSION_POLICY = ("rows carry the FM+AE version that made them; the serving client serves only its pinned version "
                  "(another version's rows are misses), so a new model never mixes with the old in one ranking")

# feature kinds: float_list (the embedding width is not part of the schema), string, int32, int64_list
EMBEDDING = "embedding"
MODEL_VERSION = "model_version"


@dataclass(frozen=True)
class View:
    name: str                           # Feast feature view name = offline dataset name
    join_keys: tuple[str, ...]
    features: tuple[tuple[str, str], ...]   # (column, kind)
    ttl: pd.Timedelta
    tier: str                           # the serving tier it feeds (solaris_jobs.core.contract.TIERS)
    description: str

    @property
    def ttl_var(self) -> str:
        """The variable that sets this view's TTL."""
        from solaris_jobs.core.settings import view_ttl
        return view_ttl(self.name, {})[0]

    @property
    def columns(self) -> list[str]:
        return [c for c, _ in self.features]


def duration(td, min_days: int = 1) -> str:
    """A duration as the settings write it: 15min, 4h, 1d (days only from ``min_days`` days up: 24h, not 1d, with
    ``min_days=2``)."""
    s = int(pd.Timedelta(td).total_seconds())
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s % n == 0 and (unit != "d" or s >= min_days * 86400):
            return f"{s // n}{unit}"
    return f"{s}s"


def ttl(name: str, env=None) -> pd.Timedelta:
    from solaris_jobs.core.settings import view_ttl
    var, raw = view_ttl(name, env)
    try:
        value = pd.Timedelta(raw)
    except ValueError as e:
        raise ValueError(f"{var}={raw!r}: not a duration (e.g. 4h, 90min, 1d)") from e
    if value <= pd.Timedelta(0):
        raise ValueError(f"{var}={raw!r}: a TTL must be positive")
    return value


def views(env=None) -> dict[str, View]:
    """The five views, keyed by name, in serving-tier order."""
    return {v.name: v for v in (
        View("pair_embeddings", ("user_id", "item_id"),
             ((EMBEDDING, "float_list"), (MODEL_VERSION, "string")),
             ttl("pair_embeddings", env), "pair",
             "FM interaction embedding of a (user, item) pair, through the autoencoder (D floats)."),
        View("pair_fallbacks", ("user_id", "item_id"),
             ((EMBEDDING, "float_list"), ("n_pairs", "int32"), (MODEL_VERSION, "string")),
             ttl("pair_fallbacks", env), "item_aware",
             "Item-aware fallback of a pair ranked, missed or left out by the selection lately without a pair "
             "embedding: the user's pair embeddings of the trailing window weighted by their items' similarity to "
             "this item (the FM's item embeddings; no FM inference)."),
        View("user_aggregates", ("user_id",),
             ((EMBEDDING, "float_list"), ("n_pairs", "int32"), (MODEL_VERSION, "string")),
             ttl("user_aggregates", env), "user_aggregate",
             "Mean of the user's pair embeddings of the trailing window; the fallback for unseen pairs."),
        View("user_states", ("user_id",),
             ((EMBEDDING, "float_list"), (MODEL_VERSION, "string")),
             ttl("user_states", env), "user_state",
             "The user's own FM user embedding (history, no target) through the autoencoder's user coder (D floats), "
             "computed every refresh for the neighbour step; the fallback for unseen pairs."),
        View("neighbours", ("user_id",),
             ((EMBEDDING, "float_list"), ("n_neighbours", "int32"), ("neighbour_ids", "int64_list"),
              ("similarities", "float_list"), (MODEL_VERSION, "string")),
             ttl("neighbours", env), "neighbour",
             "Similarity-weighted mean of the user's nearest neighbours' aggregates (FM user embeddings, FAISS)."),
    )}
