"""Batched FM inference on executors: pair embeddings (FM interaction embedding -> autoencoder code) and FM
user embeddings. Each Python worker loads a checkpoint once (the version the run resolved, checked:
``solaris_jobs.pipeline.model_refs``) and scores Arrow batches; outputs that are not finite are marked with a
reason (the job writes them aside).
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd

from solaris_jobs.core.settings import PrecomputeConfig
from solaris_jobs.pipeline.history import ITEM_COUNTER_COLS, USER_COUNTER_COLS
from solaris_jobs.pipeline.model_refs import ModelRef, ModelSet, load, task_device

# Why an FM output is set aside instead of written (embed counts them per reason in its stats).
NONFINITE_REASONS = ("FM output is not finite", "autoencoder code is not finite")
NONFINITE_USER = "FM user embedding is not finite"
PAIR_COLS = ["item_id", *ITEM_COUNTER_COLS]


def _examples(pdf: pd.DataFrame, at_us: int, history_len: int):
    """Examples at one time for the rows of ``pdf`` (user_id, history arrays; item_id where it has one)."""
    from solaris_jobs.core.model_inputs import history_examples
    first = pdf.drop_duplicates("user_id")
    lens = np.array([0 if h is None else len(h) for h in first["hist_item"]], dtype=np.int64)

    def flat(col, dtype):
        parts = [np.asarray(h, dtype) for h in first[col] if h is not None and len(h)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    return history_examples(pdf["user_id"].to_numpy(), pdf["item_id"].to_numpy() if "item_id" in pdf else
                            np.zeros(len(pdf), np.int64), at_us,
                            np.repeat(first["user_id"].to_numpy(), lens), flat("hist_item", np.int64),
                            flat("hist_ts", np.int64), flat("hist_label", np.int64), flat("hist_rating", np.int64),
                            history_len)


def _nonfinite(*finite) -> np.ndarray:
    """Per row, the index of the first of the (N,) "row is finite" masks that is False, else -1."""
    out = np.full(len(finite[0]), -1, np.int64)
    for k, ok in reversed(list(enumerate(finite))):
        out[~np.asarray(ok)] = k
    return out


def pairs_by_user(pairs):
    """One row per user from pairs with counter columns (``with_counters``): user_id, the user's counters, and the
    user's pairs as parallel arrays sorted by item (``PAIR_COLS``: item_id and the item's counters). The FM's
    inference reads each user's history once, so a user's pairs travel together, with the history once."""
    from pyspark.sql import functions as F
    per = F.sort_array(F.collect_list(F.struct(*PAIR_COLS))).alias("p")
    return pairs.groupBy("user_id", *USER_COUNTER_COLS).agg(per).select(
        "user_id", *USER_COUNTER_COLS, *[F.col("p")[c].alias(c) for c in PAIR_COLS])


def user_batches(n_pairs: np.ndarray, batch_size: int) -> list[slice]:
    """Consecutive users in batches of about ``batch_size`` pairs: a user goes to the batch its first pair falls in
    (a batch holds fewer than ``batch_size`` + the user's pairs), never split."""
    if not len(n_pairs):
        return []
    bid = (np.cumsum(n_pairs) - n_pairs) // max(int(batch_size), 1)
    cuts = np.flatnonzero(np.diff(bid)) + 1
    edges = [0, *cuts.tolist(), len(n_pairs)]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def embed_pairs(user_pairs, models: ModelSet, cutoff, cfg: PrecomputeConfig):
    """Pair embeddings: FM interaction embedding -> autoencoder code, in the pair-embedding contract.

    Each user's history is encoded once per batch and only target attention and the trunk run per pair
    (``FoundationModel.forward(rows=...)``): the outputs of running the FM on every pair, at a fraction of the work.

    Args:
        user_pairs: one row per user (``pairs_by_user`` joined with ``user_histories``): user_id, the user's
            counters, its pairs' arrays (``PAIR_COLS``) and its history arrays (null: no history).
        models: the run's FM and autoencoder; their ``embedding_version`` is written with each row.
        cfg: ``history_len`` must be the FM's (``model_refs.resolve`` checks it); ``batch_size`` counts pairs.

    Returns:
        (user_id, item_id, embedding array<float>, event_timestamp = cutoff, model_version, reject_reason,
        model_s): the reason (``NONFINITE_REASONS``) is null for rows in the contract, and the job writes the others
        aside; ``model_s`` is the row's share of its batch's time in the FM and the encoder, tensor conversion and
        the copy back included (summed: the model's time inside the executors, apart from reading the rows,
        building the inputs and writing).
    """
    from pyspark.sql.types import (ArrayType, DoubleType, FloatType, LongType, StringType, StructField, StructType,
                                   TimestampType)
    schema = StructType([StructField("user_id", LongType()), StructField("item_id", LongType()),
                         StructField("embedding", ArrayType(FloatType())),
                         StructField("event_timestamp", TimestampType()), StructField("model_version", StringType()),
                         StructField("reject_reason", StringType()), StructField("model_s", DoubleType())])
    at = pd.Timestamp(cutoff)
    at_us = at.value // 1000
    device, threads, L = cfg.device, cfg.torch_threads, cfg.history_len
    fm_ref, ae_ref, version = models.fm, models.ae, models.embedding_version
    reasons = np.array([*NONFINITE_REASONS, None], dtype=object)

    def embed(frames):
        import torch

        from models import batch_to_tensors
        fm, _, dev = load(fm_ref, task_device(device), threads)
        ae, _, _ = load(ae_ref, task_device(device), threads)
        batch_size = cfg.batch_on(dev)
        # Mixed precision only on a GPU and only where the FM declares it safe (``FoundationModel.mixed_precision``).
        amp = getattr(fm, "mixed_precision", None) if dev.type == "cuda" else None
        for pdf in frames:
            n_pairs = pdf["item_id"].map(len).to_numpy(np.int64)
            for users in user_batches(n_pairs, batch_size):
                part, n = pdf.iloc[users], n_pairs[users]
                ex = _examples(part.drop(columns="item_id"), at_us, L)
                b = ex.index.history(ex.users, ex.ts, L)                   # (U, L): one history per user
                b["user"] = np.repeat(ex.users, n)
                b.update({c: np.repeat(part[c].to_numpy(np.float32), n) for c in USER_COUNTER_COLS})
                b.update({c: np.concatenate(part[c].to_list()).astype(np.int64 if c == "item_id" else np.float32)
                          for c in PAIR_COLS})
                b["item"] = b.pop("item_id")
                rows = torch.as_tensor(np.repeat(np.arange(len(part)), n), device=dev)
                t0 = time.perf_counter()
                with torch.inference_mode(), torch.autocast(dev.type, dtype=getattr(torch, amp or "bfloat16"),
                                                             enabled=amp is not None):
                    h = fm(batch_to_tensors(b, dev), rows=rows)["h"]
                    code = ae.encode(h)
                    finite = (torch.isfinite(h).all(1).cpu().numpy(), torch.isfinite(code).all(1).cpu().numpy())
                    code = code.float().cpu().numpy()
                model_s = (time.perf_counter() - t0) / max(len(code), 1)
                yield pd.DataFrame({"user_id": b["user"], "item_id": b["item"], "embedding": list(code),
                                    "event_timestamp": at, "model_version": version,
                                    "reject_reason": reasons[_nonfinite(*finite)], "model_s": model_s})

    return user_pairs.mapInPandas(embed, schema)


def embed_users(users_with_history, fm: ModelRef, cutoff, cfg: PrecomputeConfig, ae: ModelRef | None = None):
    """FM user-level embeddings (no target) for (user_id, history arrays): (user_id, vector array<float>, state
    array<float>: the vector through the autoencoder's user coder (``ae``; null without it), reject_reason), the
    reason ``NONFINITE_USER`` for a vector or state with a NaN or infinity (else null)."""
    from pyspark.sql.types import ArrayType, FloatType, LongType, StringType, StructField, StructType
    schema = StructType([StructField("user_id", LongType()), StructField("vector", ArrayType(FloatType())),
                         StructField("state", ArrayType(FloatType())), StructField("reject_reason", StringType())])
    at_us = pd.Timestamp(cutoff).value // 1000
    device, threads, L = cfg.device, cfg.torch_threads, cfg.history_len
    reasons = np.array([NONFINITE_USER, None], dtype=object)

    def embed(frames):
        import torch

        from models import batch_to_tensors
        model, _, dev = load(fm, task_device(device), threads)
        coder = load(ae, task_device(device), threads)[0] if ae is not None else None
        batch_size = cfg.batch_on(dev, users=True)
        coder = coder if coder is not None and coder.user is not None else None     # an AE without a user coder
        for pdf in frames:
            for s in range(0, len(pdf), batch_size):
                part = pdf.iloc[s: s + batch_size]
                b = _examples(part, at_us, L).batch(np.arange(len(part)))
                with torch.inference_mode():
                    v = model.user_embedding(batch_to_tensors(b, dev))
                    state = coder.encode_user(v).float().cpu().numpy() if coder is not None else None
                    vec = v.float().cpu().numpy()
                ok = np.isfinite(vec).all(1) & (np.isfinite(state).all(1) if state is not None else True)
                yield pd.DataFrame({"user_id": part["user_id"].to_numpy(), "vector": list(vec),
                                    "state": list(state) if state is not None else None,
                                    "reject_reason": reasons[_nonfinite(ok)]})

    return users_with_history.mapInPandas(embed, schema)


def item_vectors(fm: ModelRef, item_ids: np.ndarray, batch: int = 65_536) -> tuple[np.ndarray, np.ndarray]:
    """The FM's item embeddings (id and side features, no history: a table lookup, not an FM inference) of
    ``item_ids``, L2-normalised, on the driver: (sorted distinct ids, (n, d_model) float32)."""
    import torch
    ids = np.unique(np.asarray(item_ids, np.int64))
    model, _, _ = load(fm, "cpu", None)            # the driver's torch threads stay as they are
    out = np.zeros((len(ids), model.item_width), np.float32)
    with torch.inference_mode():
        for s in range(0, len(ids), batch):
            v = model.item_embedding(torch.as_tensor(ids[s: s + batch]))
            out[s: s + batch] = torch.nn.functional.normalize(v.float(), dim=-1).numpy()
    return ids, out
