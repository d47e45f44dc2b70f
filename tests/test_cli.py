import json

import click
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
                               "--epochs", "1", "--history-len", "5"])
    assert res.exit_code == 0, res.output
    metrics = json.loads(res.output)
    assert metrics["mode"] == "plain" and metrics["model_version"].startswith("vm-")
    assert (tmp_path / "vm.pt").exists()


def test_bad_input_is_a_clear_cli_error(tmp_path):
    res = CliRunner().invoke(main, ["data", "synth", "--out", str(tmp_path / "s"), "--positive-rate", "1.5"])
    assert res.exit_code == 1 and "Error: SynthConfig.positive_rate = 1.5 is outside [0.0, 1.0]" in res.output
    res = CliRunner().invoke(main, ["train", "vm", "--data", str(tmp_path), "--out", str(tmp_path / "x.pt")])
    assert res.exit_code == 1 and f"Error: {tmp_path}: no event log" in res.output
    res = CliRunner().invoke(main, ["data", "movielens", "--out", str(tmp_path / "o"), "--source", str(tmp_path)])
    assert res.exit_code == 1 and "u.data: file not found" in res.output
