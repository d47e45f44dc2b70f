"""The ``solaris`` command line. Each command calls the same library functions the Airflow DAGs call."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import click


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _env_log_level() -> str:
    from solaris_jobs.core.settings import env_log_level
    return env_log_level()


def _echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


class _Group(click.Group):
    """Turns input errors (bad data, bad arguments) and an online store that does not answer into one clear line
    and exit code 1, not a traceback."""

    def invoke(self, ctx):
        import redis

        from solaris_jobs.core.events import DataContractError
        from solaris_jobs.online.store_config import StoreUnavailable, unavailable_message
        try:
            return super().invoke(ctx)
        except (DataContractError, ValueError, FileNotFoundError, StoreUnavailable) as e:
            raise click.ClickException(str(e)) from e
        except (redis.ConnectionError, redis.TimeoutError) as e:     # the store stopped answering part-way
            raise click.ClickException(unavailable_message(None, e)) from e


def _store(feature_repo=None, s=None):
    """The online store (of ``s``'s repo and timeout, else ``feature_repo``'s and the environment's), checked to
    answer: a hung or unreachable store fails here, in at most its timeout, with one line naming it."""
    from solaris_jobs.online import store_config
    if s is not None:
        from solaris_jobs.flows.refresh_steps import store
        cfg = store(s)
    else:
        cfg = store_config.load(feature_repo)
    store_config.check(cfg)
    return cfg


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--log-level", default=lambda: _env_log_level(), show_default="INFO",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str) -> None:
    """SOLARIS: precompute foundation-model embeddings for a fast ranker, ahead of the requests.

    Data sets are folders in the event-log contract (see docs/data.md): events/date=.../hour=.../*.parquet,
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
              help="Download cache (default: the environment's, see docs/configuration.md, or ~/.cache/solaris).")
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
@click.option("--session-rate", default=1.2, help="Median sessions per user per day (log-normal).")
@click.option("--pool-size", default=40, help="Items in each user's slowly changing candidate pool.")
@click.option("--pool-half-life-days", default=2.0, help="Half-life of a pool slot.")
@click.option("--positive-rate", default=0.05, help="Share of positive labels (the label's bias is solved for it).")
@click.option("--sequence-share", default=0.5,
              help="Share of the label's signal variance that only a model of the user's history can see (0-1).")
def data_synth(out, users, items, days, seed, start, chunk_users, session_rate, pool_size, pool_half_life_days,
               positive_rate, sequence_share):
    """Ad-like synthetic traffic: returning users, recurring pairs, Zipf items, non-linear click labels."""
    from solaris_jobs.data import synth
    cfg = synth.SynthConfig(users=users, items=items, days=days, seed=seed, start=start, chunk_users=chunk_users,
                            session_rate=session_rate, pool_size=pool_size, pool_half_life_days=pool_half_life_days,
                            positive_rate=positive_rate, sequence_share=sequence_share)
    _echo_json(synth.generate(cfg, out, progress=sys.stderr.isatty()))


@data.command("profile")
@click.argument("root", type=click.Path(exists=True, file_okay=False))
@click.option("--cadence", default="1h", help="Refresh cadence the pair-coverage ceiling assumes.")
@click.option("--ttl", default="24h", help="How long a refresh's pair embeddings are served.")
@click.option("--window", default="24h", help="The pool's window: a refresh embeds the pairs ranked this long "
                                             "before it.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
def data_profile(root, cadence, ttl, window, as_json) -> None:
    """What an event log offers SOLARIS, before an hours-long evaluation: the pair-coverage ceiling at a cadence
    and TTL and the FM budget it takes, pair recurrence, gaps between a user's requests, next-day return, labels,
    and a verdict in plain words."""
    from solaris_jobs.data.profile import format_profile, profile
    p = profile(root, cadence, ttl, window)
    click.echo(json.dumps(p, indent=2) if as_json else format_profile(p))


@data.command("candidates")
@click.option("--data", "root", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--at", "cutoff", required=True, help="Request time T (UTC); only the log before T is used.")
@click.option("--user", "users", multiple=True, type=int, required=True, help="User id (repeatable).")
@click.option("--n", "n_candidates", default=200, help="Candidates per request.")
def data_candidates(root, cutoff, users, n_candidates) -> None:
    """Show the request simulator's candidate sets for users at time T (CSV on stdout)."""
    from solaris_jobs.core import events as ev
    from solaris_jobs.data.requests import RequestSimulator, SimulatorConfig
    sim = RequestSimulator(ev.read_events(root, end=cutoff), cutoff, SimulatorConfig().with_candidates(n_candidates))
    click.echo(sim.candidates(list(users)).to_csv(index=False), nl=False)


def _train_field(flag: str, field: str):
    """An option of a ``TrainSettings`` field: its default and its description from the settings. A field of the
    FM's recipe has no default here: left out, it is the ``--family``'s (``FM_RECIPES``)."""
    from solaris_jobs.core.settings import FM_RECIPES, TrainSettings, describe
    default = getattr(TrainSettings(), field)
    if field in FM_RECIPES["transformer"]:
        recipes = ", ".join(f"{k} {v[field]}" for k, v in FM_RECIPES.items())
        return click.option(f"{flag}/--no-{flag[2:]}" if isinstance(default, bool) else flag, field, default=None,
                            type=None if isinstance(default, bool) else type(default),
                            help=f"{describe(field, TrainSettings)} Default: the FM family's evaluated recipe "
                                 f"({recipes}; the transformer's where the command takes no --family).")
    if isinstance(default, bool):
        return click.option(f"{flag}/--no-{flag[2:]}", field, default=default, help=describe(field, TrainSettings))
    if isinstance(default, str):
        from typing import get_args
        choices = get_args(TrainSettings.__pydantic_fields__[field].annotation)
        return click.option(flag, field, default=default, type=click.Choice(choices) if choices else str,
                            help=describe(field, TrainSettings))
    return click.option(flag, field, default=default, type=float if isinstance(default, float) else int,
                        help=describe(field, TrainSettings))


def _train_options(f):
    for opt in reversed([
        click.option("--data", "root", required=True, type=click.Path(exists=True, file_okay=False),
                     help="Data root (event-log contract)."),
        click.option("--out", required=True, type=click.Path(dir_okay=False), help="Checkpoint to write."),
        _train_field("--epochs", "epochs"),
        _train_field("--batch-size", "batch_size"),
        _train_field("--seed", "seed"),
        _train_field("--history-len", "history_len"),
        click.option("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, ..."),
        _train_field("--max-train-rows", "max_train_rows"),
    ]):
        f = opt(f)
    return f


# ``solaris train fm`` names the FM's recipe fields without their prefix.
FLAG_OF = {"fm_lr": "--lr", "fm_weight_decay": "--weight-decay", "fm_dropout": "--dropout",
           "fm_target_user": "--target-user", "fm_family": "--family"}


def _train_run(kw: dict):
    """The training settings of the flags in ``kw`` (validated: an error names the flag), the trainers' settings,
    and the data set they read."""
    from solaris_jobs.core.settings import Settings, TrainSettings, validate_train
    from solaris_jobs.learning import training
    fields = {k: kw.pop(k) for k in list(kw) if k in TrainSettings.__pydantic_fields__}
    fields = {k: v for k, v in fields.items() if v is not None}        # not given: the default (or the family's)
    ts = validate_train(fields, {k: FLAG_OF.get(k, "--" + k.replace("_", "-")) for k in fields})
    lr = kw.pop("lr", None)               # the autoencoder's and the VM's (the FM's is its recipe's: fm_lr)
    cfg = training.TrainConfig.of(ts, device=kw.pop("device"), **({"lr": lr} if lr is not None else {}))
    # Labels as the refresh sees them: an event's label only ``label_delay_minutes`` after it (the last minutes
    # before the test split unlabelled), from the same settings the refresh reads.
    delay = Settings.from_env(require=False).precompute.label_delay_minutes
    data = training.load_dataset(kw.pop("root"), ts.history_len, max_train_rows=ts.max_train_rows, seed=ts.seed,
                                 label_delay_minutes=delay)
    return ts, cfg, data


def _summary(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "history"}


@main.group()
def train() -> None:
    """Train the FM, the autoencoder and the VM on a time split (train < 80% < valid < 90% < test)."""


@train.command("fm")
@_train_options
@_train_field("--d-model", "d_model")
@_train_field("--layers", "layers")
@_train_field("--d-interaction", "d_interaction")
@_train_field("--lr", "fm_lr")
@_train_field("--weight-decay", "fm_weight_decay")
@_train_field("--dropout", "fm_dropout")
@_train_field("--target-user", "fm_target_user")
@_train_field("--family", "fm_family")
def train_fm(out, **kw):
    """Train the foundation model (``--family``: the transformer with target attention, or the recurrent gru4rec;
    label and rating heads); the recipe's defaults are the evaluated ones."""
    from solaris_jobs.learning import training
    ts, cfg, data = _train_run(kw)
    _echo_json(_summary(training.train_as_product("fm", data, out, ts, cfg)))


@train.command("ae")
@_train_options
@click.option("--lr", default=2e-3, help="Learning rate.")
@click.option("--fm", "fm_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--fm-factory", default=None, help="package.module:factory building the FM from --fm when it is your "
                                                 "own (default: a SOLARIS checkpoint).")
@_train_field("--d-code", "d_code")
@_train_field("--ae-epochs", "ae_epochs")
def train_ae(out, fm_path, fm_factory, **kw):
    """Train the autoencoder on the FM's interaction embeddings (``--ae-epochs``, the evaluated recipe; not
    ``--epochs``); report reconstruction error."""
    from solaris_jobs.learning import training
    ts, cfg, data = _train_run(kw)
    _echo_json(_summary(training.train_as_product("ae", data, out, ts, cfg, fm_path, fm_factory)))


@train.command("vm")
@_train_options
@click.option("--lr", default=2e-3, help="Learning rate.")
@click.option("--mode", type=click.Choice(["plain", "kd", "transfer"]), default="plain",
              help="plain: no FM; kd: FM soft labels; transfer: FM embedding (through the AE) as an input.")
@click.option("--fm", "fm_path", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--ae", "ae_path", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--fm-factory", default=None, help="package.module:factory building the FM from --fm when it is your "
                                                 "own (default: a SOLARIS checkpoint).")
@click.option("--coverage", default=1.0, help="transfer: share of rows that get an embedding (others zeros).")
@click.option("--kd-weight", default=0.5, help="kd: weight of the FM soft label in the loss.")
@click.option("--verifier", is_flag=True, help="the refresh's verifier (plain, without the rankers' recency inputs, "
              "which the select step does not compute).")
@_train_field("--verifier-epochs", "verifier_epochs")
@_train_field("--verifier-patience", "verifier_patience")
def train_vm(out, mode, fm_path, ae_path, fm_factory, coverage, kd_weight, verifier, **kw):
    """Train the vertical model (the fast ranker), alone, with KD, or with the FM embedding; or the verifier (its
    epochs and patience: ``--verifier-epochs``, ``--verifier-patience``, the evaluated recipe)."""
    from solaris_jobs.learning import training
    if verifier and mode != "plain":
        raise click.UsageError("--verifier trains the plain VM; it takes no --mode")
    ts, cfg, data = _train_run(kw)
    if verifier:
        _echo_json(_summary(training.train_as_product("verifier", data, out, ts, cfg)))
        return
    _echo_json(_summary(training.train_vm(data, out, cfg, mode=mode, fm_path=fm_path, ae_path=ae_path,
                                          coverage=coverage, kd_weight=kd_weight, fm_factory=fm_factory)))


@main.command("demo")
@click.option("--dataset", type=click.Choice(["synth", "movielens"]), default="synth", show_default=True,
              help="synth: synthetic ad-like traffic, where pairs recur (the evaluation's headline generator at the "
                   "quick size); movielens: MovieLens-100K, real data where pairs never recur.")
@click.option("--workdir", default="artifacts/demo", type=click.Path(file_okay=False),
              help="Where the offline store, the Airflow home and the refresh's settings (solaris.env) go "
                   "(MovieLens: its data and checkpoints too).")
@click.option("--reports", default="reports/quick", type=click.Path(file_okay=False),
              help="synth: the quick evaluation's report folder, with its data and checkpoints cached under it.")
@click.option("--intervals", default=None, type=int,
              help="Intervals to run the refresh DAG over (0: none; default 2 on synth, every 2 h after t1, and 3 "
                   "hourly ones on MovieLens).")
@click.option("--seeds", default=None, help="MovieLens: comma-separated seeds; metrics are averaged over them "
                                             "(default 0).")
@click.option("--fm-epochs", default=None, type=int, help="MovieLens: the FM's epochs (default 3).")
@click.option("--last-end", default=None, help="MovieLens: end of the last refreshed interval (default "
                                               "1998-03-01T00:00:00Z).")
@click.option("--master", default="local[2]", help="Spark master for the refresh and the replay.")
def demo(dataset, workdir, reports, intervals, seeds, fm_epochs, last_end, master) -> None:
    """The main job. On synthetic ad-like traffic (default): the FM, autoencoder and verifier trained once; the
    Airflow refresh DAG (dag.test()) over the first intervals after training into the embedded SQLite online
    store; one read through the Feast SDK and one through the tiered serving client; the quick replay evaluation
    with the same models; and a closing table (coverage by tier, FM inferences per served row, serving latency,
    the rankers' BCE, and the committed full evaluation's criterion). On MovieLens-100K: the rankers' offline
    comparison and the refresh over hourly intervals, showing why SOLARIS has little to do where pairs never recur."""
    from solaris_jobs.flows import demo as d
    workdir = Path(workdir).resolve()
    if dataset == "synth":
        given = [f for f, v in (("--seeds", seeds), ("--fm-epochs", fm_epochs), ("--last-end", last_end)) if v]
        if given:
            raise click.UsageError(f"{', '.join(given)}: MovieLens only (--dataset movielens); the synthetic demo "
                                   f"runs the quick evaluation's configuration as it is")
        d.synth_demo(workdir, Path(reports).resolve(), 2 if intervals is None else intervals, master,
                     echo=click.echo)
    else:
        d.movielens_demo(workdir, [int(s) for s in (seeds or "0").split(",")], fm_epochs or 3,
                         3 if intervals is None else intervals, last_end or "1998-03-01T00:00:00Z", master,
                         echo=click.echo)


def _log_protocol(cfg):
    """The protocol of ``cfg``'s own log (``--data``), its dates checked against it: before any Spark or training."""
    from solaris_jobs.core import events as ev
    from solaris_jobs.evaluation.windows import protocol_of
    return protocol_of(cfg, ev.read_events(cfg.data_root, columns=["user_id", "item_id", "event_timestamp"]))


def _own_log_config(data_root, times, split):
    """The evaluation of a log of the user's own (``--data``, ``--times``, ``--split``), its dates checked now."""
    from solaris_jobs.evaluation.config import path_config
    given = {}
    if times:
        given["times"] = tuple(x.strip() for x in times.split(","))
    if split:
        try:
            q = tuple(float(x) for x in split.split(","))
        except ValueError:
            raise click.BadParameter(f"not two numbers: {split!r}", param_hint="--split")
        if len(q) != 2 or not 0 < q[0] < q[1] < 1:
            raise click.BadParameter(f"two quantiles 0 < q1 < q2 < 1, got {split!r}", param_hint="--split")
        given["split"] = q
    cfg = path_config(Path(data_root).resolve(), **given)
    _log_protocol(cfg)
    return cfg


def _with_fm(cfg, fm, checkpoint, possibly_leaky):
    """``cfg`` with the FM of ``--fm``: a family to train, or a factory of the user's own FM taken as it is from
    ``--fm-checkpoint`` (refused now if its factory does not resolve or it saw the replay or test)."""
    from dataclasses import replace
    if fm and ":" in fm:
        if not checkpoint:
            raise click.UsageError("--fm package.module:factory takes your FM from --fm-checkpoint")
        from solaris_jobs.evaluation.protocol import check_training_end
        from solaris_jobs.pipeline.model_refs import load_fm
        cfg = replace(cfg, fm_checkpoint=str(Path(checkpoint).resolve()), fm_factory=fm, possibly_leaky=possibly_leaky)
        meta = load_fm(cfg.fm_checkpoint, fm)[1]
        if cfg.dataset == "path":
            check_training_end(meta, _log_protocol(cfg), possibly_leaky, checkpoint)
        return cfg
    if checkpoint or possibly_leaky:
        raise click.UsageError("--fm-checkpoint and --possibly-leaky go with --fm package.module:factory")
    if fm:
        from models.checkpoint import FM_FAMILIES
        if fm not in FM_FAMILIES:
            raise click.BadParameter(f"{fm!r} is neither a family ({', '.join(FM_FAMILIES)}) nor a "
                                     f"package.module:factory", param_hint="--fm")
        from solaris_jobs.evaluation import fm_search
        cfg = replace(cfg, models=fm_search.models_for(cfg.models, fm))     # the family's own searched recipe
    return cfg


@main.command("evaluate")
@click.option("--dataset", type=click.Choice(["synth", "movielens"]), default="synth")
@click.option("--data", "data_root", default=None, type=click.Path(exists=True, file_okay=False),
              help="A log of your own in the event-log contract, instead of --dataset.")
@click.option("--times", default=None, help="With --data: t0,t1,t2,t3 (UTC; training before t1, served training "
                                           "[t1, t2), test [t2, t3)), checked against the log.")
@click.option("--split", default=None, help="With --data and no --times: t1,t2 at these quantiles of the log's "
                                           "event times (default 0.8,0.9); t0 and t3 its first and last day.")
@click.option("--fm", "fm_family", default=None,
              help="The FM: a family trained before t1 (transformer, the evaluated one and the default, or gru4rec), "
                   "or package.module:factory of your own FM, taken as it is from --fm-checkpoint.")
@click.option("--fm-checkpoint", default=None, type=click.Path(exists=True, dir_okay=False),
              help="With --fm package.module:factory: your trained FM's file (its declared trained_until must be "
                   "before t1).")
@click.option("--possibly-leaky", is_flag=True, help="Evaluate an FM of your own that declares no training end; "
                                                    "the report says so.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Report folder (e.g. reports/<name>/); "
              "data, checkpoints, replays and FM outputs are cached under it.")
@click.option("--seeds", default=None, help="Comma-separated seeds (default 0,1,2,3,4; --quick: 0); 'none' runs "
                                         "only the sweep, to be joined with evaluate-merge. The sweep always runs at "
                                         "seed 0: a run of other seeds apart takes --sequence-shares none.")
@click.option("--quick", is_flag=True, help="Minutes instead of hours: 1,000 synthetic users over 2.5 days, one seed, "
                                            "small models, no sweep (too small for the targets).")
@click.option("--users", default=None, type=int, help="Synthetic users (default 5000; --quick 1000).")
@click.option("--sequence-shares", default=None,
              help="The sweep, comma-separated (default 0,0.25,0.5,0.75; 'none' to skip).")
@click.option("--no-curves", is_flag=True, help="Skip the budget and cadence curves.")
@click.option("--fast-cadence", default=None, help="The fast-cadence replay of the curves (default 15min on synth; "
                                                  "'none' to skip: it costs about as much as the headline replay).")
@click.option("--master", default="local[2]", help="Spark master for the replay.")
@click.option("--fresh", is_flag=True, help="Delete --out first (otherwise unchanged steps are reused).")
def evaluate_cmd(dataset, data_root, times, split, fm_family, fm_checkpoint, possibly_leaky, out, seeds, quick,
                 users, sequence_shares, no_curves, fast_cadence, master, fresh) -> None:
    """The replay evaluation: models trained before t1, the refresh and the serving client walked over [t1, t3) as
    production runs them, the ranker's VM trained on what was served; TR vs KD, coverage by tier and FM compute per
    served row, with paired-bootstrap intervals. Writes report.json, report.md (with plots) and report.html (one self-contained page)."""
    from dataclasses import replace

    from solaris_jobs.evaluation.config import EvalConfig, movielens_config, quick_config
    from solaris_jobs.evaluation.report import headline_table
    from solaris_jobs.evaluation.run import evaluate
    if (times or split) and not data_root:
        raise click.UsageError("--times and --split go with --data")
    if data_root:
        if dataset != "synth" or users:
            raise click.UsageError("--data evaluates your log: it takes no --dataset or --users")
        cfg = _own_log_config(data_root, times, split)
    else:
        cfg = movielens_config() if dataset == "movielens" else quick_config() if quick else EvalConfig()
    if quick and dataset == "movielens" or quick and data_root:
        cfg = replace(cfg, seeds=(0,), n_boot=200, curves=False)
    cfg = _with_fm(cfg, fm_family, fm_checkpoint, possibly_leaky)
    kw = {"spark_master": master}
    if seeds:
        kw["seeds"] = () if seeds == "none" else tuple(int(x) for x in seeds.split(","))
    if users:
        kw["synth"] = replace(cfg.synth, users=users)
    if sequence_shares:
        kw["sequence_shares"] = () if sequence_shares == "none" else tuple(float(x) for x in sequence_shares.split(","))
    if no_curves:
        kw["curves"] = False
    if fast_cadence:
        if fast_cadence != "none":
            import pandas as pd
            try:
                pd.Timedelta(fast_cadence)
            except ValueError as e:
                raise click.BadParameter(f"not a duration: {fast_cadence!r} ({e})", param_hint="--fast-cadence")
        kw["fast_cadence"] = None if fast_cadence == "none" else fast_cadence
    report = evaluate(replace(cfg, **kw), Path(out), fresh=fresh)
    click.echo(headline_table(report))
    click.echo(f"report: {Path(out) / 'report.html'} (and report.md, report.json)")


@main.command("evaluate-fm-search")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the data and the search's "
              "points (cached: an interrupted search resumes).")
@click.option("--family", default="transformer", show_default=True,
              type=click.Choice(["transformer", "gru4rec"]), help="The FM family whose recipe is searched.")
@click.option("--result", default=None, type=click.Path(dir_okay=False),
              help="Where to write the table (default benchmarks/results/fm_search_synth.json, "
                   "fm_search_synth_<family>.json for another family).")
def evaluate_fm_search_cmd(out, family, result) -> None:
    """An FM family's recipe search on seed 0's validation slice (``solaris_jobs.evaluation.fm_search``): run once,
    before the evaluation's seeds; its choice is the recipe the evaluation trains that family with (the
    transformer's: ``ModelsConfig``'s default)."""
    from solaris_jobs.core import events as ev
    from solaris_jobs.evaluation import fm_search
    from solaris_jobs.evaluation.config import EvalConfig
    from solaris_jobs.evaluation.run import dataset_root
    from solaris_jobs.evaluation.windows import protocol_of
    cfg, plan = EvalConfig(), fm_search.PLANS[family]
    root = dataset_root(cfg, Path(out), seed=plan.seeds[0])
    table = fm_search.search(root, protocol_of(cfg, ev.read_events(root)), Path(out) / "fm_search", cfg.models,
                             cfg.label_delay_minutes, plan)
    path = Path(result) if result else fm_search.result_path(family)
    path.write_text(json.dumps(table, indent=1, default=str) + "\n")
    click.echo(json.dumps(table["chosen"]))
    click.echo(f"table: {path}")


@main.command("evaluate-tier-choice")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="The headline evaluation's folder "
              "(its seed 0 data, models, replay and VMs are shared with the choice).")
@click.option("--result", default=None, type=click.Path(dir_okay=False),
              help="Where to write the table (default benchmarks/results/tier_choice_synth.json).")
@click.option("--master", default="local[2]", help="Spark master for the replay.")
def evaluate_tier_choice_cmd(out, result, master) -> None:
    """The fallback tiers the product serves, chosen on seed 0's validation rows
    (``solaris_jobs.evaluation.tier_choice``): run once, after the FM's search and before the evaluation's seeds;
    its choice is ``FeatureReader``'s default."""
    from dataclasses import replace

    from solaris_jobs.evaluation import tier_choice
    from solaris_jobs.evaluation.config import EvalConfig
    from solaris_jobs.evaluation.run import choose_tiers
    table = choose_tiers(replace(EvalConfig(), spark_master=master), Path(out))
    path = Path(result) if result else tier_choice.RESULT
    path.write_text(json.dumps(table, indent=1, default=str) + "\n")
    for t, v in (table["validation"] or {}).items():
        click.echo(f"{t:16s} " + ("no rows" if v["value"] is None else
                                  f"{v['value']:+.5f} [{v['ci'][0]:+.5f}, {v['ci'][1]:+.5f}] on {v['rows']} rows"))
    click.echo(f"chosen: {', '.join(table['chosen']) or 'none'}")
    click.echo(f"table: {path}")


@main.command("evaluate-merge")
@click.argument("reports", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the merged report.json, "
                                                                           "report.md and report.html.")
@click.option("--seeds", default=None, help="The seeds the merged report should hold to be complete (comma-separated; "
                                            "default the dataset's 0,1,2,3,4).")
def evaluate_merge_cmd(reports, out, seeds) -> None:
    """One report from runs of the same evaluation that ran different seeds apart (``solaris evaluate --seeds 1`` on
    another machine or in another session): the data, protocol and settings must match; the summary and the targets
    are recomputed over every seed."""
    from solaris_jobs.evaluation.merge import ReportMismatch, merge_reports
    from solaris_jobs.evaluation.report import headline_table
    expected = tuple(int(x) for x in seeds.split(",")) if seeds else None
    try:
        report = merge_reports([Path(r) for r in reports], Path(out), expected)
    except ReportMismatch as e:
        raise click.ClickException(str(e))
    click.echo(headline_table(report))
    click.echo(f"report: {Path(out) / 'report.html'} (seeds {report['seeds']}, complete: {report['complete']})")


def _settings_options(f):
    """The Settings flags (``settings.FLAGS``) plus ``--settings``: every command that runs refresh steps takes the
    same ones, with the same meaning, in the CLI and in ``spark_jobs/*.py`` under spark-submit."""
    from solaris_jobs.core import settings as st
    types = {"int": int, "float": float, "str": str}
    for flag in reversed(st.FLAGS):
        default = st.default_of(flag.field)
        shown = f"; default {default}" if default not in (None, "") else ""
        var = f" or ${st.env_var(flag.field)}" if flag.field in st.ENV.values() else ""
        kind = click.Choice(flag.choices) if flag.type == "choice" else types[flag.type]
        f = click.option(flag.flag, "_flag_" + flag.field.replace(".", "__"), default=None, type=kind,
                         help=f"{flag.help} [from --settings{var}{shown}]")(f)
    return click.option("--settings", "settings_json", default=None, metavar="JSON|@FILE",
                        help="The whole Settings as JSON (what the DAG passes to spark-submit), or @file; the "
                             "flags above override it. Without it, the SOLARIS_* environment.")(f)


def _load_settings(settings_json: str | None = None, **overrides):
    """The refresh's Settings as every command builds them: from ``--settings`` (JSON, or ``@file``: a file of it)
    when given, else the ``SOLARIS_*`` environment; then ``overrides`` (Settings fields; None ones are not given).
    Not checked for completeness (``Settings.require``)."""
    from solaris_jobs.core.settings import Settings
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not settings_json:
        return Settings.from_env(require=False, **overrides)
    text = Path(settings_json[1:]).read_text() if settings_json.startswith("@") else settings_json
    s = Settings.from_json(text)
    return s.override(**overrides) if overrides else s


def _settings(kw: dict):
    """Settings from --settings (else the environment), then the flags; pops the flag arguments from ``kw``.
    Under spark-submit (``spark_submit_main``) the master is spark-submit's unless --master is given; the log level
    is the settings' unless --log-level is."""
    from solaris_jobs.core.settings import apply_flags
    s = _load_settings(kw.pop("settings_json"))
    flags = {k[len("_flag_"):].replace("__", "."): kw.pop(k) for k in list(kw) if k.startswith("_flag_")}
    root = click.get_current_context().find_root()
    if (root.obj or {}).get("spark_submit") and flags.get("spark_master") is None:
        s = s.for_spark_submit()
    s = apply_flags(s, flags).require()
    if root.get_parameter_source("log_level") != click.core.ParameterSource.COMMANDLINE:
        logging.getLogger().setLevel(s.log_level)
    return s


def _write_stats(path, out) -> None:
    if path:
        Path(path).write_text(json.dumps(out, indent=2, sort_keys=True, default=str) + "\n")


def _job_command(name: str, steps: tuple, help_text: str):
    @click.command(name, help=help_text)
    @click.option("--start", required=True, help="Interval start (UTC, inclusive).")
    @click.option("--end", required=True, help="Interval end (UTC, exclusive); the cutoff T.")
    @click.option("--every", default=None, help="Split [start, end) into intervals of this length (e.g. 1h) and run "
                                                "them in order.")
    @click.option("--stats-out", default=None, help="Also write the stats (JSON) to this local file.")
    @click.option("--lease-owner", default=None, help="Hold each interval's lease for this run id while the step runs "
                                                     "(what the DAG passes: another run of the interval is refused).")
    @_settings_options
    def command(start, end, every, stats_out, lease_owner, **kw):
        from solaris_jobs.flows.refresh_steps import leased, run_intervals
        from solaris_jobs.pipeline import jobs
        s = _settings(kw)
        spark = jobs.session(s, name)

        def one(a, b):
            if lease_owner:
                return leased(s, b, lease_owner, lambda: jobs.run(spark, s, a, b, steps))
            return jobs.run(spark, s, a, b, steps)

        out = run_intervals(start, end, every, one, desc=name)
        out = out[0] if len(out) == 1 else out
        _write_stats(stats_out, out)
        _echo_json(out)
    return command


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


def _described(field: str, default: str) -> str:
    """Help of an option that sets a Settings field: the field's description, then where the default comes from."""
    from solaris_jobs.core.settings import describe
    return f"{describe(field)} Default: {default}."


_repo_option = click.option("--feature-repo", default=None, type=click.Path(file_okay=False),
                            help=_described("feature_repo", "the environment's, or ./feature_repo"))


@main.command("materialize")
@click.option("--offline", default=None, help=_described("offline", "the environment's"))
@click.option("--start", required=True, help="Interval start (UTC).")
@click.option("--end", required=True, help="Interval end (UTC): the outputs keyed by this end are written.")
@click.option("--every", default=None, help="Split [start, end) into intervals of this length and write each.")
@click.option("--views", "view_names", default=None, help="Comma-separated views (default: all).")
@click.option("--expire-from", type=click.Choice(["event", "write"]), default=None,
              help=_described("expire_from", "the environment's, or event"))
@click.option("--always-check", is_flag=True, help="Compare every key's stored event time (other writers exist).")
@_repo_option
def materialize_cmd(offline, start, end, every, view_names, expire_from, always_check, feature_repo) -> None:
    """Write intervals' pair embeddings, user aggregates and neighbours into the online store (Feast's layout,
    per-view expiry). Exits non-zero if any write fails; only complete intervals are recorded as materialized."""
    from solaris_jobs.flows import refresh_steps as o
    s = _load_settings(offline=offline, expire_from=expire_from, feature_repo=feature_repo)
    if not s.offline:
        raise click.UsageError("give --offline (or set the environment's offline store)")
    _store(s=s)
    names = view_names.split(",") if view_names else None
    out = o.run_intervals(start, end, every, lambda a, b: o.materialize_interval(s, a, b, views=names,
                                                                                 always_check=always_check),
                          desc="materialize")
    _echo_json(out[0] if len(out) == 1 else out)


@main.command("rank")
@click.option("--vm", "vm_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="VM checkpoint (a transfer-mode VM reads SOLARIS features; a plain one does not).")
@click.option("--data", "root", required=True, type=click.Path(exists=True, file_okay=False),
              help="Data root: the VM's counters come from its event log before --at.")
@click.option("--user", "user_id", required=True, type=int)
@click.option("--items", default=None, help="Comma-separated candidate item ids (default: the request simulator's).")
@click.option("--candidates", default=500, help="Without --items: this many simulator candidates.")
@click.option("--at", "at", required=True, help="Request time (UTC): the clock for TTLs and counters.")
@click.option("--budget-ms", default=10.0, help="Online-store read budget; slower reads fail open (tier none).")
@click.option("--top", default=20, help="Rows to print.")
@click.option("--no-features", is_flag=True, help="Score without SOLARIS features (zeros, tier none).")
@_repo_option
def rank(vm_path, root, user_id, items, candidates, at, budget_ms, top, no_features, feature_repo) -> None:
    """Score one request with the VM and the tiered SOLARIS features; print the ranking, tiers and timings."""
    import numpy as np

    from solaris_jobs.online.ranker import Counters, Ranker
    from solaris_jobs.online.reader import FeatureReader
    if items:
        ids = np.array([int(x) for x in items.split(",")], np.int64)
    else:
        from solaris_jobs.core import events as ev
        from solaris_jobs.data.requests import RequestSimulator, SimulatorConfig
        sim = RequestSimulator(ev.read_events(root, end=at), at, SimulatorConfig().with_candidates(candidates))
        ids = sim.candidates([user_id])["item_id"].to_numpy(np.int64)
    from models import load_checkpoint
    from solaris_jobs.core.contract import vm_embedding_version
    _, meta = load_checkpoint(vm_path, kind="vm")
    reader = None
    if meta["config"].get("fm_dim") and not no_features:
        # The reader fails open (zeros, tier none) on a slow store, as serving must; a store that does not answer
        # at all is an operator's problem to see: checked first.
        reader = FeatureReader(_store(feature_repo), vm_embedding_version(meta), meta["config"]["fm_dim"],
                               budget_ms=budget_ms)
    ranker = Ranker(vm_path, reader, Counters(root, at))
    result = ranker.score(user_id, ids, at)
    click.echo(result.table(top).to_string(index=False))
    tiers = {t: result.tiers.count(t) for t in dict.fromkeys(result.tiers)}
    click.echo(f"\n{len(ids)} candidates; tiers {tiers}; features {result.features_ms:.2f} ms, "
               f"VM {result.model_ms:.2f} ms")
    if reader is not None:
        reader.close()


@main.command("backfill")
@click.option("--start", required=True, help="First interval start (UTC).")
@click.option("--end", required=True, help="Last interval end (UTC).")
@click.option("--every", default="1h", help="Interval length.")
@click.option("--force", is_flag=True, help="Rerun intervals that are already complete.")
@_settings_options
def backfill_cmd(start, end, every, force, **kw) -> None:
    """Run the refresh DAG's task functions interval by interval, without a scheduler: validate, drain misses,
    select, embed, aggregate, neighbours, materialize, report. Complete intervals (all offline outputs and
    materialized) are skipped; a failed one is rerun from the start on the next call."""
    from solaris_jobs.flows import refresh_steps as o
    s = _settings(kw)
    _store(s=s)
    out = o.backfill(s, start, end, every, force=force, progress=sys.stderr.isatty())
    _echo_json([{k: v for k, v in r.items() if k != "steps"} | (
        {"report": r["steps"]["report"]} if "steps" in r else {}) for r in out])


@main.command("status")
@click.option("--offline", default=None, help=_described("offline", "the environment's"))
@click.option("--last", default=10, show_default=True, type=click.IntRange(min=1),
              help="How many of the newest intervals to show.")
@click.option("--metrics", default=None, help="The serving client's Prometheus text: a file, or an http(s) "
                                              "endpoint to scrape.")
@click.option("--scan-limit", default=1_000_000, show_default=True,
              help="Redis: count keys per view only up to this many keys (a SCAN of the keyspace).")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.option("--now", default=None, help="The clock for ages (UTC; default the wall clock).")
@_repo_option
def status_cmd(offline, last, metrics, scan_limit, as_json, now, feature_repo) -> None:
    """The newest intervals and each step's state (selected, embedded, aggregated, neighbours, materialized),
    the coverage by tier the interval's requests met, the online store's freshness and keys per view, and the
    serving client's metrics if given: what to check first when a ranker's features look wrong."""
    from solaris_jobs.core.settings import env_var
    from solaris_jobs.flows.status import format_status, status
    s = _load_settings(offline=offline or None, feature_repo=feature_repo or None)
    if not s.offline:
        raise click.UsageError(f"no offline store: pass --offline or set {env_var('offline')}")
    _store(s=s)
    st = status(s, last=last, now=now, metrics=metrics, scan_limit=scan_limit)
    click.echo(json.dumps(st, indent=2, default=str) if as_json else format_status(st))


@main.command("prune")
@click.option("--offline", default=None, help=_described("offline", "--settings', else the environment's"))
@click.option("--before", default=None, help="Remove intervals that end before this time (UTC).")
@click.option("--keep-hours", default=None, type=click.FloatRange(min=0),
              help="Or: keep each dataset's last this many hours (before its newest interval's end).")
@click.option("--datasets", default="state", show_default=True,
              help="Comma-separated datasets and groups: `state` (what select keeps for the next interval), "
                   "`all` (every dataset).")
@click.option("--settings", "settings_json", default=None, metavar="JSON|@FILE",
              help="The refresh's Settings as JSON (or @file), for what the jobs read back (exclusion_runs, "
                   "aggregate_hours, knn_rebuild_hours); default the SOLARIS_* environment.")
@click.option("--dry-run", is_flag=True, help="Only say what would go.")
def prune_cmd(offline, before, keep_hours, datasets, settings_json, dry_run) -> None:
    """Remove old intervals from the offline store. Select already prunes its own state (--state-keep-hours); the
    outputs (selection, pair embeddings, aggregates, neighbours, ...) stay until pruned here. Intervals the next
    refresh still reads (the last exclusion_runs selections, aggregate_hours of pair embeddings, the KNN index of
    the last knn_rebuild_hours, every dataset's newest) are kept whatever the bound, and counted. Prints, per
    dataset, what was removed and the bytes freed."""
    import pandas as pd

    from solaris_jobs.core.settings import env_var
    from solaris_jobs.pipeline import retention
    if (before is None) == (keep_hours is None):
        raise click.UsageError("give one of --before or --keep-hours")
    s = _load_settings(settings_json, offline=offline or None)
    if not s.offline:
        raise click.UsageError(f"no offline store: pass --offline or set {env_var('offline')}")
    groups = {"state": retention.STATE, "all": retention.DATASETS}
    names = tuple(dict.fromkeys(n for d in datasets.split(",") if d.strip()
                                for n in groups.get(d.strip(), (d.strip(),))))
    try:
        retention.check_datasets(names)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--datasets")
    bound = _utc_arg(before, "--before") if before is not None else (
        lambda ends: ends[-1] - pd.Timedelta(hours=keep_hours) if ends else None)
    got = retention.prune(s.offline, s.precompute, names, bound, dry_run=dry_run)
    _echo_json({"dry_run": dry_run, "datasets": got,
                "intervals": sum(len(v["removed"]) for v in got.values()),
                "bytes": sum(v["bytes"] for v in got.values())})


@main.command("airflow")
@click.option("--home", default="artifacts/airflow", type=click.Path(file_okay=False), help="AIRFLOW_HOME.")
@click.option("--port", default=8080, help="API server and UI port on 127.0.0.1 (0: a free one).")
@click.option("--password", default=None, help="UI password for user admin (default: generated, printed).")
@click.option("--spark-connect/--no-spark-connect", default=True, show_default=True,
              help="Start a Spark Connect server (on the Spark master setting's master, default local[*]) and "
                   "point the tasks at one session of it, so that the Spark steps share one Spark instead of each "
                   "starting a JVM.")
def airflow_cmd(home, port, password, spark_connect) -> None:
    """Start Airflow for real with the project's DAGs: API server + UI, scheduler, DAG processor, triggerer
    (LocalExecutor, SQLite), and a Spark Connect server for the tasks. The SOLARIS_* settings of this shell are
    passed to the tasks. Ctrl-C, SIGTERM or SIGHUP stops it all."""
    import signal
    import time

    from solaris_jobs.dev.airflow_local import LocalAirflow
    from solaris_jobs.core.settings import SPARK_CONN_ENV, env_var
    # Not when the tasks already go to a Spark Connect endpoint or to spark-submit (a Spark connection id).
    spark_connect = spark_connect and not os.environ.get(env_var("spark_master"), "").startswith("sc://") \
        and not os.environ.get(SPARK_CONN_ENV)
    af = LocalAirflow(home, port or None, password=password, spark_connect=spark_connect)

    def terminate(signum, frame):
        # SIGTERM (a process supervisor, a container stop) and SIGHUP stop the services like Ctrl-C does: they run
        # in their own sessions, so nobody else would.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    try:
        af.start()
        click.echo(f"Airflow UI and API: {af.url}  (user admin, password {af.password}); logs in {af.home}"
                   + (f"; Spark Connect at {af.spark.url}" if af.spark else ""))
        while all(p.poll() is None for p in af.procs) and (af.spark is None or af.spark.proc.poll() is None):
            time.sleep(2)
        click.echo("the Spark Connect server exited; stopping" if af.spark and af.spark.proc.poll() is not None
                   else "an Airflow service exited; stopping", err=True)
    except KeyboardInterrupt:
        pass
    finally:
        af.stop()


@main.group()
def misses() -> None:
    """The serving miss queue (pairs ranked without a fresh pair embedding)."""


@misses.command("drain")
@click.option("--offline", required=True, help="Offline store root: files go to <offline>/misses/.")
@_repo_option
def misses_drain(offline, feature_repo) -> None:
    """Move the Redis miss stream into parquet under <offline>/misses/, where the next selection reads it."""
    from solaris_jobs.online.misses import drain_misses
    cfg = _store(feature_repo)
    if cfg.kind != "redis":
        raise click.ClickException("the miss stream lives in Redis; with SQLite the serving client writes "
                                   "parquet under <offline>/misses/ directly (FeatureReader(misses_dir=...))")
    _echo_json(drain_misses(cfg, offline))


@main.group()
def lease() -> None:
    """The per-interval leases that keep two runs of one interval apart (held in the online store)."""


@lease.command("show")
@click.option("--end", required=True, help="The interval's end (UTC).")
@_repo_option
def lease_show(end, feature_repo) -> None:
    """Who holds the interval's lease (null: nobody)."""
    from solaris_jobs.online import lease as ls
    _echo_json({"interval_end": _utc_arg(end, "--end").isoformat(),
                "holder": ls.holder(_store(feature_repo), _utc_arg(end, "--end"))})


@lease.command("release")
@click.option("--end", required=True, help="The interval's end (UTC).")
@click.option("--owner", required=True, help="The run that holds it (as `solaris lease show` or the error names it).")
@_repo_option
def lease_release(end, owner, feature_repo) -> None:
    """Free an interval that a failed run still holds, so that another run may refresh it now (a lease nobody
    renews expires by itself after the lease_minutes setting)."""
    from solaris_jobs.online import lease as ls
    cfg, t = _store(feature_repo), _utc_arg(end, "--end")
    if not ls.release(cfg, t, owner):
        raise click.ClickException(f"run {owner!r} holds no lease of the interval ending {t.isoformat()} "
                                   f"(holder: {ls.holder(cfg, t)!r})")
    _echo_json({"interval_end": t.isoformat(), "released": owner})


def _utc_arg(value: str, name: str):
    from solaris_jobs.core.events import to_utc
    try:
        return to_utc(value)
    except ValueError as e:
        raise click.BadParameter(f"not a time: {value!r} ({e})", param_hint=name)


def spark_submit_main(command: str) -> None:
    """What ``spark_jobs/<script>.py`` runs under spark-submit: ``solaris <command>`` with the script's arguments."""
    main([command, *sys.argv[1:]], prog_name=sys.argv[0], obj={"spark_submit": True})


if __name__ == "__main__":
    main()
