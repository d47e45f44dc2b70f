"""Training: determinism under a seed, and learning on real MovieLens-100K (several seeds)."""
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

from models import load_checkpoint
from solaris_jobs.learning import training

SMALL_FM = dict(d_model=32, n_layers=1)


def test_training_is_deterministic_under_a_seed(synth_root, tmp_path):
    data = training.load_dataset(str(synth_root), history_len=10)
    cfg = training.TrainConfig(epochs=1, seed=3, history_len=10, device="cpu")
    a = training.train_fm(data, tmp_path / "a.pt", cfg, d_model=16, n_layers=1, d_interaction=32)
    b = training.train_fm(data, tmp_path / "b.pt", cfg, d_model=16, n_layers=1, d_interaction=32)
    assert a["model_version"] == b["model_version"] and a["test_bce"] == b["test_bce"]
    c = training.train_fm(data, tmp_path / "c.pt", training.TrainConfig(epochs=1, seed=4, history_len=10),
                          d_model=16, n_layers=1, d_interaction=32)
    assert c["model_version"] != a["model_version"]


def test_an_interrupted_fm_training_resumes_to_the_uninterrupted_model(synth_root, tmp_path, monkeypatch):
    """Stopped in its second epoch (after the first epoch's state was saved), the training resumes from that
    state and ends on the model an uninterrupted run gives, bit for bit; another key starts over."""
    data = training.load_dataset(str(synth_root), history_len=10, max_train_rows=4_000)
    cfg = training.TrainConfig(epochs=2, seed=3, history_len=10, device="cpu", patience=2,
                               max_train_rows=4_000)
    kw = dict(d_model=16, n_layers=1, d_interaction=32, target_user=True)
    whole = training.train_fm(data, tmp_path / "whole.pt", cfg, resume_key="k", **kw)
    assert not (tmp_path / "whole.pt.resume").exists()
    evaluate, calls = training.evaluate, []

    def stop_in_epoch_two(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return evaluate(*a, **k)

    monkeypatch.setattr(training, "evaluate", stop_in_epoch_two)
    with pytest.raises(KeyboardInterrupt):
        training.train_fm(data, tmp_path / "cut.pt", cfg, resume_key="k", **kw)
    monkeypatch.setattr(training, "evaluate", evaluate)
    assert (tmp_path / "cut.pt.resume").exists() and not (tmp_path / "cut.pt").exists()
    resumed = training.train_fm(data, tmp_path / "cut.pt", cfg, resume_key="k", **kw)
    assert resumed["model_version"] == whole["model_version"]
    assert [r["valid_bce"] for r in resumed["history"]] == [r["valid_bce"] for r in whole["history"]]
    # A state saved under another key (other data, settings or code) is not resumed from.
    monkeypatch.setattr(training, "evaluate", stop_in_epoch_two)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        training.train_fm(data, tmp_path / "other.pt", cfg, resume_key="k", **kw)
    monkeypatch.setattr(training, "evaluate", evaluate)
    other = training.train_fm(data, tmp_path / "other.pt", replace(cfg, seed=4), resume_key="k2", **kw)
    assert len(other["history"]) == 2 and other["model_version"] != whole["model_version"]


@pytest.fixture(scope="module")
def movielens_runs(movielens_root, tmp_path_factory):
    """FM, AE and VM for two seeds (the FM-vs-VM gap against the seed spread) and VM+KD, VM+embedding for the
    first (suite time: they are the costliest) on the 80/10/10 time split of MovieLens-100K."""
    out = tmp_path_factory.mktemp("ml_models")
    runs = []
    for seed in (0, 1):
        data = training.load_dataset(str(movielens_root), history_len=30, seed=seed)
        fm_cfg = training.TrainConfig(epochs=2, seed=seed, history_len=30, patience=1)
        vm_cfg = training.TrainConfig(epochs=6, seed=seed, history_len=30, patience=2)
        d = out / f"s{seed}"
        r = {"fm": training.train_fm(data, d / "fm.pt", fm_cfg, **SMALL_FM)}
        r["ae"] = training.train_ae(data, d / "fm.pt", d / "ae.pt", fm_cfg)
        r["vm"] = training.train_vm(data, d / "vm.pt", vm_cfg)
        if seed == 0:
            r["kd"] = training.train_vm(data, d / "kd.pt", vm_cfg, mode="kd", fm_path=d / "fm.pt")
            r["tr"] = training.train_vm(data, d / "tr.pt", vm_cfg, mode="transfer", fm_path=d / "fm.pt",
                                        ae_path=d / "ae.pt")
        r["dir"] = d
        runs.append(r)
    return runs


def test_fm_beats_vm_and_both_beat_base_rate_on_movielens(movielens_runs):
    mean = lambda k: np.mean([r[k]["test_bce"] for r in movielens_runs])
    base = movielens_runs[0]["fm"]["base_rate"]["test_bce"]
    assert 0.68 < base < 0.69                      # DESIGN.md: test base-rate BCE 0.686
    for r in movielens_runs:
        assert r["fm"]["test_bce"] < base and r["vm"]["test_bce"] < base
        assert r["fm"]["test_auc"] > 0.7 and r["vm"]["test_auc"] > 0.65
    # The FM is better than the VM by more than the seed-to-seed spread measured here (the range of each model's
    # test BCE over the two seeds), and by at least 0.005 (DESIGN.md: 3-4% on this split).
    bce = {k: [r[k]["test_bce"] for r in movielens_runs] for k in ("fm", "vm")}
    spread = max(np.ptp(bce["fm"]), np.ptp(bce["vm"]))
    assert mean("vm") - mean("fm") > max(spread, 0.005), bce
    split = movielens_runs[0]["fm"]["split"]
    assert (split["train_rows"], split["test_rows"]) == (79_999, 10_000)


def test_fm_embedding_transfers_to_the_vm(movielens_runs):
    for r in movielens_runs:
        assert r["ae"]["test_explained_variance"] > 0.6
    r = movielens_runs[0]
    assert r["tr"]["fm_version"] == r["fm"]["model_version"]
    assert r["kd"]["test_bce"] < r["kd"]["base_rate"]["test_bce"]
    tr = training.transfer_ratio(r["vm"]["test_bce"], r["tr"]["test_bce"], r["fm"]["test_bce"])
    assert tr > 0.3, f"transfer ratio at full coverage {tr:.2f}"
    # The checkpoint carries what rebuilds it and the model versions it depends on.
    vm, meta = load_checkpoint(movielens_runs[0]["dir"] / "tr.pt", kind="vm")
    assert vm.cfg.fm_dim == 32 and meta["extra"]["fm_version"] == movielens_runs[0]["fm"]["model_version"]


def test_transfer_needs_an_autoencoder_of_the_same_fm(movielens_runs, movielens_root, tmp_path):
    data = training.load_dataset(str(movielens_root), history_len=30)
    a, b = movielens_runs
    with pytest.raises(ValueError, match="was trained on FM"):
        training.train_vm(data, tmp_path / "x.pt", training.TrainConfig(epochs=1, history_len=30),
                          mode="transfer", fm_path=a["dir"] / "fm.pt", ae_path=b["dir"] / "ae.pt")


def test_training_applies_the_event_contract_and_refuses_ambiguous_side_tables(synth_root, tmp_path):
    """Rows the refresh would set aside (bad ids, a label that is not 0/1, a time far in the future) are set aside
    by training too, counted per reason: rows read = rows trained on + rows set aside. A side table with a
    duplicated id is an error naming the file, column and values."""
    import shutil

    import pandas as pd
    import pyarrow.parquet as pq

    from solaris_jobs.core import events as ev
    root = tmp_path / "data"
    shutil.copytree(synth_root, root)
    clean = training.load_dataset(str(root), history_len=5)
    n_clean = len(clean.train) + len(clean.valid) + len(clean.test)
    t = pd.Timestamp(clean.cuts[0], unit="us", tz="UTC")
    bad = pd.DataFrame({"user_id": [1, 0, 2, 3], "item_id": [1, 1, 1, 2], "label": [7, 1, 0, 1],
                        "event_timestamp": [t, t, pd.Timestamp.now(tz="UTC") + pd.Timedelta(days=30), t]})
    ev.write_events(bad.astype({"label": "int8"}), root, part="bad")
    data = training.load_dataset(str(root), history_len=5)
    assert data.rows["events_set_aside"] == {"label is not 0, 1 or null": 1, "user_id is null or <= 0": 1,
                                             ev.FUTURE_REASON: 1}
    used = len(data.train) + len(data.valid) + len(data.test)
    assert used == n_clean + 1 and data.rows["events_read"] == used + 3
    assert set(data.train.label.tolist() + data.valid.label.tolist() + data.test.label.tolist()) <= {-1.0, 0.0, 1.0}
    users = pq.read_table(root / "users.parquet").to_pandas()
    pq.write_table(pa.Table.from_pandas(pd.concat([users, users.head(2)]), preserve_index=False),
                   root / "users.parquet")
    dup = sorted(users.user_id.head(2).tolist())
    with pytest.raises(ev.DataContractError, match=rf"users\.parquet: column user_id has 2 duplicated values, "
                                                   rf"e\.g\. \[{dup[0]}, {dup[1]}\]"):
        training.load_dataset(str(root), history_len=5)


def test_hashed_int64_ids_train_the_same_model_with_one_row_per_id(synth_root, tmp_path):
    """Sparse or hashed int64 ids (the contract allows any positive int64) get one embedding row per distinct id,
    not one per possible id (2**40 rows would not fit): mapping every id through an order-keeping hash trains the
    same model as the dense ids, and the checkpoint maps ids at inference the same way."""
    import shutil

    import pyarrow.parquet as pq
    import torch

    from models import batch_to_tensors
    from solaris_jobs.core import events as ev
    hashed = tmp_path / "hashed"
    shutil.copytree(synth_root, hashed)
    hu = lambda u: u * 2**33 + 5
    hi = lambda i: i * 2**31 + 3
    shutil.rmtree(hashed / "events")
    t = ev.read_events(synth_root).to_pandas()
    ev.write_events(t.assign(user_id=hu(t.user_id), item_id=hi(t.item_id)), hashed)
    for name, key, f in (("users", "user_id", hu), ("items", "item_id", hi)):
        side = pq.read_table(synth_root / f"{name}.parquet").to_pandas()
        pq.write_table(pa.Table.from_pandas(side.assign(**{key: f(side[key])}), preserve_index=False),
                       hashed / f"{name}.parquet")
    cfg = training.TrainConfig(epochs=1, seed=3, history_len=10, device="cpu")
    dense = training.load_dataset(str(synth_root), history_len=10)
    sparse = training.load_dataset(str(hashed), history_len=10)
    assert sparse.user_side["sparse"] and sparse.user_side["n_ids"] == dense.user_side["n_ids"] <= 301
    a = training.train_fm(dense, tmp_path / "a.pt", cfg, d_model=16, n_layers=1, d_interaction=32)
    b = training.train_fm(sparse, tmp_path / "b.pt", cfg, d_model=16, n_layers=1, d_interaction=32)
    assert a["test_bce"] == b["test_bce"] and a["test_auc"] == b["test_auc"]
    fa, fb = load_checkpoint(tmp_path / "a.pt")[0], load_checkpoint(tmp_path / "b.pt")[0]
    rows = np.arange(min(len(dense.test), 500))
    ba, bb = dense.test.batch(rows), sparse.test.batch(rows)
    assert (bb["user"] == hu(ba["user"])).all() and (bb["item"] == hi(ba["item"])).all()
    with torch.inference_mode():
        np.testing.assert_array_equal(fa(batch_to_tensors(ba))["h"].numpy(), fb(batch_to_tensors(bb))["h"].numpy())
        # An id the model never saw is unknown (row 0), as a dense id past the table is.
        unseen = dict(bb, user=np.full_like(bb["user"], 2**41 + 1))
        known0 = dict(ba, user=np.zeros_like(ba["user"]))
        np.testing.assert_array_equal(fb(batch_to_tensors(unseen))["h"].numpy(),
                                      fa(batch_to_tensors(known0))["h"].numpy())
