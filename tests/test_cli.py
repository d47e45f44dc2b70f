import dataclasses
import json

import click
import pytest
from click.testing import CliRunner

from solaris_jobs.flows.cli import main


def _commands(group, prefix=()):
    for name, cmd in group.commands.items():
        yield prefix + (name,)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))


def test_every_command_has_help():
    runner = CliRunner()
    paths = list(_commands(main))
    assert {("data", "movielens"), ("data", "synth"), ("train", "fm"), ("train", "ae"), ("train", "vm"),
            ("demo",), ("evaluate",)} <= set(paths)
    for path in paths:
        res = runner.invoke(main, [*path, "--help"])
        assert res.exit_code == 0, (path, res.output)
        # The help of this very command (click names the root command after its function, main).
        assert res.output.startswith(f"Usage: main {' '.join(path)} [OPTIONS]"), (path, res.output[:200])
        assert len(res.output.splitlines()) > 3


def test_synth_candidates_and_train_through_the_cli(tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["data", "synth", "--out", str(tmp_path / "d"), "--users", "120", "--items", "80",
                               "--days", "2", "--seed", "5", "--chunk-users", "50"])
    assert res.exit_code == 0, res.output
    manifest = json.loads(res.output)
    assert manifest["config"]["users"] == 120 and manifest["events"] > 0
    res = runner.invoke(main, ["data", "candidates", "--data", str(tmp_path / "d"), "--at", "2026-01-06T00:00:00Z",
                               "--user", "3", "--user", "4", "--n", "20"])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert lines[0] == "user_id,item_id,source,retrieval_score" and 2 < len(lines) <= 41
    res = runner.invoke(main, ["train", "vm", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "vm.pt"),
                               "--epochs", "1", "--history-len", "5", "--verifier"])
    assert res.exit_code == 0, res.output
    metrics = json.loads(res.output)
    assert metrics["mode"] == "plain" and metrics["model_version"].startswith("vm-")
    assert (tmp_path / "vm.pt").exists()
    # The verifier takes the counters only; a ranker VM (with the recency inputs) is refused by the select step.
    from solaris_jobs.core.settings import Settings
    from solaris_jobs.pipeline import model_refs, verifier
    ref = model_refs.resolve(tmp_path, ("vm",)).vm
    assert ref.config["recency"] is False
    with pytest.raises(ValueError, match="takes the rankers' recency inputs"):
        verifier.score_pairs(None, dataclasses.replace(ref, config={**ref.config, "recency": True}),
                             Settings().precompute)


def test_bad_input_is_a_clear_cli_error(tmp_path):
    res = CliRunner().invoke(main, ["data", "synth", "--out", str(tmp_path / "s"), "--positive-rate", "1.5"])
    assert res.exit_code == 1 and "Error: SynthConfig.positive_rate = 1.5 is outside [0.0, 1.0]" in res.output
    res = CliRunner().invoke(main, ["train", "vm", "--data", str(tmp_path), "--out", str(tmp_path / "x.pt")])
    assert res.exit_code == 1 and f"Error: {tmp_path}: no event log" in res.output
    res = CliRunner().invoke(main, ["data", "movielens", "--out", str(tmp_path / "o"), "--source", str(tmp_path)])
    assert res.exit_code == 1 and "u.data: file not found" in res.output


def test_help_and_settings_come_from_the_settings(tmp_path, monkeypatch):
    """Options that set a settings field are described by it; ``--settings`` (JSON or @file) is read by one loader;
    training flags are validated as the training settings, the error naming the flag."""
    from solaris_jobs.core import settings as st
    from solaris_jobs.flows.cli import _load_settings
    res = CliRunner().invoke(main, ["refresh", "--help"], terminal_width=2000)
    assert res.exit_code == 0 and all(f.help in res.output for f in st.FLAGS)
    res = CliRunner().invoke(main, ["train", "fm", "--help"], terminal_width=2000)
    for field in ("epochs", "history_len", "max_train_rows", "d_interaction"):
        assert st.describe(field, st.TrainSettings) in res.output, field
    res = CliRunner().invoke(main, ["materialize", "--help"], terminal_width=2000)
    assert st.describe("expire_from") in res.output and st.describe("feature_repo") in res.output

    s = st.Settings(data="/d", offline=str(tmp_path / "off"), models="/m",
                    precompute=st.PrecomputeConfig(aggregate_hours=48))
    (tmp_path / "s.json").write_text(s.to_json())
    assert _load_settings(f"@{tmp_path / 's.json'}") == s == _load_settings(s.to_json())
    assert _load_settings(s.to_json(), offline="/elsewhere", feature_repo=None) == st.Settings(
        **{**s.to_dict(), "offline": "/elsewhere", "precompute": s.precompute})
    monkeypatch.setenv("SOLARIS_OFFLINE", "/from-env")
    assert _load_settings().offline == "/from-env" and _load_settings(offline="/o").offline == "/o"

    res = CliRunner().invoke(main, ["train", "vm", "--data", str(tmp_path), "--out", str(tmp_path / "x.pt"),
                                    "--epochs", "0"])
    assert res.exit_code == 1 and "--epochs (epochs): Input should be greater than or equal to 1" in res.output
