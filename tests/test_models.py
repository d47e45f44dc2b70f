"""Model shapes, checkpoint round trip and determinism (pure torch, small inputs)."""
import numpy as np
import pytest
import torch

from solaris_jobs.core.contract import RECENCY_INPUTS, RECENCY_MINUTES, TIER_NONE
from models import (AEConfig, Autoencoder, FMConfig, FoundationModel, TIERS, VMConfig, VerticalModel,
                    batch_to_tensors, load_checkpoint, save_checkpoint)

USER_SIDE = {"n_ids": 6, "categorical": {"segment": 3}, "multi": {}}
ITEM_SIDE = {"n_ids": 9, "categorical": {"category": 4}, "multi": {"genres": [5, 2]}}


def _batch(B=5, L=4, seed=0):
    rng = np.random.default_rng(seed)
    hist = rng.integers(0, 9, (B, L))
    hist[0] = 0                                     # a user with no history at all
    return batch_to_tensors({
        "user": rng.integers(1, 8, B),              # includes ids beyond the vocabulary (unknown)
        "item": rng.integers(1, 9, B), "hist_item": hist,
        "hist_signal": np.where(hist > 0, rng.integers(1, 8, (B, L)), 0),
        "hist_gap": np.where(hist > 0, rng.integers(1, 33, (B, L)), 0),
        "label": rng.integers(0, 2, B).astype(np.float32), "rating": rng.integers(0, 6, B).astype(np.float32),
        **{k: rng.integers(0, 5, B).astype(np.float32) for k in
           ["user_cnt", "user_known", "user_pos", "item_cnt", "item_known", "item_pos"]},
        # the recency inputs; NaN minutes = never shown (the first row's pair, item and user)
        **{k: np.where(np.arange(B) == 0, np.nan, rng.uniform(0, 3000, B)) if k in RECENCY_MINUTES
           else rng.integers(0, 4, B).astype(np.float32) for k in RECENCY_INPUTS},
    })


def _fm():
    torch.manual_seed(0)
    fm = FoundationModel(FMConfig(user_side=USER_SIDE, item_side=ITEM_SIDE, history_len=4, d_model=16,
                                  n_heads=2, n_layers=1, d_interaction=24))
    fm.items.set_tables(np.arange(9)[:, None] % 4, {"genres": np.tile([[1, 4]], (9, 1))})
    return fm.eval()


def test_forward_shapes_and_no_nan_for_empty_history():
    fm, b = _fm(), _batch()
    out = fm(b)
    assert out["logit"].shape == (5,) and out["rating"].shape == (5,) and out["h"].shape == (5, 24)
    assert torch.isfinite(out["h"]).all() and ((out["rating"] >= 1) & (out["rating"] <= 5)).all()
    u = fm.user_embedding(b)
    assert u.shape == (5, 32) and torch.allclose(u.norm(dim=-1), torch.ones(5), atol=1e-5)
    assert torch.isfinite(fm.loss(out, b))
    ae = Autoencoder(AEConfig(d_in=24, d_code=8, d_hidden=16))
    code, rec = ae(out["h"])
    assert code.shape == (5, 8) and rec.shape == (5, 24)
    with pytest.raises(ValueError, match="no user coder"):
        ae.encode_user(u)
    ae = Autoencoder(AEConfig(d_in=24, d_code=8, d_hidden=16, d_user=32))     # the user coder: user embedding -> D
    assert ae.encode_user(u).shape == (5, 8) and torch.isfinite(ae.user.loss(u))
    vm = VerticalModel(VMConfig(user_side=USER_SIDE, item_side=ITEM_SIDE, fm_dim=8))
    assert vm(b)["logit"].shape == (5,) and torch.isfinite(vm(b)["logit"]).all()  # no fm_emb: zeros, tier none
    with_emb = vm({**b, "fm_emb": code.detach(), "tier": torch.zeros(5, dtype=torch.long)})["logit"]
    assert with_emb.shape == (5,) and len(TIERS) == 6


def test_each_tier_has_its_own_slot_and_the_count_behind_it_is_an_input():
    """With ``tier_slots`` the same embedding served as a pair code and as a user aggregate goes through different
    first-layer weights: zeroing the pair slot's weights removes the embedding's effect on pair rows only; the
    count behind a served row moves the logit, and is ignored on tier none."""
    b = _batch()
    torch.manual_seed(0)
    vm = VerticalModel(VMConfig(user_side=USER_SIDE, item_side=ITEM_SIDE, fm_dim=3, tier_slots=True, fm_count=True))
    vm.eval()
    emb = torch.randn(5, 3)
    tier = torch.tensor([0, 0, 1, 1, TIER_NONE])
    count = torch.tensor([1.0, 1.0, 7.0, 7.0, 0.0])
    base = {**b, "fm_emb": emb, "tier": tier, "fm_count": count}
    first = vm.mlp[0]
    start = first.in_features - ((len(TIERS) - 1) * 3 + len(TIERS) + 1)       # the FM inputs come last: slots, one-hot, count
    with torch.no_grad():
        first.weight[:, start:start + 3] = 0.0                    # the pair slot
    zeroed = vm({**base, "fm_emb": torch.zeros(5, 3)})["logit"]
    got = vm(base)["logit"]
    assert torch.equal(got[:2], zeroed[:2]) and not torch.isclose(got[2:4], zeroed[2:4]).any()
    assert torch.equal(got[4], zeroed[4])                          # tier none: zeros whatever was passed
    more = vm({**base, "fm_count": count * 3})["logit"]
    assert not torch.isclose(more[2:4], got[2:4]).any() and torch.equal(more[4], got[4])


def test_checkpoint_round_trip_rebuilds_the_same_model(tmp_path):
    fm, b = _fm(), _batch()
    version = save_checkpoint(fm, tmp_path / "fm.pt", extra={"note": 1})
    loaded, meta = load_checkpoint(tmp_path / "fm.pt", kind="fm")
    assert meta["model_version"] == version and version.startswith("fm-") and meta["extra"] == {"note": 1}
    assert meta["config"]["d_interaction"] == 24
    with torch.inference_mode():
        assert torch.equal(loaded(b)["h"], fm(b)["h"])
    assert torch.equal(loaded.items.multi_genres, fm.items.multi_genres)     # side tables travel along
    vm = VerticalModel(VMConfig(user_side=USER_SIDE, item_side=ITEM_SIDE, hidden=(8,), kd_weight=0.5))
    save_checkpoint(vm, tmp_path / "vm.pt")
    vm2, meta = load_checkpoint(tmp_path / "vm.pt")
    assert vm2.cfg == vm.cfg and meta["kind"] == "vm"
    with pytest.raises(ValueError, match="holds a 'vm' model, expected 'fm'"):
        load_checkpoint(tmp_path / "vm.pt", kind="fm")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_bad_checkpoints_give_a_clear_error_and_run_no_code(tmp_path):
    import pickle

    from models import CheckpointError
    from models.checkpoint import FORMAT
    fm = _fm()
    good = tmp_path / "fm.pt"
    save_checkpoint(fm, good, extra={"metrics": {"bce": np.float64(0.5)}})       # numpy scalars stored as floats
    assert load_checkpoint(good)[1]["extra"] == {"metrics": {"bce": 0.5}}
    state = torch.load(good, weights_only=True)
    assert state["format"] == FORMAT

    def bad(name, obj=None, raw=None):
        p = tmp_path / name
        if raw is not None:
            p.write_bytes(raw)
        else:
            torch.save(obj, p)
        return p

    cases = {
        bad("truncated.pt", raw=good.read_bytes()[:1000]): r"truncated\.pt: not a readable SOLARIS checkpoint",
        bad("text.pt", raw=b"not a checkpoint"): r"text\.pt: not a readable SOLARIS checkpoint",
        bad("newer.pt", {**state, "format": FORMAT + 1}): rf"newer\.pt: checkpoint format {FORMAT + 1} is newer",
        bad("unversioned.pt", {k: v for k, v in state.items() if k != "format"}):
            rf"unversioned\.pt: checkpoint format None is not the one this code reads \({FORMAT}\)",
        bad("fields.pt", {**state, "config": {**state["config"], "n_experts": 4}}):
            r"fields\.pt: fm config fields \['n_experts'\] are unknown to this code version",
        bad("shape.pt", {**state, "config": {**state["config"], "d_model": state["config"]["d_model"] * 2}}):
            r"shape\.pt: its weights do not fit this code's fm model",
        bad("other.pt", {"weights": 1}): r"other\.pt: not a SOLARIS checkpoint",
        # A pickle that would run code when loaded with weights_only=False.
        bad("code.pt", raw=pickle.dumps(_Boom(tmp_path / "boom"))): r"code\.pt: not a readable SOLARIS checkpoint",
    }
    for path, msg in cases.items():
        with pytest.raises(CheckpointError, match=msg):
            load_checkpoint(path)
    assert not (tmp_path / "boom").exists()
    with pytest.raises(FileNotFoundError, match="missing.pt: no checkpoint there"):
        load_checkpoint(tmp_path / "missing.pt")


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import pathlib
        return (pathlib.Path.touch, (self.path,))


def test_version_changes_with_weights():
    fm = _fm()
    from models.checkpoint import model_version
    v1 = model_version(fm)
    with torch.no_grad():
        fm.label_head.bias += 1
    assert model_version(fm) != v1


def test_fm_with_shared_histories_equals_the_repeated_batch():
    """The refresh's inference path: each distinct history encoded once (``rows`` maps batch rows to histories)
    gives the outputs of the batch with every row's history repeated."""
    fm, b = _fm(), _batch(B=7)
    rows = torch.tensor([0, 0, 2, 2, 2, 5, 6])
    hist = {k: b[k] for k in ("hist_item", "hist_signal", "hist_gap")}
    repeated = {**b, **{k: v[rows] for k, v in hist.items()}}
    with torch.inference_mode():
        ref = fm(repeated)
        got = fm(b, rows=rows)               # b's 7 history rows, of which rows reads 0, 2, 5 and 6
        distinct = fm({**b, **{k: v[[0, 2, 5, 6]] for k, v in hist.items()}}, rows=torch.tensor([0, 0, 1, 1, 1, 2, 3]))
    for out in (got, distinct):
        for k in ("logit", "rating", "h"):
            torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(fm(b)["h"], ref["h"])          # the rows do read other histories than b's own


def test_kd_weight_applies_per_soft_labelled_row_on_a_hand_made_case():
    """KD's weight a is the soft label's share of each row that has one (``(1 - a) BCE(label) + a T^2 BCE(soft)``),
    rows without one count their label's BCE, a row with a pending label its soft label only: the mean over rows,
    whatever share of the batch has soft labels (#40)."""
    vm = VerticalModel(VMConfig(recency=False, kd_weight=0.5, kd_temperature=2.0))
    nan = float("nan")
    b = {"label": torch.tensor([1.0, 0.0, 1.0, -1.0, 0.0, 1.0]),
         "fm_logit": torch.tensor([2.0, nan, -1.0, 0.5, nan, nan])}
    x = torch.tensor([0.3, -0.2, 1.0, 0.1, -1.0, 2.0])

    def bce(logit, y):
        p = 1 / (1 + np.exp(-logit))
        return -(y * np.log(p) + (1 - y) * np.log(1 - p))
    soft = lambda z: 1 / (1 + np.exp(-z / 2.0))
    rows = [0.5 * bce(0.3, 1) + 0.5 * 4 * bce(0.15, soft(2.0)), bce(-0.2, 0), 0.5 * bce(1.0, 1) + 2 * bce(0.5, soft(-1.0)),
            2 * bce(0.05, soft(0.5)), bce(-1.0, 0), bce(2.0, 1)]
    assert np.isclose(float(vm.loss({"logit": x}, b)), np.mean(rows), rtol=1e-5)
    # Without soft labels on any row, the label's BCE alone (as with kd_weight 0).
    plain = VerticalModel(VMConfig(recency=False))
    no_soft = {**b, "fm_logit": torch.full((6,), nan)}
    known = b["label"] >= 0
    assert np.isclose(float(vm.loss({"logit": x}, no_soft)), float(plain.loss({"logit": x}, b)), rtol=1e-6)
    assert np.isclose(float(plain.loss({"logit": x}, b)), np.mean([bce(v, y) for v, y, k in
                                                                   zip(x.numpy(), b["label"].numpy(), known) if k]))
