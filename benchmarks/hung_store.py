"""How long each command that touches the online store takes to fail when Redis hangs, at the default
``SOLARIS_STORE_TIMEOUT_SECONDS`` (10 s), and what it prints; the stock Feast SDK's read
(``FeatureStore.get_online_features``, one user) against the same hung store in the same run.

A real redis-server on 127.0.0.1 and a free port, the project's Feast repo copied and ``feast apply``-ed on it
(while it answers), then the server is paused with SIGSTOP: it still accepts TCP connections (the kernel does) and
never replies, which is how a hung server, a stalled proxy or a black-holed network look to a client. Each
command runs as an operator would run it (a fresh process, the ``solaris`` entry point), timed from start to exit;
anything over ``--cap`` seconds is stopped and reported as such.

    .venv/bin/python benchmarks/hung_store.py [--cap 120]

Saves benchmarks/results/hung_store.json. The suite checks the messages and exit codes with a 1 s timeout
(``tests/test_cli.py::test_every_store_command_fails_in_one_line_on_a_hung_or_dead_store``); the wall times are here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "hung_store.json"


def timed(cmd: list[str], env: dict, cap: float) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=cap)
    except subprocess.TimeoutExpired:
        return {"seconds": None, "stopped_after_s": cap, "exit": None, "stderr_tail": "(still waiting: stopped)"}
    err = p.stderr.strip().splitlines()
    return {"seconds": round(time.perf_counter() - t0, 1), "exit": p.returncode, "stderr_lines": len(err),
            "traceback": "Traceback" in p.stderr, "stderr_tail": err[-1][:300] if err else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap", type=float, default=120.0, help="Stop a command still waiting after this many seconds.")
    args = ap.parse_args()
    from models import VMConfig, VerticalModel, save_checkpoint
    from tests.support import RedisServer, feast_yaml
    work = Path(tempfile.mkdtemp(prefix="hung-store-"))
    try:
        repo = work / "repo"
        shutil.copytree(ROOT / "feature_repo", repo, ignore=shutil.ignore_patterns("data", "__pycache__"))
        for d in ("offline", "data", "models"):
            (work / d).mkdir()
        vm = work / "vm.pt"
        save_checkpoint(VerticalModel(VMConfig(fm_dim=8)), vm, extra={"fm_version": "fm-a", "ae_version": "ae-b"})
        env = {**os.environ, "SOLARIS_FEATURE_REPO": str(repo), "PYTHONPATH": str(ROOT)}
        for k in ("FEAST_FS_YAML_FILE_PATH", "SOLARIS_STORE_TIMEOUT_SECONDS"):
            env.pop(k, None)
        bin_ = Path(sys.executable).parent
        t = ["--end", "2026-01-01T01:00Z"]
        commands = {
            "solaris materialize": ["materialize", "--offline", str(work / "offline"), "--start", "2026-01-01T00:00Z",
                                    *t],
            "solaris status": ["status", "--offline", str(work / "offline")],
            "solaris misses drain": ["misses", "drain", "--offline", str(work / "offline")],
            "solaris lease show": ["lease", "show", *t],
            "solaris lease release": ["lease", "release", *t, "--owner", "run-1"],
            "solaris backfill": ["backfill", "--start", "2026-01-01T00:00Z", *t, "--data", str(work / "data"),
                                 "--offline", str(work / "offline"), "--models", str(work / "models")],
            "solaris rank": ["rank", "--vm", str(vm), "--data", str(work / "data"), "--user", "1", "--at",
                             "2026-01-01T01:00Z", "--items", "1,2"]}
        with RedisServer(work / "redis") as server:
            feast_yaml(repo / "feature_store.yaml", f"  type: redis\n  connection_string: {server.connection_string}",
                       registry=repo / "data" / "registry.db")
            (repo / "data").mkdir(exist_ok=True)
            applied = subprocess.run([str(bin_ / "feast"), "--chdir", str(repo), "apply"], env=env,
                                     capture_output=True, text=True, timeout=300)
            if applied.returncode != 0:
                raise SystemExit(f"feast apply failed:\n{applied.stderr[-2000:]}")
            os.kill(server.proc.pid, signal.SIGSTOP)
            results = {}
            try:
                for name, cmd in commands.items():
                    results[name] = timed([str(bin_ / "solaris"), *cmd], env, args.cap)
                    print(f"{name:24s} {results[name]}", flush=True)
                stock = [sys.executable, "-c", "from feast import FeatureStore; FeatureStore(repo_path=%r)"
                         ".get_online_features(features=['user_aggregates:embedding'], entity_rows=[{'user_id': 1}])"
                         % str(repo)]
                results["Feast SDK get_online_features (stock)"] = timed(stock, env, args.cap)
                print(f"{'Feast SDK read':24s} {results['Feast SDK get_online_features (stock)']}", flush=True)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
        out = {"store_timeout_seconds": 10.0, "cap_s": args.cap, "results": results,
               "machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        OUT.write_text(json.dumps(out, indent=2) + "\n")
        print(f"saved {OUT}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
