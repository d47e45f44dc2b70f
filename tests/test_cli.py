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


def test_every_store_command_fails_in_one_line_on_a_hung_or_dead_store(tmp_path):
    """A redis-server paused with SIGSTOP (it accepts connections and never answers), then a dead one: every
    command that touches the online store exits non-zero with one line naming the store and what to check, no
    traceback, after one wait of SOLARIS_STORE_TIMEOUT_SECONDS (1 s here; 10 s by default: BENCHMARKS.md); the
    same command works once the store answers again."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from models import VMConfig, VerticalModel, save_checkpoint
    from tests.support import RedisServer, feast_yaml
    repo, offline, data, models = (tmp_path / n for n in ("repo", "offline", "data", "models"))
    for d in (repo, offline, data, models):
        d.mkdir()
    vm = tmp_path / "vm.pt"        # a VM that reads SOLARIS features (rank reads the store only for one)
    save_checkpoint(VerticalModel(VMConfig(fm_dim=8)), vm, extra={"fm_version": "fm-a", "ae_version": "ae-b"})
    t = ["--end", "2026-01-01T01:00Z"]
    commands = [["materialize", "--offline", str(offline), "--start", "2026-01-01T00:00Z", *t],
                ["status", "--offline", str(offline)],
                ["misses", "drain", "--offline", str(offline)],
                ["lease", "show", *t],
                ["lease", "release", *t, "--owner", "run-1"],
                ["backfill", "--start", "2026-01-01T00:00Z", *t, "--data", str(data), "--offline", str(offline),
                 "--models", str(models)],
                ["rank", "--vm", str(vm), "--data", str(data), "--user", "1", "--at", "2026-01-01T01:00Z",
                 "--items", "1,2"]]
    env = {**os.environ, "SOLARIS_FEATURE_REPO": str(repo), "SOLARIS_STORE_TIMEOUT_SECONDS": "1"}
    env.pop("FEAST_FS_YAML_FILE_PATH", None)
    exe = str(Path(sys.executable).parent / "solaris")

    def run(args):
        # The timeout only stops a hang from stalling the suite; the wait itself is the store timeout's.
        return subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=120)

    def one_line_error(res, store: str, what: str) -> None:
        assert res.returncode != 0, res.stdout
        assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
        assert res.stderr.startswith(f"Error: the online store redis://{store} {what}"), res.stderr
        assert "SOLARIS_STORE_TIMEOUT_SECONDS" in res.stderr and str(repo) in res.stderr, res.stderr

    with RedisServer(tmp_path / "redis") as server:
        feast_yaml(repo / "feature_store.yaml", f"  type: redis\n  connection_string: {server.connection_string}")
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            for args in commands:
                one_line_error(run(args), server.url, "did not answer within 1 s: TimeoutError")
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        res = run(["lease", "show", *t])
        assert res.returncode == 0 and json.loads(res.stdout)["holder"] is None, res.stderr
    one_line_error(run(["lease", "show", *t]), server.url, "could not be reached: ConnectionError")
