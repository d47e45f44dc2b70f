"""The FM protocol (models.protocol): what SOLARIS needs of an FM, and the refusal of one that breaks it, naming
the FM and the check, before a run writes anything."""
import pytest
import torch

from models import FMConfig, FoundationModel, save_checkpoint
from models.protocol import FMProtocol, FMRefused, check_fm
from solaris_jobs.pipeline import model_refs


def _fm(**kw):
    torch.manual_seed(0)
    return FoundationModel(FMConfig(user_side={"n_ids": 5}, item_side={"n_ids": 5}, history_len=6, d_model=8,
                                    d_interaction=16, n_layers=1, **kw)).eval()


def test_our_fm_keeps_the_protocol_and_a_broken_one_is_refused_naming_the_check(tmp_path):
    fm = _fm(target_user=True)
    assert isinstance(fm, FMProtocol) and (fm.width, fm.user_width, fm.item_width, fm.history_len) == (16, 16, 8, 6)
    check_fm(fm, "ours")

    class Narrow(FoundationModel):                     # declares a width its output does not have
        @property
        def width(self):
            return 32

    class Leaky(FoundationModel):                      # the shared-history path reads another row's history
        def forward(self, b, rows=None):
            return super().forward(b, None if rows is None else rows.flip(0))

    class Headless(torch.nn.Module):                   # no user or item embedding
        width = user_width = item_width = history_len = 4
        mixed_precision = None

        def forward(self, b, rows=None):
            return {}

    class Raising(FoundationModel):                    # fails on its own inputs
        def item_embedding(self, ids):
            raise IndexError("index 3 is out of bounds")

    cfg = _fm().cfg
    for model, message in [(Narrow(cfg).eval(), r"forward h has shape \(6, 16\), not \(6, 32\)"),
                           (Leaky(cfg).eval(), r"forward\(rows=...\) differs"),
                           (Raising(cfg).eval(), r"item_embedding raised IndexError: index 3 is out of bounds"),
                           (Headless(), "not an FM of the protocol.*: user_embedding, item_embedding")]:
        with pytest.raises(FMRefused, match=r"^probe\.pt: " + message):
            check_fm(model, "probe.pt")
    # A checkpoint whose outputs are not finite is refused when a run resolves its models, before anything runs.
    bad = _fm()
    with torch.no_grad():
        bad.trunk[0].weight[0, 0] = float("nan")
    save_checkpoint(bad, tmp_path / "fm.pt")
    with pytest.raises(FMRefused, match=r"fm\.pt: forward h is not finite on a probe batch"):
        model_refs.resolve(tmp_path, ("fm",))
    # A checkpoint written before FM families (no family recorded) is the transformer; an unknown family is refused.
    from models import load_checkpoint
    from models.checkpoint import CheckpointError
    state = torch.load(tmp_path / "fm.pt", weights_only=True)
    for family, path in ((None, tmp_path / "old.pt"), ("rnn", tmp_path / "rnn.pt")):
        torch.save({k: v for k, v in state.items() if k != "family"} | ({"family": family} if family else {}), path)
    assert type(load_checkpoint(tmp_path / "old.pt", kind="fm")[0]) is FoundationModel
    with pytest.raises(CheckpointError, match=r"rnn.pt: FM family 'rnn' is unknown"):
        load_checkpoint(tmp_path / "rnn.pt", kind="fm")


def test_a_second_fm_family_through_the_whole_pipeline(synth_root, spark, tmp_path, monkeypatch):
    """The recurrent family (models/gru4rec.py, no model code shared with ours) is trained by the product's path
    (`solaris train fm --family gru4rec`, as the training DAG does), saved and loaded back as itself; then, with
    no change to any of them: the autoencoder and the verifier, one refresh interval (select, embed, aggregate,
    neighbours), materialize, and reads through FeatureReader and the stock Feast SDK."""
    from click.testing import CliRunner

    from models import load_checkpoint
    from models.gru4rec import GRU4RecFM
    from solaris_jobs.core.settings import TrainSettings
    from solaris_jobs.flows.cli import main
    from solaris_jobs.learning import training
    models = tmp_path / "models"
    res = CliRunner().invoke(main, ["train", "fm", "--data", str(synth_root), "--out", str(models / "fm.pt"),
                                    "--family", "gru4rec", "--epochs", "1", "--history-len", "10", "--d-model", "16",
                                    "--layers", "1", "--d-interaction", "32", "--max-train-rows", "20000"])
    assert res.exit_code == 0, res.output
    fm, meta = load_checkpoint(models / "fm.pt", kind="fm")
    assert type(fm) is GRU4RecFM and meta["family"] == "gru4rec" and meta["model_version"].startswith("fm-")
    assert isinstance(fm, FMProtocol) and (fm.width, fm.user_width, fm.history_len) == (32, 32, 10)
    check_fm(fm, "gru4rec")
    ts = TrainSettings(fm_family="gru4rec", history_len=10, d_model=16, layers=1, d_interaction=32, d_code=8,
                       max_train_rows=20_000)
    data = training.load_dataset(str(synth_root), 10, max_train_rows=20_000)
    ae = training.train_as_product("ae", data, models / "ae.pt", ts, fm_path=models / "fm.pt")
    assert ae["fm_version"] == meta["model_version"] and ae["test_explained_variance"] > 0.5
    training.train_as_product("verifier", data, models / "vm.pt", ts)
    refs = model_refs.resolve(models)
    assert refs.fm.version == meta["model_version"] and refs.history_len == 10
    with pytest.raises(ValueError, match="unknown FM family 'rnn'"):
        training.build_fm(data, training.TrainConfig(), family="rnn")

    # One refresh interval with it, then the store and both readers.
    import numpy as np
    import pandas as pd

    from solaris_jobs.core import offline as layout
    from solaris_jobs.core.settings import Settings
    from solaris_jobs.online import store_config
    from solaris_jobs.online.materialize import materialize
    from solaris_jobs.online.reader import FeatureReader
    from solaris_jobs.pipeline import jobs
    from tests.support import feast_yaml
    from tests.test_online_store import _feast
    start, end = pd.Timestamp("2026-01-07T12:00:00Z"), pd.Timestamp("2026-01-07T13:00:00Z")
    s = Settings(data=str(synth_root), offline=str(tmp_path / "offline"), models=str(models))
    stats = jobs.run(spark, s, start, end)
    assert stats["embed"]["pairs"] > 0 and stats["embed"]["model_version"] == refs.embedding_version
    assert stats["neighbours"]["users_with_state"] > 0 and stats["neighbours"]["users_rejected"] == 0
    cfg = store_config.load(None, feast_yaml(tmp_path / "fs.yaml", f"  type: sqlite\n  path: {tmp_path / 'o.db'}"))
    st = materialize(cfg, s.offline, end, expire_from="write")
    assert st["views"]["pair_embeddings"]["written"] == stats["embed"]["pairs"]
    pairs = layout.read_table(s.offline, "pair_embeddings", end).to_pandas()
    user = int(pairs.user_id.value_counts().index[0])
    mine = pairs[pairs.user_id == user]
    with FeatureReader(cfg, refs.embedding_version, 8, misses=None, tiers=()) as reader:
        f = reader.read(user, mine.item_id.to_numpy(), end + pd.Timedelta(minutes=5))
    assert f.tier_names() == ["pair"] * len(mine)
    np.testing.assert_array_equal(f.embeddings, np.stack(mine.embedding))
    fs = _feast(cfg.yaml_path, s.offline, monkeypatch)
    got = fs.get_online_features(features=["pair_embeddings:embedding"], entity_rows=[
        {"user_id": user, "item_id": int(i)} for i in mine.item_id]).to_dict()["embedding"]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.stack(mine.embedding))


def test_a_users_own_fm_by_its_factory(synth_root, tmp_path):
    """An FM in the user's own file format, named by ``package.module:factory`` (the settings' ``fm_factory``): a
    run resolves it as it is (its version the hash of its weights, its declared training end kept), checks it,
    loads it where the models run, and the autoencoder trains on it; a factory that does not resolve is named."""
    from models.gru4rec import GRU4RecFM, GRUConfig
    from solaris_jobs.core.settings import Settings, TrainSettings
    from solaris_jobs.learning import training
    from tests.support import save_user_fm
    torch.manual_seed(0)
    models = tmp_path / "models"
    models.mkdir()
    data = training.load_dataset(str(synth_root), 10, max_train_rows=5_000)
    fm = GRU4RecFM(GRUConfig(user_side=data.user_side, item_side=data.item_side, history_len=10, d_model=8,
                             d_interaction=16))
    fm.users.set_tables(*data.tables["user"])
    fm.items.set_tables(*data.tables["item"])
    save_user_fm(fm, models / "fm.pt")
    s = Settings(models=str(models), fm_factory="tests.support:user_fm")
    refs = model_refs.of_settings(s, ("fm",))
    assert refs.fm.factory == "tests.support:user_fm" and refs.history_len == 10
    assert refs.fm.version == model_refs.of_settings(s, ("fm",)).fm.version          # stable: a hash of the weights
    loaded, meta, _ = model_refs.load(refs.fm, "cpu", None)
    assert type(loaded).__name__ == "UserFM" and meta["extra"]["trained_until"] == "2026-01-07T00:00:00+00:00"
    ts = TrainSettings(history_len=10, d_code=4, max_train_rows=5_000)
    ae = training.train_as_product("ae", data, models / "ae.pt", ts, fm_path=models / "fm.pt",
                                   fm_factory="tests.support:user_fm")
    assert ae["fm_version"] == refs.fm.version
    with pytest.raises(ValueError, match=r"FM factory 'tests.support:no_such' does not resolve"):
        model_refs.of_settings(Settings(models=str(models), fm_factory="tests.support:no_such"), ("fm",))
    with pytest.raises(ValueError, match="SOLARIS_FM_FACTORY"):
        Settings.from_env({"SOLARIS_FM_FACTORY": "not a spec"}, require=False)


def test_the_recurrent_fm_reads_only_real_events_newest_last():
    """The GRU family's summary of a history: the padding in front of it changes nothing (the same weights read a
    history padded to 5 and to 3 alike), the newest event is the last one read, and an empty history has a state."""
    from models.gru4rec import GRU4RecFM, GRUConfig
    torch.manual_seed(0)
    fm = GRU4RecFM(GRUConfig(user_side={"n_ids": 5}, item_side={"n_ids": 9}, history_len=5, d_model=8,
                             d_interaction=16)).eval()

    def summary(items):
        t = torch.tensor([items])
        return fm.summarise({"hist_item": t, "hist_signal": (t > 0).long(), "hist_gap": (t > 0).long()})
    with torch.no_grad():
        long_last, long_mean = summary([0, 0, 0, 3, 4])
        short_last, short_mean = summary([0, 3, 4])
        assert torch.allclose(long_last, short_last, atol=1e-6) and torch.allclose(long_mean, short_mean, atol=1e-6)
        newest = summary([0, 0, 0, 3, 5])[0]                 # only the newest event differs
        oldest = summary([0, 0, 0, 5, 4])[0]                 # only the oldest differs
        assert not torch.allclose(newest, long_last) and not torch.allclose(oldest, long_last)
        empty_last, empty_mean = summary([0, 0, 0, 0, 0])
        assert torch.isfinite(empty_last).all() and torch.isfinite(empty_mean).all()


def test_models_resolved_through_a_pointer_file_locally_and_on_an_object_store(tmp_path, monkeypatch):
    """A registry's ``current`` as a pointer file (the folder it names, relative to it or a URI), and checkpoints on
    an S3-API store (moto on loopback): resolved once, loaded where the models run through the project's file
    system layer, the same versions as the local files."""
    import pyarrow.fs as pafs

    from models import AEConfig, Autoencoder, VMConfig, VerticalModel
    from solaris_jobs.core import uris
    from tests.support import S3Server
    reg = tmp_path / "registry"
    v1 = reg / "versions" / "v1"
    fm = _fm()
    fm_version = save_checkpoint(fm, v1 / "fm.pt")
    save_checkpoint(Autoencoder(AEConfig(d_in=16, d_code=4, d_user=16)), v1 / "ae.pt", extra={"fm_version": fm_version})
    save_checkpoint(VerticalModel(VMConfig(recency=False)), v1 / "vm.pt")
    (reg / "current").write_text("versions/v1\n")
    local = model_refs.resolve(reg / "current")
    assert local.fm.path == str(v1.resolve() / "fm.pt") and local.fm.version == fm_version
    with S3Server(tmp_path / "s3") as s3:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        s3.bucket("models")
        bucket = uris.filesystem("s3a://models")[0]
        pafs.copy_files(str(reg), "models/registry", pafs.LocalFileSystem(), bucket)
        remote = model_refs.resolve("s3a://models/registry/current")
        assert remote.fm.path == "s3a://models/registry/versions/v1/fm.pt"
        assert [r.version for r in (remote.fm, remote.ae, remote.vm)] == [r.version for r in (local.fm, local.ae,
                                                                                               local.vm)]
        loaded, meta, _ = model_refs.load(remote.ae, "cpu", None)
        assert meta["model_version"] == local.ae.version
        with pytest.raises(FileNotFoundError, match=r"s3a://models/registry/versions/v2/fm.pt: no FM checkpoint"):
            model_refs.resolve("s3a://models/registry/versions/v2")


def test_an_fm_familys_recipe_search_trains_that_family_and_resumes_from_its_points(synth_root, tmp_path,
                                                                                    monkeypatch):
    """``fm_search`` for the recurrent family (#41: its own validation search, the transformer's plan): every point
    trains a gru4rec FM, the choice is the best validation BCE of its stages (the history length by the mean over
    seeds), and a second run reads every point from its cache (no training, the same table)."""
    from dataclasses import replace

    from solaris_jobs.core import events as ev
    from solaris_jobs.evaluation import fm_search
    from solaris_jobs.evaluation.protocol import ModelsConfig, by_quantiles
    from solaris_jobs.evaluation.windows import event_us
    from solaris_jobs.learning import training
    protocol = by_quantiles(event_us(ev.read_events(synth_root)), 0.8, 0.9, floor="h")
    start = (("fm_lr", 2e-3), ("fm_weight_decay", 0.0), ("fm_dropout", 0.1), ("fm_target_user", False),
             ("history_len", 10))
    plan = replace(fm_search.PLANS["gru4rec"], rows=3_000, epochs=1, stages=(("fm_lr", (8e-3,)),),
                   history_lens=(10, 20), longer=40, start=start)
    base = replace(ModelsConfig(), d_model=8, n_layers=1, d_interaction=16, batch_size=256)
    built, build = [], training.build_fm
    monkeypatch.setattr(training, "build_fm", lambda data, cfg, **kw: built.append(kw["family"]) or
                        build(data, cfg, **kw))
    table = fm_search.search(synth_root, protocol, tmp_path / "search", base, 30.0, plan)
    trained = table["points"]                    # every point this run trained (none was cached yet)
    assert table["family"] == "gru4rec" and built == ["gru4rec"] * len(trained) and len(trained) >= 5
    stage_points = [p for p in trained if p["stage"] in ("start", "fm_lr")]
    best = min(stage_points, key=lambda p: p["valid_bce"])["recipe"]
    means = table["history_len_mean_valid_bce"]
    assert table["chosen"] == {**best, "history_len": int(min(means, key=means.get))}
    assert {p["seed"] for p in trained if p["stage"] == "history_len"} == {0, 1}
    built.clear()
    assert fm_search.search(synth_root, protocol, tmp_path / "search", base, 30.0, plan) == table and built == []
