"""What one seed's trained variants score on its test rows: BCE, AUC and TR with paired-bootstrap intervals over
users, overall, per tier served and per segment; the secondary training window; the post-hoc KD grid check.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import pyarrow as pa

from solaris_jobs.core.contract import TIERS
from solaris_jobs.data import synth
from solaris_jobs.evaluation import metrics, variants
from solaris_jobs.evaluation.replays import SeedContext
from solaris_jobs.evaluation.windows import ceiling_and_segments, coverage, event_us, tier_shares, within


def probs(tab, fits: dict) -> dict:
    """Test probabilities of every variant, the FM, and the base rate (the training rows' positive rate)."""
    test = tab.split == 2
    p = {k: v["test_prob"] for k, v in fits.items()}
    p["fm"] = 1.0 / (1.0 + np.exp(-tab.fm_logit[test].astype(np.float64)))
    train = tab.labels[tab.split == 0]
    p["base_rate"] = np.full(int(test.sum()), float(train[train >= 0].mean()))
    return p


def predict(model, t) -> np.ndarray:
    """A trained all-tiers VM's test probabilities on the served inputs of table ``t``."""
    from solaris_jobs.core.model_inputs import Arrays
    from solaris_jobs.learning.training import predict as predict_logits
    a, _ = t.inputs("solaris")
    logit = predict_logits(model, Arrays(a, t.labels).subset(t.split == 2), batch_size=8192)["logit"]
    return 1.0 / (1.0 + np.exp(-logit.astype(np.float64)))


def evaluate_test(ctx: SeedContext, tab, fits: dict, served: pa.Table, every: pd.Timedelta) -> dict:
    """Losses, TRs and coverage of the test rows, overall, per tier and per segment; tier shares of the training
    rows beside the test rows (train on what is served)."""
    P = ctx.protocol
    test = tab.split == 2
    y = tab.labels[test]
    p = probs(tab, fits)
    losses = {k: metrics.row_bce(y, x) for k, x in p.items()}
    users = tab.users[test]
    boot = metrics.PairedBootstrap(users, ctx.cfg.n_boot, seed=ctx.seed)
    summ = lambda mask=None: metrics.summarize_losses(losses, users, y, p, mask=mask, boot=boot, kd="vm_kd",
                                                       solaris="solaris", floor="base_rate")
    out = {"test": summ()}
    tier = tab.served_tier[test]
    out["per_tier"] = {name: summ(tier == k) for k, name in enumerate(TIERS)}
    extra = ceiling_and_segments(ctx.events, P, served, every)
    returning = _returning(tab, served, extra)
    out["segments"] = _segments(tab, summ, returning)
    s_ts = event_us(served)
    out["coverage"] = {"test": coverage(served, within(s_ts, P.t2, P.t3), extra, P, every),
                       "served_training": coverage(served, within(s_ts, P.t1, P.t2), extra, P, every)}
    out["tier_shares_side_by_side"] = {
        "training rows [t0, valid_from)": tier_shares(tab.served_tier[tab.split == 0]),
        "validation rows [valid_from, t2)": tier_shares(tab.served_tier[tab.split == 1]),
        "test rows [t2, t3)": tier_shares(tier)}
    out["returning_test_users"] = int(len(np.unique(users[returning])))
    out["headroom"] = headroom(ctx.root, tab, y, losses)
    return out


def tier_values(tab, fits: dict, split: int, n_boot: int, seed: int, with_: str = "solaris",
                without: str = "tiers_only") -> dict | None:
    """Each fallback's worth beyond its flag: per tier, on the rows ``split`` (1 validation, 2 test) served from it,
    ``BCE(without) - BCE(with_)``: the all-tiers VM against the equal-input VM whose served codes are zeroed (tier
    flags, ages and counts kept), with a paired bootstrap over users. A tier carries value where the interval's
    lower bound is above 0. None without both variants.

    Returns:
        {tier: {"value", "ci", "rows", "users", "carries_value", "quantiles"}} for every tier that serves an
        embedding (none excluded).
    """
    if with_ not in fits or without not in fits:
        return None
    key = {1: "valid_prob", 2: "test_prob"}[split]
    rows = tab.split == split
    known = tab.labels[rows] >= 0            # the last label_delay before t2 has no label yet
    y, users, tier = tab.labels[rows][known], tab.users[rows][known], tab.served_tier[rows][known]
    gain = metrics.row_bce(y, fits[without][key][known]) - metrics.row_bce(y, fits[with_][key][known])
    boot = metrics.PairedBootstrap(users, n_boot, seed=seed)
    out = {}
    for k, name in enumerate(TIERS[:-1]):
        m = tier == k
        if not m.any():
            out[name] = {"value": None, "ci": None, "rows": 0, "users": 0, "carries_value": False, "quantiles": []}
            continue
        samples = boot.mean(gain, m)
        ci = metrics.interval(samples)
        out[name] = {"value": float(gain[m].mean()), "ci": list(ci), "rows": int(m.sum()),
                     "users": int(len(np.unique(users[m]))), "carries_value": bool(ci[0] > 0),
                     "quantiles": metrics.quantiles(samples)}
    return out


def headroom(root, tab, y: np.ndarray, losses: dict) -> dict | None:
    """The achievable test BCE (that of the probabilities the labels were drawn from: synthetic data only, None
    elsewhere) and the share of the headroom each model reaches: above the VM, ``(BCE(VM) - BCE(X)) / (BCE(VM) -
    achievable)``, and above the base rate likewise. Reported, never used to choose anything.

    Raises:
        ValueError: a test row has no true probability (the data set's ``truth/`` does not match its log).
    """
    test = tab.split == 2
    try:
        p = synth.read_truth(root, tab.users[test], tab.items[test], tab.ts[test])
    except FileNotFoundError:
        return None
    if not np.isfinite(p).all():
        raise ValueError(f"{root}: {int((~np.isfinite(p)).sum())} of {len(p)} test rows have no true click "
                         f"probability in {synth.TRUTH_DIR}/")
    best = float(metrics.row_bce(y, p).mean())
    bce = {k: float(v.mean()) for k, v in losses.items()}
    share = lambda ref: {k: (bce[ref] - v) / (bce[ref] - best) if bce[ref] > best else None for k, v in bce.items()}
    return {"achievable_bce": best, "bce": bce, "share_above_vm": share("vm"),
            "share_above_base_rate": share("base_rate")}


def _returning(tab, served: pa.Table, extra: dict) -> np.ndarray:
    """Whether each test row's user was seen before t2: the served table's per-row flags aligned with the table's
    test rows (same keys)."""
    test = tab.split == 2
    key_s = pd.DataFrame({"u": served.column("user_id").to_numpy(), "i": served.column("item_id").to_numpy(),
                          "t": event_us(served), "ret": extra["returning"], "ceil": extra["ceiling"]}).drop_duplicates(
        ["u", "i", "t"])
    key_t = pd.DataFrame({"u": tab.users[test], "i": tab.items[test], "t": tab.ts[test]}).merge(
        key_s, on=["u", "i", "t"], how="left")
    return key_t["ret"].fillna(False).to_numpy(bool)


def _segments(tab, summ, returning: np.ndarray) -> dict:
    """``summ`` of the test rows of returning and new users, by history length, and of the pair tier's rows by
    the age of the embedding served (how staleness costs)."""
    test = tab.split == 2
    tier = tab.served_tier[test]
    hist = tab.counters["user_cnt"][test]
    age = tab.served_age_h[test]
    return {"returning users": summ(returning), "new users": summ(~returning),
            "history 0": summ(hist == 0), "history 1-49": summ((hist >= 1) & (hist < 50)),
            "history 50+": summ(hist >= 50),
            **{f"pair, age {lo:g}-{hi:g} h": summ((tier == 0) & (age >= lo) & (age < hi))
               for lo, hi in ((0, 1), (1, 4), (4, 12), (12, 48))}}


def secondary(ctx: SeedContext, tab, served: pa.Table, every: pd.Timedelta, names) -> dict:
    """The variants trained on [t1, valid_from) only (no rows from before the replay), the same test rows: the
    secondary result the protocol asks for beside the headline's [t0, valid_from)."""
    t1_us = ctx.protocol.t1.value // 1000
    only = replace(tab, split=np.where((tab.split == 0) & (tab.ts < t1_us), -1, tab.split).astype(np.int8))
    fits = variants.train_variants(only, ctx.seed, ctx.cfg.vm_epochs, ctx.cfg.vm_batch_size, names=names,
                                   grid_points=ctx.cfg.grid_points, cache=ctx.out / "vm_cache")
    ev = evaluate_test(ctx, only, fits, served, every)
    return {"training_rows": "[t1, valid_from)", "rows": int((only.split == 0).sum()), "test": ev["test"],
            "per_tier": ev["per_tier"]}


OLD_COMPARISON = ("vm", "vm_kd", "solaris")


def without_recency(ctx: SeedContext, tab) -> dict:
    """The comparison before #40, reported once beside the headline (the first seed): VM, VM + KD and the all-tiers
    VM with the lifetime counters only (no log-derived recency inputs: ``Table.with_recency`` False), the same rows,
    grids and test rows; BCE, dBCE and TR with the same paired bootstrap, and both criteria."""
    old = replace(tab, with_recency=False)
    fits = variants.train_variants(old, ctx.seed, ctx.cfg.vm_epochs, ctx.cfg.vm_batch_size, names=OLD_COMPARISON,
                                   grid_points=ctx.cfg.grid_points, cache=ctx.out / "vm_cache")
    test = tab.split == 2
    y, users = tab.labels[test], tab.users[test]
    p = probs(tab, fits)
    losses = {k: metrics.row_bce(y, x) for k, x in p.items()}
    boot = metrics.PairedBootstrap(users, ctx.cfg.n_boot, seed=ctx.seed)
    return {"inputs": "lifetime counters only (no recency inputs)", "variants": list(OLD_COMPARISON),
            "test": metrics.summarize_losses(losses, users, y, p, boot=boot, kd="vm_kd", solaris="solaris",
                                             floor="base_rate"),
            "chosen": {k: {"params": v["params"], "valid_bce": v["valid_bce"]} for k, v in fits.items()}}


def kd_grid_check(ctx: SeedContext, tab, fits: dict) -> dict:
    """Post hoc (not a headline setting): VM + KD also trained on ``variants.KD_CHECK_GRID`` (weights and
    temperatures below and between the headline grid's best corner), on the base hyperparameters VM chose; the best
    of both grids on validation, its test BCE and TR, and the 1.5x criterion of the all-tiers VM against it. Says
    whether the headline's KD was under-tuned; the headline numbers stay as they were run."""
    cfg = ctx.cfg
    grid = variants.kd_grid(fits["vm"]["params"], variants.KD_CHECK_GRID[:cfg.grid_points])
    ext = variants.train_variants(tab, ctx.seed, cfg.vm_epochs, cfg.vm_batch_size, ["vm_kd"], {"vm_kd": grid},
                                  cache=ctx.out / "vm_cache")["vm_kd"]
    head = fits["vm_kd"]
    best = ext if ext["valid_bce"] < head["valid_bce"] else head
    test = tab.split == 2
    y, users = tab.labels[test], tab.users[test]
    p = {**probs(tab, fits), "vm_kd_best": best["test_prob"]}
    losses = {k: metrics.row_bce(y, p[k]) for k in ("vm", "fm", "solaris", "vm_kd", "vm_kd_best", "base_rate")}
    boot = metrics.PairedBootstrap(users, cfg.n_boot, seed=ctx.seed)
    summ = metrics.summarize_losses(losses, users, y, p, boot=boot, kd="vm_kd_best", solaris="solaris",
                                    floor="base_rate")
    return {"grid": ext["grid"], "headline_grid_best": {"params": head["params"], "valid_bce": head["valid_bce"]},
            "best": {"params": best["params"], "valid_bce": best["valid_bce"],
                     "from": "check grid" if best is ext else "headline grid"},
            "variants": {k: summ["variants"][k] for k in ("vm_kd", "vm_kd_best", "solaris")}, "gap": summ["gap"],
            "criterion": summ["criterion"] and {**summ["criterion"], "kd": "vm_kd_best"}, "seconds": ext["seconds"]}


@dataclass(frozen=True)
class ScoredRows:
    """A seed's test rows as the curves score them: labels, users, every variant's probabilities and the paired
    bootstrap over the users."""
    y: np.ndarray
    users: np.ndarray
    probs: dict
    boot: metrics.PairedBootstrap

    @classmethod
    def of(cls, ctx: SeedContext, tab, fits: dict) -> "ScoredRows":
        test = tab.split == 2
        return cls(tab.labels[test], tab.users[test], probs(tab, fits),
                   metrics.PairedBootstrap(tab.users[test], ctx.cfg.n_boot, seed=ctx.seed))

    def with_solaris(self, solaris_prob: np.ndarray, mask: np.ndarray | None = None) -> dict:
        """``metrics.summarize_losses`` of the rows in ``mask`` with the all-tiers VM's probabilities replaced by
        ``solaris_prob``."""
        p = {**self.probs, "solaris": solaris_prob}
        losses = {k: metrics.row_bce(self.y, p[k]) for k in ("vm", "fm", "solaris", "vm_kd", "base_rate")}
        return metrics.summarize_losses(losses, self.users, self.y, p, mask=mask, boot=self.boot, kd="vm_kd",
                                        solaris="solaris", floor="base_rate")
