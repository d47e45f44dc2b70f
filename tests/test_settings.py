"""One settings object: built from the environment, JSON or flags the same way, every SOLARIS_* name in one module
and in docs/configuration.md, and the library's import direction (nothing imports the entry points; no cycles)."""
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from solaris_jobs.core import settings as st
from solaris_jobs.core.settings import PrecomputeConfig, Settings, SimulatorConfig

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"SOLARIS_[A-Z][A-Z_]*")
BASE = {"SOLARIS_DATA": "/d", "SOLARIS_OFFLINE": "s3a://bucket/off", "SOLARIS_MODELS": "/m"}


def test_settings_from_env_json_and_flags_agree():
    env = {**BASE, "SOLARIS_EXPIRE_FROM": "write", "SOLARIS_SPARK_MASTER": "local[2]",
           "SOLARIS_PRECOMPUTE": json.dumps({"lookback_days": None, "active_hours": 48,
                                             "simulator": {"n_candidates": 60, "n_popular": 30}})}
    s = Settings.from_env(env)
    assert s.offline == "s3a://bucket/off" and s.expire_from == "write" and s.precompute.lookback_days is None
    assert s.precompute.simulator == SimulatorConfig(n_candidates=60, n_popular=30)
    assert Settings.from_json(s.to_json()) == s and Settings.from_env(s.to_env()) == s
    # spark-submit drivers get everything but the master, which is spark-submit's own.
    assert s.for_spark_submit().spark_master is None and s.for_spark_submit().precompute == s.precompute
    # The flags: 0 days of lookback means the whole log; --candidates N means N with N // 2 popular.
    flagged = st.apply_flags(Settings.from_env(BASE), {"precompute.lookback_days": 0, "precompute.active_hours": 48.0,
                                                       "precompute.simulator.n_candidates": 60, "expire_from": "write",
                                                       "spark_master": "local[2]", "data": None})
    assert flagged == s
    with pytest.raises(ValueError, match=r"--settings: precompute.knn_k: Input should be greater"):
        Settings.from_json(json.dumps({**json.loads(s.to_json()), "precompute": {"knn_k": 0}}))
    assert st.apply_flags(s, {"precompute.select_share": 0.3}).precompute == PrecomputeConfig(
        lookback_days=None, active_hours=48, select_share=0.3, simulator=SimulatorConfig(n_candidates=60,
                                                                                        n_popular=30))


def test_the_defaults_are_the_evaluated_configuration(tmp_path):
    """The refresh's defaults are the configuration the replay evaluation measured, as the evaluation's own code
    builds it for its headline: a later evaluation that changes its headline must change the product with it (and
    this test names the field). The one field apart, by design: ``lookback_days``, the whole log in the
    evaluation (its log is 5 days long), 30 days in the product (equal on any log of 30 days or less)."""
    from dataclasses import fields

    from solaris_jobs.evaluation.config import EvalConfig, refresh_settings, ttls
    cfg = EvalConfig()
    evaluated = refresh_settings(cfg, tmp_path, tmp_path, tmp_path, cfg.budget)
    default = Settings(data=str(tmp_path), offline=str(tmp_path), models=str(tmp_path))
    apart = {f.name: (getattr(default.precompute, f.name), getattr(evaluated.precompute, f.name))
             for f in fields(PrecomputeConfig) if getattr(default.precompute, f.name) != getattr(evaluated.precompute,
                                                                                                f.name)}
    assert apart == {"lookback_days": (30.0, None)}, apart
    assert ttls(cfg) == st.ttl_env(st.VIEW_TTLS)
    assert default.expire_from == evaluated.expire_from
    # The replays serve as production does: the production store kind, the serving reader's own budget and cooldown.
    import inspect

    from solaris_jobs.learning.replay import ReplayPlan
    from solaris_jobs.online.reader import FeatureReader
    reader = inspect.signature(FeatureReader).parameters
    plan = ReplayPlan(pd.Timestamp(0), pd.Timestamp(1), pd.Timedelta("1h"))
    production = (reader["budget_ms"].default, reader["cooldown_s"].default)
    assert (plan.budget_ms, plan.cooldown_s) == (cfg.serving_budget_ms, cfg.serving_cooldown_s) == production
    assert cfg.serving_store == "redis"
    # The fallbacks served: the replay's, the evaluation's and a FeatureReader's by default are the tiers validation
    # chose (once chosen); the FM's recipe is the one its validation search chose (once searched).
    from solaris_jobs.evaluation import fm_search, tier_choice
    from solaris_jobs.evaluation.protocol import ModelsConfig
    from solaris_jobs.online.reader import DEFAULT_TIERS
    assert plan.tiers == tuple(cfg.tiers) == DEFAULT_TIERS and reader["tiers"].default is None
    chosen = tier_choice.committed()
    if chosen is not None:
        assert DEFAULT_TIERS == tuple(chosen["chosen"]), chosen["validation"]
    # The product's training (SOLARIS_TRAIN, `solaris train fm`) trains the evaluated FM, autoencoder and verifier.
    m, t = cfg.models, st.TrainSettings()
    from solaris_jobs.learning.training import TrainConfig
    assert TrainConfig.of(t).patience == m.fm_patience and TrainConfig.of(t).lr == 2e-3     # the AE's and verifier's
    assert (t.ae_epochs, t.verifier_epochs, t.verifier_patience) == (m.ae_epochs, m.vm_epochs, m.vm_patience)
    assert {"epochs": t.epochs, "history_len": t.history_len, "batch_size": t.batch_size, "d_model": t.d_model,
            "n_layers": t.layers, "d_interaction": t.d_interaction, "d_code": t.d_code, "fm_lr": t.fm_lr,
            "fm_weight_decay": t.fm_weight_decay, "fm_dropout": t.fm_dropout, "fm_target_user": t.fm_target_user} \
        == {"epochs": m.fm_epochs, "history_len": m.history_len, "batch_size": m.batch_size, "d_model": m.d_model,
            "n_layers": m.n_layers, "d_interaction": m.d_interaction, "d_code": m.d_code, "fm_lr": m.fm_lr,
            "fm_weight_decay": m.fm_weight_decay, "fm_dropout": m.fm_dropout, "fm_target_user": m.fm_target_user}
    # The evaluation's FM family is the product's default.
    assert t.fm_family == m.fm_family == "transformer"
    searched = fm_search.committed()
    if searched is not None:
        assert fm_search.recipe_of(ModelsConfig()) == searched["chosen"]
        assert fm_search.recipe_of(cfg.models) == searched["chosen"]
        # The transformer's points are keyed as when they were committed (a plan field added later, as family, must
        # not rename them, or a fresh clone would search again).
        at = (searched["protocol"], searched["data"], searched["code"], searched["label_delay_minutes"], ModelsConfig())
        names = {fm_search.point_name(fm_search.PLAN, p["recipe"], p["seed"], *at) for p in searched["points"]}
        assert len(names) == len(searched["points"]) and \
            all((fm_search.POINTS / f"point-{name}.json").exists() for name in names), names
    # Every family is searched the same way and evaluated with what its own search chose (its plan's start before).
    from models.checkpoint import FM_FAMILIES
    assert set(fm_search.PLANS) == set(FM_FAMILIES)
    from solaris_jobs.flows.cli import evaluate_fm_search_cmd
    assert set(next(o for o in evaluate_fm_search_cmd.params if o.name == "family").type.choices) == set(FM_FAMILIES)
    # The product's training takes the family's recipe where it is not given one (SOLARIS_TRAIN, `solaris train`).
    assert set(st.FM_RECIPES) == set(FM_FAMILIES) and st.FM_RECIPES["transformer"] == fm_search.recipe_of(ModelsConfig())
    for family, plan in fm_search.PLANS.items():
        assert plan.key() == fm_search.PLAN.key() | ({"family": family} if family != "transformer" else {})
        own, recipe = fm_search.committed(family), st.FM_RECIPES[family]
        assert recipe == (own["chosen"] if own else dict(plan.start)), family
        models = fm_search.models_for(ModelsConfig(), family)
        assert models.fm_family == family and fm_search.recipe_of(models) == recipe
        ts = st.validate_train({"fm_family": family})
        assert {k: getattr(ts, k) for k in recipe} == recipe
        given = st.validate_train({"fm_family": family, "fm_lr": 1e-4, "history_len": 7})
        assert (given.fm_lr, given.history_len, given.fm_dropout) == (1e-4, 7, recipe["fm_dropout"])
        # A config that sets a recipe field apart from the default family's keeps it (--quick's shorter history).
        quick = fm_search.models_for(ModelsConfig(history_len=30), family)
        assert quick.history_len == 30 and quick.fm_lr == recipe["fm_lr"]
    from solaris_jobs.flows.cli import FLAG_OF, train_fm
    flags = {o.name: o.default for o in train_fm.params}
    assert all(flags[k] is None for k in st.FM_RECIPES["transformer"]), FLAG_OF     # left out: the family's
    # The refresh DAG's default schedule is the evaluation's hourly cadence.
    assert cfg.cadence == "1h" and '"SOLARIS_REFRESH_CRON", "0 * * * *"' in (ROOT / "dags" /
                                                                            "solaris_refresh.py").read_text()
    # The per-user top share stays as a named option, and is not the default.
    share = PrecomputeConfig.per_user_share()
    assert share.budget_per_row is None and share.exclusion_runs == 3 and share.simulator.n_candidates == 200
    assert st.apply_flags(default, {"precompute.budget_per_row": 0}).precompute.budget_per_row is None


@pytest.mark.parametrize("env, message", [
    ({"SOLARIS_PRECOMPUTE": '{"lookback": 3}'}, r"SOLARIS_PRECOMPUTE \(precompute.lookback\): Unexpected"),
    ({"SOLARIS_PRECOMPUTE": "{oops"}, "SOLARIS_PRECOMPUTE is not JSON"),
    ({"SOLARIS_PRECOMPUTE": '{"select_share": 0}'}, r"precompute.select_share\): Input should be greater than 0"),
    ({"SOLARIS_PRECOMPUTE": '{"simulator": {"n_candidates": 5}}'}, r"n_popular \(10\) is more than n_candidates"),
    ({"SOLARIS_EXPIRE_FROM": "later"}, r"SOLARIS_EXPIRE_FROM \(expire_from\): Input should be 'event' or 'write'"),
    ({"SOLARIS_MODELS": ""}, r"set SOLARIS_MODELS \(--models\)"),
])
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        Settings.from_env({**BASE, **env})


def _py_files(*folders):
    for folder in folders:
        yield from (ROOT / folder).rglob("*.py")


def test_one_module_names_the_runtime_variables_and_the_docs_list_them_all():
    named = {}
    for path in _py_files("solaris_jobs", "models", "spark_jobs", "feature_repo"):
        found = set(NAME.findall(path.read_text()))
        if found:
            named[str(path.relative_to(ROOT))] = found
    assert list(named) == ["solaris_jobs/core/settings.py"], named
    # DAG files read only their own scheduling settings from the environment.
    for path in _py_files("dags"):
        read = set(re.findall(r"os\.environ(?:\.get\(|\[)\"(SOLARIS_[A-Z_]+)\"", path.read_text()))
        assert read and read <= set(st.DAG_ENV), (path.name, read - set(st.DAG_ENV))
        assert set(NAME.findall(path.read_text())) <= st.all_env_names(), path.name
    # The configuration page lists every variable; README and docs name no other.
    listed = set(NAME.findall((ROOT / "docs" / "configuration.md").read_text()))
    assert st.all_env_names() <= listed, sorted(st.all_env_names() - listed)
    named = set().union(*(NAME.findall(p.read_text()) for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]))
    assert named - {"SOLARIS_TTL_"} <= st.all_env_names(), sorted(named - st.all_env_names())


def test_training_settings_are_typed_with_their_defaults_and_errors_name_the_setting():
    import dataclasses
    assert dataclasses.asdict(st.train_settings({})) == {
        "epochs": 3, "history_len": 50, "batch_size": 512, "d_model": 64, "layers": 2, "d_interaction": 128,
        "d_code": 32, "max_train_rows": None, "seed": 0, "served_hours": 24, "served_every": "1h",
        "fm_lr": st.TrainSettings().fm_lr, "fm_weight_decay": st.TrainSettings().fm_weight_decay,
        "fm_dropout": st.TrainSettings().fm_dropout, "fm_target_user": st.TrainSettings().fm_target_user,
        "ae_epochs": 1, "verifier_epochs": 6, "verifier_patience": 2, "fm_family": "transformer"}
    got = st.train_settings({"SOLARIS_TRAIN": '{"epochs": 1, "served_every": "30min", "served_hours": 12}'})
    assert (got.epochs, got.served_every, got.served_hours, got.history_len) == (1, "30min", 12, 50)
    for raw, message in [('{"epochs": 0}', r"SOLARIS_TRAIN \(epochs\): Input should be greater than or equal to 1"),
                         ('{"max_train_rows": "many"}', r"SOLARIS_TRAIN \(max_train_rows\): Input should be a valid"),
                         ('{"fm_dropout": 1}', r"SOLARIS_TRAIN \(fm_dropout\): Input should be less than 1"),
                         ('{"served_every": "soon"}', r"SOLARIS_TRAIN \(served_every\): Value error, not a duration"),
                         ('{"lr": 1}', r"SOLARIS_TRAIN: unknown settings \['lr'\]; known: \['ae_epochs', 'batch_size'"),
                         ("[1]", "SOLARIS_TRAIN must be a JSON object"), ("{oops", "SOLARIS_TRAIN is not JSON")]:
        with pytest.raises(ValueError, match=message):
            st.train_settings({"SOLARIS_TRAIN": raw})


def test_a_flags_help_is_its_settings_fields_description():
    for flag in st.FLAGS:
        assert flag.help == st.describe(flag.field) + flag.note and len(flag.help) > 15, flag.flag
    for name in st.TrainSettings.__pydantic_fields__:
        assert st.describe(name, st.TrainSettings)
    with pytest.raises(KeyError, match="PrecomputeConfig.knn_hnsw_m has no description"):
        st.describe("precompute.knn_hnsw_m")


def test_only_a_local_spark_binds_loopback():
    """``SPARK_LOCAL_IP=127.0.0.1`` is the library's default only for a session wholly on this host: a driver of a
    remote master advertising 127.0.0.1 cannot be reached by its executors."""
    from solaris_jobs.pipeline.spark import loopback_only
    assert loopback_only("local[2]", {}) and loopback_only(None, {}) and loopback_only(None, {"MASTER": "local"})
    assert not loopback_only("spark://10.0.0.5:7077", {}) and not loopback_only("yarn", {})
    assert not loopback_only("k8s://https://api:6443", {}) and not loopback_only(None, {"MASTER": "spark://h:7077"})
    assert not loopback_only(None, {"PYSPARK_GATEWAY_PORT": "4040"})         # spark-submit launched the JVM


def test_spark_submit_settings_per_step_and_the_deploy_modes_refused():
    """SOLARIS_SPARK_SUBMIT: shared spark-submit settings and a step's own on top; cluster mode needs where the
    cluster finds spark_jobs/, and a standalone master cannot run it for Python (both refused, named)."""
    sub = Settings.from_env({"SOLARIS_SPARK_SUBMIT": json.dumps({
        "conf": {"a": "1"}, "py_files": ["x.zip"], "deploy_mode": "cluster", "application_root": "s3a://b/jobs/",
        "steps": {"neighbours": {"conf": {"a": "2", "b": "3"}, "py_files": ["y.zip"], "env_vars": {"E": "v"}}}})},
        require=False).spark_submit
    assert sub.operator_args("neighbours", "neighbours.py", "/here") == {
        "application": "s3a://b/jobs/neighbours.py", "conf": {"a": "2", "b": "3"}, "py_files": "x.zip,y.zip",
        "archives": None, "env_vars": {"E": "v"}, "deploy_mode": "cluster"}
    assert sub.operator_args("select", "select_candidates.py", "/here")["conf"] == {"a": "1"}
    sub.check_master("yarn")
    with pytest.raises(ValueError, match=r"standalone master \(spark://h:7077\) runs Python applications in client"):
        sub.check_master("spark://h:7077")
    # Unset, the deploy mode is the Airflow connection's (its deploy-mode extra), checked the same way.
    unset = Settings().spark_submit
    unset.check_master("spark://h:7077") or unset.check_master("spark://h:7077", "client")
    with pytest.raises(ValueError, match="standalone master"):
        unset.check_master("spark://h:7077", "cluster")
    with pytest.raises(ValueError, match="set SOLARIS_SPARK_SUBMIT application_root"):
        unset.check_master("yarn", "cluster")
    for raw, message in [('{"deploy_mode": "cluster"}', "set application_root"),
                         ('{"steps": {"embedd": {}}}', r"SOLARIS_SPARK_SUBMIT \(spark_submit.steps.embedd"),
                         ('{"deploy_mode": "both"}', "SOLARIS_SPARK_SUBMIT"), ("{", "SOLARIS_SPARK_SUBMIT is not JSON")]:
        with pytest.raises(ValueError, match=message):
            Settings.from_env({"SOLARIS_SPARK_SUBMIT": raw}, require=False)
    assert Settings().spark_submit.operator_args("embed", "fm_inference.py", "/here") == {
        "application": "/here/fm_inference.py", "conf": None, "py_files": None, "archives": None, "env_vars": None}


def test_a_tasks_gpu_address_becomes_the_cuda_ordinal_it_names(monkeypatch):
    """Spark's GPU address is the discovery script's; CUDA numbers the devices the process sees: under
    CUDA_VISIBLE_DEVICES (YARN, containers; indices or UUIDs) the address's position there is the ordinal."""
    from types import SimpleNamespace

    from solaris_jobs.pipeline.model_refs import task_device

    def ctx(*addresses):
        return SimpleNamespace(resources=lambda: {"gpu": SimpleNamespace(addresses=list(addresses))})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert task_device("auto", ctx("3")) == "cuda:3" and task_device("cpu", ctx("3")) == "cpu"
    assert task_device("auto", SimpleNamespace(resources=lambda: {})) == "auto"      # no GPU assigned: unchanged
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,3")
    assert task_device("cuda", ctx("3", "6")) == "cuda:1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb")
    assert task_device("auto", ctx("GPU-bb")) == "cuda:1" and task_device("auto", ctx("7")) == "cuda"
