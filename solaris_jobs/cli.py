"""The ``solaris`` command line. Each command calls the same library functions the Airflow DAGs call."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


class _Group(click.Group):
    """Turns input errors (bad data, bad arguments) into one clear line and exit code 1, not a traceback."""

    def invoke(self, ctx):
        from solaris_jobs.events import DataContractError
        try:
            return super().invoke(ctx)
        except (DataContractError, ValueError, FileNotFoundError) as e:
            raise click.ClickException(str(e)) from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"],
                                                                case_sensitive=False))
def main(log_level: str) -> None:
    """SOLARIS: precompute foundation-model embeddings for a fast ranker, ahead of the requests.

    Data sets are folders in the event-log contract (see README): events/date=.../hour=.../*.parquet,
    users.parquet, items.parquet, rejects/, manifest.json.
    """
    _setup_logging(log_level)


@main.group()
def data() -> None:
    """Create data sets in the event-log contract."""


@data.command("movielens")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Data root to write.")
@click.option("--source", type=click.Path(exists=True), default=None,
              help="A GroupLens ml-100k folder (u.data, u.user, u.item) or a recbole wheel; default: the "
                   "recbole==1.2.1 wheel from PyPI, downloaded once into the cache.")
@click.option("--cache", type=click.Path(file_okay=False), default=None,
              help="Download cache (default $SOLARIS_CACHE or ~/.cache/solaris).")
def data_movielens(out, source, cache) -> None:
    """MovieLens-100K as events (label = rating >= 4), users and items; bad rows set aside with a reason."""
    from solaris_jobs.data import movielens
    _echo_json(movielens.build(out, source, cache))


@data.command("synth")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Data root to write.")
@click.option("--users", default=10_000, help="Number of users.")
@click.option("--items", default=5_000, help="Number of items.")
@click.option("--days", default=7.0, help="Days of traffic.")
@click.option("--seed", default=0, help="Random seed: same seed and parameters, same bytes.")
@click.option("--start", default="2026-01-05T00:00:00Z", help="UTC start of the traffic.")
@click.option("--chunk-users", default=50_000, help="Users simulated per chunk (bounds memory).")
@click.option("--session-rate", default=0.3, help="Median sessions per user per day (log-normal).")
@click.option("--pool-size", default=40, help="Items in each user's slowly changing candidate pool.")
@click.option("--pool-half-life-days", default=2.0, help="Half-life of a pool slot.")
def data_synth(out, users, items, days, seed, start, chunk_users, session_rate, pool_size, pool_half_life_days):
    """Ad-like synthetic traffic: returning users, recurring pairs, Zipf items, non-linear click labels."""
    from solaris_jobs.data import synth
    cfg = synth.SynthConfig(users=users, items=items, days=days, seed=seed, start=start, chunk_users=chunk_users,
                            session_rate=session_rate, pool_size=pool_size, pool_half_life_days=pool_half_life_days)
    _echo_json(synth.generate(cfg, out, progress=sys.stderr.isatty()))


@data.command("candidates")
@click.option("--data", "root", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--at", "cutoff", required=True, help="Request time T (UTC); only the log before T is used.")
@click.option("--user", "users", multiple=True, type=int, required=True, help="User id (repeatable).")
@click.option("--n", "n_candidates", default=200, help="Candidates per request.")
def data_candidates(root, cutoff, users, n_candidates) -> None:
    """Show the request simulator's candidate sets for users at time T (CSV on stdout)."""
    from solaris_jobs import events as ev
    from solaris_jobs.candidates import RequestSimulator, SimulatorConfig
    sim = RequestSimulator(ev.read_events(root, end=cutoff), cutoff,
                           SimulatorConfig(n_candidates=n_candidates, n_popular=n_candidates // 2))
    click.echo(sim.candidates(list(users)).to_csv(index=False), nl=False)


def _train_options(f):
    for opt in reversed([
        click.option("--data", "root", required=True, type=click.Path(exists=True, file_okay=False),
                     help="Data root (event-log contract)."),
        click.option("--out", required=True, type=click.Path(dir_okay=False), help="Checkpoint to write."),
        click.option("--epochs", default=3, help="Maximum epochs (early stopping on valid BCE)."),
        click.option("--batch-size", default=256),
        click.option("--lr", default=2e-3),
        click.option("--seed", default=0),
        click.option("--history-len", default=50, help="History length L."),
        click.option("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, ..."),
        click.option("--max-train-rows", default=None, type=int,
                     help="Subsample large logs: N training rows, N/4 valid and N/4 test rows."),
    ]):
        f = opt(f)
    return f


def _train_cfg(epochs, batch_size, lr, seed, history_len, device, max_train_rows):
    from solaris_jobs.training import TrainConfig
    return TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, history_len=history_len,
                       device=device, max_train_rows=max_train_rows)


def _summary(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "history"}


@main.group()
def train() -> None:
    """Train the FM, the autoencoder and the VM on a time split (train < 80% < valid < 90% < test)."""


@train.command("fm")
@_train_options
@click.option("--d-model", default=64)
@click.option("--layers", default=2)
@click.option("--d-interaction", default=128, help="Width of the interaction embedding h(u, i).")
def train_fm(root, out, epochs, batch_size, lr, seed, history_len, device, max_train_rows, d_model, layers,
             d_interaction):
    """Train the foundation model (sequence model with target attention, label and rating heads)."""
    from solaris_jobs import training
    cfg = _train_cfg(epochs, batch_size, lr, seed, history_len, device, max_train_rows)
    data = training.load_dataset(root, history_len, max_train_rows=max_train_rows, seed=seed)
    _echo_json(_summary(training.train_fm(data, out, cfg, d_model=d_model, n_layers=layers,
                                          d_interaction=d_interaction)))


@train.command("ae")
@_train_options
@click.option("--fm", "fm_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--d-code", default=32, help="Code width D (what the VM and the feature store take).")
def train_ae(root, out, epochs, batch_size, lr, seed, history_len, device, max_train_rows, fm_path, d_code):
    """Train the autoencoder on the FM's interaction embeddings; report reconstruction error."""
    from solaris_jobs import training
    cfg = _train_cfg(epochs, batch_size, lr, seed, history_len, device, max_train_rows)
    data = training.load_dataset(root, history_len, max_train_rows=max_train_rows, seed=seed)
    _echo_json(_summary(training.train_ae(data, fm_path, out, cfg, d_code=d_code)))


@train.command("vm")
@_train_options
@click.option("--mode", type=click.Choice(["plain", "kd", "transfer"]), default="plain",
              help="plain: no FM; kd: FM soft labels; transfer: FM embedding (through the AE) as an input.")
@click.option("--fm", "fm_path", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--ae", "ae_path", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--coverage", default=1.0, help="transfer: share of rows that get an embedding (others zeros).")
@click.option("--kd-weight", default=0.5, help="kd: weight of the FM soft label in the loss.")
def train_vm(root, out, epochs, batch_size, lr, seed, history_len, device, max_train_rows, mode, fm_path, ae_path,
             coverage, kd_weight):
    """Train the vertical model (the fast ranker), alone, with KD, or with the FM embedding."""
    from solaris_jobs import training
    cfg = _train_cfg(epochs, batch_size, lr, seed, history_len, device, max_train_rows)
    data = training.load_dataset(root, history_len, max_train_rows=max_train_rows, seed=seed)
    _echo_json(_summary(training.train_vm(data, out, cfg, mode=mode, fm_path=fm_path, ae_path=ae_path,
                                          coverage=coverage, kd_weight=kd_weight)))


@main.command("demo")
@click.option("--workdir", default="artifacts/demo", type=click.Path(file_okay=False),
              help="Where data, checkpoints, the offline store and the report go.")
@click.option("--seeds", default="0", help="Comma-separated seeds; metrics are averaged over them.")
@click.option("--fm-epochs", default=3)
@click.option("--intervals", default=3, help="Hourly intervals to refresh with the Spark jobs (0: none).")
@click.option("--last-end", default="1998-03-01T00:00:00Z", help="End of the last refreshed interval.")
@click.option("--master", default="local[2]", help="Spark master for the refresh.")
def demo(workdir, seeds, fm_epochs, intervals, last_end, master) -> None:
    """The main job on MovieLens-100K: data, FM, AE, VM / VM+KD / VM+FM embedding and their comparison table,
    then the precompute pipeline (selection, FM inference, aggregates, neighbours) over a few hourly intervals."""
    import pandas as pd

    from solaris_jobs.experiment import run_movielens
    workdir = Path(workdir)
    seed_list = [int(s) for s in seeds.split(",")]
    report = run_movielens(workdir, seed_list, fm_epochs=fm_epochs)
    click.echo(report["table"])
    if intervals <= 0:
        return
    from solaris_jobs.candidates import SimulatorConfig
    from solaris_jobs.precompute import PrecomputeConfig
    from solaris_jobs.spark import spark_session
    from spark_jobs import refresh
    from spark_jobs.common import JobArgs
    # MovieLens users rate in bursts and leave: a week of activity and the whole log as history.
    cfg = PrecomputeConfig(active_hours=168, lookback_days=None, simulator=SimulatorConfig())
    spark = spark_session("solaris-demo", master)
    end = pd.Timestamp(last_end)
    rows = []
    for k in reversed(range(intervals)):
        e = end - pd.Timedelta(hours=k)
        job = JobArgs(str(workdir / "data"), str(workdir / "offline"), str(workdir / "models" / f"seed{seed_list[0]}"),
                      (e - pd.Timedelta(hours=1)).isoformat(), e.isoformat())
        st = refresh.run(spark, job, cfg)
        rows.append((e, st))
    click.echo(f"\nprecompute over {intervals} hourly interval(s), offline store {workdir / 'offline'}")
    click.echo(f"{'interval end':26s} {'users':>6s} {'considered':>10s} {'excluded':>8s} {'selected':>8s} "
               f"{'FM pairs/s':>10s} {'aggregates':>10s} {'neighbours':>10s}  seconds (select/embed/agg/nbr)")
    for e, st in rows:
        sel, emb = st["select"], st["embed"]
        secs = "/".join(f"{st[k]['seconds']:.0f}" for k in ("select", "embed", "aggregate", "neighbours"))
        click.echo(f"{e.isoformat():26s} {sel['users']:6d} {sel['pairs_considered']:10d} "
                   f"{sel['pairs_excluded']:8d} {sel['pairs_selected']:8d} {emb['pairs_per_s']:10.0f} "
                   f"{st['aggregate']['users']:10d} {st['neighbours']['users_with_neighbour_embedding']:10d}  {secs}")
    spark.stop()


def _job_command(name: str, steps: tuple, help_text: str):
    """A click command whose options are the Spark entry points' (spark_jobs.common.parser), so they match."""
    from spark_jobs.common import parser

    def callback(**kw):
        import argparse

        import pandas as pd

        from solaris_jobs.spark import spark_session
        from spark_jobs import refresh
        from spark_jobs.common import config
        every = pd.Timedelta(kw.pop("every")) if kw.get("every") else None
        kw.pop("every", None)
        ns = argparse.Namespace(**kw)
        job, cfg = config(ns)
        start, end = pd.Timestamp(job.start), pd.Timestamp(job.end)
        bounds = [start]
        while every is not None and bounds[-1] + every < end:
            bounds.append(bounds[-1] + every)
        bounds.append(end)
        spark = spark_session(f"solaris-{name}", ns.master)
        results = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            one = type(job)(job.data, job.offline, job.models, s.isoformat(), e.isoformat())
            results.append(refresh.run(spark, one, cfg, steps))
        out = results[0] if len(results) == 1 else results
        if ns.stats_out:
            Path(ns.stats_out).write_text(json.dumps(out, indent=2, default=str) + "\n")
        _echo_json(out)

    params = []
    for a in parser(help_text)._actions:
        if not a.option_strings or a.dest == "help":
            continue
        kind = {float: float, int: int}.get(a.type, str)
        params.append(click.Option(a.option_strings, required=a.required, default=a.default, type=kind,
                                   help=a.help, show_default=a.default is not None))
    params.append(click.Option(["--every"], default=None, help="Split [start, end) into intervals of this "
                               "length (e.g. 1h) and run them in order."))
    return click.Command(name, callback=callback, params=params, help=help_text)


for _name, _steps, _help in [
    ("select", ("select",), "Candidate selection for an interval: active users, request-simulator candidates, "
                            "negative exclusion, verifier (VM) scores, top share selected."),
    ("embed", ("embed",), "FM inference for an interval's selected pairs: FM + autoencoder code per pair."),
    ("aggregate", ("aggregate",), "User aggregates for an interval: mean pair embedding of the trailing 24 h."),
    ("neighbours", ("neighbours",), "FM user embeddings, FAISS top-k neighbours and neighbour embeddings."),
    ("refresh", ("select", "embed", "aggregate", "neighbours"), "The whole refresh of an interval: select, "
                                                                  "embed, aggregate, neighbours."),
]:
    main.add_command(_job_command(_name, _steps, _help))


if __name__ == "__main__":
    main()
