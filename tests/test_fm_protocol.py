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

    cfg = _fm().cfg
    for model, message in [(Narrow(cfg).eval(), r"forward h has shape \(6, 16\), not \(6, 32\)"),
                           (Leaky(cfg).eval(), r"forward\(rows=...\) differs"),
                           (Headless(), "not an FM of the protocol")]:
        with pytest.raises(FMRefused, match=r"^probe\.pt: " + message):
            check_fm(model, "probe.pt")
    # A checkpoint whose outputs are not finite is refused when a run resolves its models, before anything runs.
    bad = _fm()
    with torch.no_grad():
        bad.trunk[0].weight[0, 0] = float("nan")
    save_checkpoint(bad, tmp_path / "fm.pt")
    with pytest.raises(FMRefused, match=r"fm\.pt: forward h is not finite on a probe batch"):
        model_refs.resolve(tmp_path, ("fm",))


def test_a_second_fm_family_trains_through_the_product_path_and_passes_the_checks(synth_root, tmp_path):
    """The recurrent family (models/gru4rec.py, no model code shared with ours) is trained by the product's path
    (`solaris train fm --family gru4rec`, as the training DAG does), saved and loaded back as itself, and the
    autoencoder and a run's model resolution take it as they take ours."""
    from click.testing import CliRunner

    from models import load_checkpoint
    from models.gru4rec import GRU4RecFM
    from solaris_jobs.core.settings import TrainSettings
    from solaris_jobs.flows.cli import main
    from solaris_jobs.learning import training
    res = CliRunner().invoke(main, ["train", "fm", "--data", str(synth_root), "--out", str(tmp_path / "fm.pt"),
                                    "--family", "gru4rec", "--epochs", "1", "--history-len", "10", "--d-model", "16",
                                    "--layers", "1", "--d-interaction", "32", "--max-train-rows", "20000"])
    assert res.exit_code == 0, res.output
    fm, meta = load_checkpoint(tmp_path / "fm.pt", kind="fm")
    assert type(fm) is GRU4RecFM and meta["family"] == "gru4rec" and meta["model_version"].startswith("fm-")
    assert isinstance(fm, FMProtocol) and (fm.width, fm.user_width, fm.history_len) == (32, 32, 10)
    check_fm(fm, "gru4rec")
    ts = TrainSettings(fm_family="gru4rec", history_len=10, d_model=16, layers=1, d_interaction=32, d_code=8,
                       max_train_rows=20_000)
    data = training.load_dataset(str(synth_root), 10, max_train_rows=20_000)
    ae = training.train_as_product("ae", data, tmp_path / "ae.pt", ts, fm_path=tmp_path / "fm.pt")
    assert ae["fm_version"] == meta["model_version"] and ae["test_explained_variance"] > 0.5
    training.train_as_product("verifier", data, tmp_path / "vm.pt", ts)
    refs = model_refs.resolve(tmp_path)
    assert refs.fm.version == meta["model_version"] and refs.history_len == 10
    with pytest.raises(ValueError, match="unknown FM family 'rnn'"):
        training.build_fm(data, training.TrainConfig(), family="rnn")
