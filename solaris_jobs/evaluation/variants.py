"""The ranker's VM variants, trained on what the store served.

Every variant trains on the same rows, ``[t0, valid_from)``, picks its epoch and grid point on
``[valid_from, t2)`` and is tested on ``[t2, t3)``. Every variant, the baseline and KD included, takes the same
log-derived inputs: the lifetime counters and the recency inputs a production ranker computes from its own log
(``model_inputs.recency``); the SOLARIS variants add their FM slot, tier and age inputs on top. Rows before t1 carry what was served then: tier none, zeros,
no soft label. The FM inputs of rows in ``[t1, t3)`` are the replay's (``solaris_jobs.learning.replay``): what
``FeatureReader`` returned at the row's time. Variants:

=============  ===========================================================================================
vm             the VM alone
vm_kd          + knowledge distillation from the frozen FM (soft labels on [t1, t2) rows: out of sample)
tiers_only     + tier, age and count inputs, embeddings zeroed (what the tiers alone carry)
pair           + SOLARIS, pair tier only (the fallback tiers' rows become tier none)
pair_agg       + SOLARIS, pair and user-aggregate tiers
solaris        + SOLARIS, all tiers
solaris_kd     all tiers + KD
oracle         the FM's code computed at every row's time (100% coverage, no staleness: the FM run online)
fm             the FM itself
=============  ===========================================================================================

Tuning: every trained variant gets a grid of ``GRID_SIZE`` points. The non-KD variants search learning rate x weight
decay x dropout; the KD variants search the KD weight x temperature on top of the base hyperparameters their
non-KD twin chose (vm for vm_kd, solaris for solaris_kd), which gives KD the larger search of the two.
"""
from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.core.contract import TIER_NONE, TIERS
from solaris_jobs.core.model_inputs import recency
from solaris_jobs.evaluation.protocol import VARIANT_CODE, code_version

logger = logging.getLogger(__name__)

T_PAIR, T_AGG = TIERS.index("pair"), TIERS.index("user_aggregate")
ALL = tuple(range(TIER_NONE))              # every tier that serves an embedding
BASE_GRID = [{"lr": lr, "weight_decay": wd, "dropout": do}
             for lr, (wd, do) in itertools.product((3e-3, 1e-2), ((0.0, 0.1), (0.0, 0.3), (1e-4, 0.3)))]
# KD's weight is per soft-labelled row (``VerticalModel.loss``): the soft label's share of each row that has one.
KD_GRID = [{"kd_weight": a, "kd_temperature": t} for a, t in itertools.product((0.2, 0.5, 0.8), (1.0, 4.0))]
GRID_SIZE = len(BASE_GRID)
assert len(KD_GRID) == GRID_SIZE
# Post hoc, added after the headline runs: in every seed KD's best point was the grid's corner (weight 0.2,
# temperature 1), so the headline may under-tune KD. The evaluation's first seed also trains VM + KD on this grid
# below and between that corner's neighbours and reports the union's best beside the headline (never in its place).
KD_CHECK_GRID = [{"kd_weight": a, "kd_temperature": t} for a, t in itertools.product((0.05, 0.1, 0.3), (1.0, 2.0))]


def kd_grid(chosen: dict, points) -> list[dict]:
    """A KD variant's grid: the KD ``points`` on top of the base hyperparameters its non-KD twin ``chosen``."""
    return [{**{k: chosen[k] for k in ("lr", "weight_decay", "dropout")}, **g} for g in points]


# name -> (FM input: None | "served" | "oracle", tiers kept, embeddings zeroed, KD, base variant for KD)
VARIANTS = {
    "vm": (None, (), False, False, None),
    "vm_kd": (None, (), False, True, "vm"),
    "tiers_only": ("served", ALL, True, False, None),
    "pair": ("served", (T_PAIR,), False, False, None),
    "pair_agg": ("served", (T_PAIR, T_AGG), False, False, None),
    "solaris": ("served", ALL, False, False, None),
    "solaris_kd": ("served", ALL, False, True, "solaris"),
    "oracle": ("oracle", (T_PAIR,), False, False, None),
}


@dataclass
class Table:
    """Every row of the log from t0 on with the VM's inputs and what the FM side gave it."""
    users: np.ndarray
    items: np.ndarray
    ts: np.ndarray
    labels: np.ndarray
    counters: dict
    recency: dict                # the log-derived recency inputs (``model_inputs.recency``) of every row
    split: np.ndarray            # 0 train, 1 valid, 2 test
    served_emb: np.ndarray       # (n, D) what the store served (zeros: tier none)
    served_tier: np.ndarray
    served_age_h: np.ndarray     # NaN for tier none
    served_n: np.ndarray         # the FM embeddings behind what was served (1 pair, n_pairs, n_neighbours; 0 none)
    oracle_emb: np.ndarray       # (n, D) the FM's code at the row's time (zeros before t1)
    fm_logit: np.ndarray         # the FM's logit at the row's time (NaN before t1)
    user_side: dict
    item_side: dict
    tables: dict
    with_recency: bool = True    # False: the comparison before #40 (lifetime counters only), reported once beside

    def inputs(self, variant: str) -> tuple[dict, int]:
        """The arrays a variant's VM takes, and its FM slot width."""
        source, keep, zeroed, kd, _ = VARIANTS[variant]
        a = {"user": self.users, "item": self.items, **self.counters, **(self.recency if self.with_recency else {})}
        if kd:
            a["fm_logit"] = np.where(self.split < 2, self.fm_logit, np.nan).astype(np.float32)
        if source is None:
            return a, 0
        if source == "oracle":
            has = np.isfinite(self.fm_logit)
            tier = np.where(has, T_PAIR, TIER_NONE).astype(np.int64)
            emb, age, count = self.oracle_emb, np.where(has, 0.0, np.nan), has.astype(np.float32)
        else:
            tier = np.where(np.isin(self.served_tier, keep), self.served_tier, TIER_NONE).astype(np.int64)
            emb = np.where((tier != TIER_NONE)[:, None], self.served_emb, 0.0).astype(np.float32)
            age = np.where(tier != TIER_NONE, self.served_age_h, np.nan)
            count = np.where(tier != TIER_NONE, self.served_n, 0).astype(np.float32)
        if zeroed:
            emb = np.zeros_like(emb)
        a.update(fm_emb=emb, tier=tier, fm_age_h=age.astype(np.float32), fm_count=count)
        return a, emb.shape[1]


def build_table(data, protocol, served: pa.Table, fm_cache: dict | None) -> Table:
    """Aligns the replay's served rows and the FM cache with the training rows.

    Args:
        data: ``training.load_dataset(root, cuts=(valid_from, t2))`` (its index covers the whole log).
        served: the replay's ``served.parquet`` (rows of [t1, t3)).
        fm_cache: {"ts", "users", "items", "logit", "code"} for the rows of [t1, t3) (``fm_outputs``); None
            without the oracle and KD variants.
    """
    t0_us = protocol.t0.value // 1000
    parts = [data.train, data.valid, data.test]
    users = np.concatenate([p.users for p in parts])
    items = np.concatenate([p.items for p in parts])
    ts = np.concatenate([p.ts for p in parts])
    labels = np.concatenate([p.label for p in parts])
    split = np.concatenate([np.full(len(p), k, np.int8) for k, p in enumerate(parts)])
    keep = ts >= t0_us
    users, items, ts, labels, split = users[keep], items[keep], ts[keep], labels[keep], split[keep]
    counters = data.index.counters(users, items, ts)
    recent = recency(data.index, users, items, ts)
    n = len(users)
    key = pd.DataFrame({"user_id": users, "item_id": items, "ts": ts, "row": np.arange(n)})
    served_emb, served_tier, served_age, served_n = _served_arrays(key, served)
    fm_logit = np.full(n, np.nan, np.float32)
    if fm_cache is None:                        # no oracle, no KD (training the ranker's VM on served features)
        oracle = np.zeros((0, served_emb.shape[1]), np.float32)
    else:
        f = pd.DataFrame({"user_id": fm_cache["users"], "item_id": fm_cache["items"], "ts": fm_cache["ts"],
                          "frow": np.arange(len(fm_cache["ts"]))}).drop_duplicates(["user_id", "item_id", "ts"])
        mf = key.merge(f, on=["user_id", "item_id", "ts"], how="inner")
        oracle = np.zeros((n, fm_cache["code"].shape[1]), np.float32)
        oracle[mf.row] = fm_cache["code"][mf.frow]
        fm_logit[mf.row] = fm_cache["logit"][mf.frow]
    return Table(users, items, ts, labels, counters, recent, split, served_emb, served_tier, served_age, served_n,
                 oracle, fm_logit, data.user_side, data.item_side, data.tables)


def _served_arrays(key: pd.DataFrame, served: pa.Table):
    """The served embedding, tier, age (hours) and count behind it of each row of ``key`` (user_id, item_id, ts,
    row); rows the replay did not serve (before t1) get zeros and tier none."""
    n = len(key)
    s = pd.DataFrame({"user_id": served.column("user_id").to_numpy(), "item_id": served.column("item_id").to_numpy(),
                      "ts": served.column("event_timestamp").cast(pa.int64()).to_numpy(), "srow": np.arange(
                          served.num_rows)}).drop_duplicates(["user_id", "item_id", "ts"])
    m = key.merge(s, on=["user_id", "item_id", "ts"], how="inner")
    dim = served.schema.field("embedding").type.list_size
    emb = np.zeros((n, dim), np.float32)
    tier = np.full(n, TIER_NONE, np.int64)
    age = np.full(n, np.nan)
    count = np.zeros(n, np.int32)
    emb_all = served.column("embedding").combine_chunks().flatten().to_numpy().reshape(-1, dim)
    emb[m.row] = emb_all[m.srow]
    tier[m.row] = served.column("tier").to_numpy()[m.srow]
    age[m.row] = served.column("age_s").to_numpy(zero_copy_only=False)[m.srow] / 3600.0
    count[m.row] = served.column("n_behind").to_numpy()[m.srow]
    return emb, tier, age, count


def build_table_like(tab: Table, served: pa.Table) -> Table:
    """``tab`` with the served inputs of another replay of the same rows (a budget or cadence of the curves)."""
    from dataclasses import replace
    key = pd.DataFrame({"user_id": tab.users, "item_id": tab.items, "ts": tab.ts, "row": np.arange(len(tab.users))})
    emb, tier, age, count = _served_arrays(key, served)
    return replace(tab, served_emb=emb, served_tier=tier, served_age_h=age, served_n=count)


def fm_outputs(data, fm_path, ae_path, protocol, cache: Path, fm_factory: str | None = None) -> dict:
    """The FM's logit and its autoencoder code at each row's own time, for every row of [t1, t3) (the oracle, KD's
    soft labels and the FM's own test loss); cached per FM and AE version."""
    import torch

    from models import load_checkpoint
    from solaris_jobs.learning.training import predict
    from solaris_jobs.pipeline.model_refs import load_fm
    fm, fm_meta = load_fm(fm_path, fm_factory)
    ae, ae_meta = load_checkpoint(ae_path, kind="ae")
    path = (Path(cache) / f"fm_outputs-{fm_meta['model_version']}-{ae_meta['model_version']}"
            f"-{code_version(VARIANT_CODE)}.npz")
    t1_us = protocol.t1.value // 1000
    if path.exists():
        z = np.load(path)
        return {k: z[k] for k in z.files}
    ex = [p.subset(p.ts >= t1_us) for p in (data.train, data.valid, data.test)]
    t0 = time.perf_counter()
    outs = [predict(fm, e, batch_size=2048, outputs=("logit", "h")) for e in ex]
    with torch.inference_mode():
        codes = [ae.encode(torch.from_numpy(o["h"])).numpy() for o in outs]
    res = {"users": np.concatenate([e.users for e in ex]), "items": np.concatenate([e.items for e in ex]),
           "ts": np.concatenate([e.ts for e in ex]),
           "logit": np.concatenate([o["logit"] for o in outs]).astype(np.float32),
           "code": np.concatenate(codes).astype(np.float32)}
    logger.info("FM outputs for %d rows in %.0fs", len(res["ts"]), time.perf_counter() - t0)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **res)
    tmp.replace(path)
    return res


def _fit_one(tab: Table, variant: str, params: dict, seed: int, epochs: int, batch_size: int):
    import torch

    from models import VMConfig, VerticalModel
    from solaris_jobs.core.model_inputs import Arrays
    from solaris_jobs.learning import training
    a, fm_dim = tab.inputs(variant)
    arr = Arrays(a, tab.labels)
    data = SimpleNamespace(train=arr.subset(tab.split == 0), valid=arr.subset(tab.split == 1))
    kd = {k: params[k] for k in ("kd_weight", "kd_temperature") if k in params}
    torch.manual_seed(seed)
    np.random.seed(seed)
    model = VerticalModel(VMConfig(user_side=tab.user_side, item_side=tab.item_side, recency=tab.with_recency,
                                   fm_dim=fm_dim, fm_age=bool(fm_dim), tier_slots=bool(fm_dim),
                                   fm_count=bool(fm_dim), dropout=params["dropout"], **kd))
    model.users.set_tables(*tab.tables["user"])
    model.items.set_tables(*tab.tables["item"])
    cfg = training.TrainConfig(epochs=epochs, batch_size=batch_size, lr=params["lr"],
                               weight_decay=params["weight_decay"], patience=1, seed=seed, device="cpu")
    run = training.fit(model, data, cfg, f"{variant}")
    valid = min(r["valid_bce"] for r in run["history"])
    return model, valid, run, arr


def fingerprint(tab: Table) -> str:
    """A hash of everything a variant's training reads from the table (rows, labels, splits, served inputs)."""
    import hashlib
    h = hashlib.sha256()
    for a in (tab.users, tab.items, tab.ts, tab.labels, tab.split, tab.served_tier, tab.served_emb, tab.served_age_h,
              tab.served_n,
              tab.oracle_emb, tab.fm_logit, *(tab.counters[k] for k in sorted(tab.counters)),
              *(tab.recency[k] for k in sorted(tab.recency)), np.array([tab.with_recency])):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def train_variants(tab: Table, seed: int, epochs: int = 6, batch_size: int = 2048, names=None,
                   params_of: dict | None = None, grid_points: int = GRID_SIZE, cache: Path | None = None) -> dict:
    """Trains each variant over its grid and keeps the point with the best validation BCE.

    Args:
        grid_points: the first this many points of each grid (the same number for every variant; tests use fewer).
        params_of: variant -> fixed hyperparameters (no search; the budget and cadence curves use the headline's
            choice), or a list of them (that grid instead of the variant's own).
        cache: a folder where each variant's chosen model is kept (a checkpoint named by a hash of the table, the
            grid, the seed and the settings) and reused instead of training again.

    Returns:
        {variant: {"params", "valid_bce", "grid": [(params, valid BCE)], "valid_prob" (validation rows),
        "test_prob" (test rows), "model", "seconds"}}.
    """
    import hashlib

    from models import load_checkpoint, save_checkpoint
    from solaris_jobs.core.model_inputs import Arrays
    from solaris_jobs.learning.training import predict
    names = list(names or VARIANTS)
    out: dict = {}
    tab_key = fingerprint(tab) if cache is not None else None
    code = code_version(VARIANT_CODE) if cache is not None else None
    for name in names:
        t0 = time.perf_counter()
        kd, base = VARIANTS[name][3], VARIANTS[name][4]
        if params_of and name in params_of:
            p = params_of[name]
            grid = list(p) if isinstance(p, (list, tuple)) else [p]
        elif kd:
            grid = kd_grid(out[base]["params"] if base in out else BASE_GRID[0], KD_GRID[:grid_points])
        else:
            grid = BASE_GRID[:grid_points]
        path = None
        if cache is not None:
            key = json.dumps({"t": tab_key, "v": name, "g": grid, "s": seed, "e": epochs, "b": batch_size,
                              "c": code}, sort_keys=True)
            path = Path(cache) / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
        if path is not None and path.exists():
            model, meta = load_checkpoint(path, kind="vm")
            rec = meta["extra"]
            a, _ = tab.inputs(name)
            arr = Arrays(a, tab.labels)
            params, valid, epoch, tried = rec["params"], rec["valid_bce"], rec["best_epoch"], rec["grid"]
            logger.info("variant %s (seed %d): reusing %s", name, seed, path)
        else:
            best, tried = None, []
            for params in grid:
                model, valid, run, arr = _fit_one(tab, name, params, seed, epochs, batch_size)
                tried.append({"params": params, "valid_bce": valid})
                if best is None or valid < best[1]:
                    best = (params, valid, model, arr, run["best_epoch"])
            params, valid, model, arr, epoch = best
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                save_checkpoint(model, path, extra={"params": params, "valid_bce": valid, "best_epoch": epoch,
                                                    "grid": tried})
        prob = {k: 1.0 / (1.0 + np.exp(-predict(model, arr.subset(tab.split == s), batch_size=8192)["logit"]
                                        .astype(np.float64))) for k, s in (("valid_prob", 1), ("test_prob", 2))}
        out[name] = {"params": params, "valid_bce": valid, "best_epoch": epoch, "grid": tried, **prob,
                     "model": model,
                     "seconds": round(time.perf_counter() - t0, 1)}
        logger.info("variant %s (seed %d): valid BCE %.5f with %s (%d grid points, %.0fs)", name, seed, valid,
                    json.dumps(params), len(grid), out[name]["seconds"])
    return out


def train_on_served(data, protocol, served: pa.Table, models, out, seed: int = 0, epochs: int = 5,
                    batch_size: int = 8192, grid_points: int = GRID_SIZE) -> dict:
    """The ranker's VM trained on what the store served (the ``solaris`` variant: all tiers, tier and age inputs),
    saved as a checkpoint ``Ranker`` and ``solaris rank`` take (it names the FM and autoencoder it was trained on).

    Args:
        data: ``training.load_dataset(root, cuts=(valid_from, t2))``.
        served: a replay's ``served.parquet`` over ``[t1, t2)`` (or features a ranker logged, in its schema).
        models: the ``ModelSet`` whose embeddings were served.

    Returns:
        The chosen hyperparameters, validation BCE, grid, and the checkpoint's version.
    """
    from models import save_checkpoint
    tab = build_table(data, protocol, served, None)
    fit = train_variants(tab, seed, epochs, batch_size, ["solaris"], grid_points=grid_points)["solaris"]
    shares = {TIERS[k]: float((tab.served_tier[tab.split < 2] == k).mean()) for k in range(len(TIERS))}
    version = save_checkpoint(fit["model"], out, extra={
        "fm_version": models.fm.version, "ae_version": models.ae.version, "trained_on": "served features",
        "protocol": protocol.to_dict(), "params": fit["params"], "valid_bce": fit["valid_bce"],
        "tier_shares": shares})
    return {"model_version": version, "params": fit["params"], "valid_bce": fit["valid_bce"],
            "tier_shares_of_training_rows": shares,
            "grid": fit["grid"], "seconds": fit["seconds"]}
