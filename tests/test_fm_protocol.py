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
