"""Versioned model references: a run resolves its models once (following links such as ``<registry>/current`` to
the version folder they point at, reading each checkpoint's version and config), checks that they belong
together, and hands executors references that say which version to load. An executor that finds another version
at the path (the file was replaced during the run) fails the task instead of stamping one version on another's
output.

Checks at resolution: the autoencoder was trained on this FM; the history length the run asks for is the FM's.
The embedding version a run stamps is ``<fm version>+<ae version>``: a code means nothing without both.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from solaris_jobs.core.contract import embedding_version

_LOADED: dict = {}         # per Python worker: (path, version, device) -> (model, meta, device)
KINDS = ("fm", "ae", "vm")


@dataclass(frozen=True)
class ModelRef:
    kind: str
    path: str                   # resolved (no links), absolute
    version: str
    config: dict
    factory: str | None = None  # an FM's ``package.module:factory`` (None: a SOLARIS checkpoint)


@dataclass(frozen=True)
class ModelSet:
    """The models one run uses (those it needs; others None)."""
    fm: ModelRef | None = None
    ae: ModelRef | None = None
    vm: ModelRef | None = None

    @property
    def embedding_version(self) -> str:
        if self.fm is None or self.ae is None:
            raise ValueError("no FM and autoencoder in this model set")
        return embedding_version(self.fm.version, self.ae.version)

    @property
    def history_len(self) -> int:
        if self.fm is None:
            raise ValueError("no FM in this model set")
        return int(self.fm.config["history_len"])

    def check_history_len(self, history_len: int | None) -> int:
        """The FM's history length; raises ValueError if ``history_len`` (None: take the FM's) is another."""
        if history_len is not None and history_len != self.history_len:
            raise ValueError(f"history_len {history_len} is not the FM's ({self.history_len}, {self.fm.path}): "
                             f"leave it unset or set it to the FM's")
        return self.history_len

    def to_dict(self) -> dict:
        # A SOLARIS checkpoint's ref is written as before #41 (no factory key): stats stay readable by older code.
        return {k: {f: x for f, x in asdict(v).items() if f != "factory" or x is not None}
                for k, v in (("fm", self.fm), ("ae", self.ae), ("vm", self.vm)) if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSet":
        return cls(**{k: ModelRef(**v) for k, v in d.items()})


def resolve_device(name: str = "auto"):
    import torch
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def task_device(name: str = "auto", context=None) -> str:
    """The device a Spark task runs its models on: with ``auto`` or ``cuda`` and GPUs that Spark assigned to this task
    (``spark.task.resource.gpu.amount`` with a discovery script on the workers), the task's first GPU, so that tasks
    sharing an executor's GPUs each use their own; otherwise ``name`` as it is (``resolve_device`` then picks CUDA or
    the CPU). ``context``: the task's ``TaskContext`` (default: the current one; none outside a task).

    Spark's address is what the discovery script reported; CUDA numbers the devices this process sees. Where
    ``CUDA_VISIBLE_DEVICES`` is set (YARN and some container runtimes set it to the assigned GPUs, by index or
    UUID), the address's position in it is the CUDA ordinal; else a numeric address is the ordinal; an address
    that maps to neither is logged and the default CUDA device used."""
    if name not in ("auto", "cuda"):
        return name
    if context is None:
        try:
            from pyspark import TaskContext
        except ImportError:
            return name
        context = TaskContext.get()
    gpus = context.resources().get("gpu") if context is not None else None
    if gpus is None or not gpus.addresses:
        return name
    addr = str(gpus.addresses[0]).strip()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if addr in visible:
        return f"cuda:{visible.index(addr)}"
    if addr.isdigit() and not visible:
        return f"cuda:{addr}"
    logging.getLogger(__name__).warning("Spark assigned GPU %r, which CUDA_VISIBLE_DEVICES=%r does not name: using "
                                        "the default CUDA device", addr, ",".join(visible))
    return "cuda"


def check_ae_of_fm(fm_meta: dict, ae_meta: dict, fm_path, ae_path) -> None:
    """Raises ValueError unless the autoencoder was trained on this FM (its checkpoint records the FM version)."""
    trained_on = ae_meta.get("extra", {}).get("fm_version")
    if trained_on != fm_meta["model_version"]:
        raise ValueError(f"{ae_path} was trained on FM {trained_on}, not on {fm_meta['model_version']} ({fm_path}): "
                         f"retrain it, or point the models folder at a matching pair")


def factory_of(spec: str):
    """The callable a ``package.module:factory`` spec names (an FM of the user's own: ``factory(path,
    map_location) -> model`` keeping ``models.protocol``); raises ValueError naming the spec when it does not
    resolve."""
    import importlib
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"FM factory {spec!r}: expected package.module:factory")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"FM factory {spec!r} does not resolve ({e}): it must be importable here and on every "
                         f"executor") from e
    if not callable(fn):
        raise ValueError(f"FM factory {spec!r} is not callable")
    return fn


def load_fm(path, factory: str | None = None, map_location="cpu"):
    """An FM and its checkpoint meta: a SOLARIS checkpoint (``factory`` None), or whatever ``factory`` builds from the
    file at ``path`` (a user's FM as it is: its version is the hash of its weights, its config its history length,
    its declared training end ``trained_until`` if it has one)."""
    from models import load_checkpoint
    if factory is None:
        return load_checkpoint(path, map_location=map_location, kind="fm")
    from models.checkpoint import model_version
    model = factory_of(factory)(str(path), map_location)
    if hasattr(model, "eval"):
        model.eval()
    until = getattr(model, "trained_until", None)
    meta = {"kind": "fm", "family": factory, "model_version": model_version(model, kind="fm"),
            "config": {"history_len": getattr(model, "history_len", None)},          # check_fm refuses it if absent
            "extra": {"factory": factory, "trained_until": None if until is None else str(until)}}
    return model, meta


def models_folder(models) -> str:
    """The models folder ``models`` names, resolved once: a local folder (its links followed, as before), or any URI
    the project's file system layer opens (``file://``, ``s3a://``, ``hdfs://``); a *file* there (a registry's
    ``current`` pointer) holds the folder it points at, absolute or relative to the pointer's own folder."""
    from solaris_jobs.core import uris
    text = str(models)
    local = "://" not in text or text.startswith("file://")
    if local:
        p = Path(text.removeprefix("file://")).resolve()
        if p.is_file():
            target = p.read_text().strip()
            return str((p.parent / target).resolve()) if "://" not in target else target
        return str(p)
    import pyarrow.fs as pafs
    fs, path = uris.filesystem(text)
    if fs.get_file_info(path).type == pafs.FileType.File:
        with fs.open_input_stream(path) as f:
            target = f.read().decode().strip()
        return target if "://" in target else uris.join(text.rsplit("/", 1)[0], target)
    return text.rstrip("/")


def _exists(path: str) -> bool:
    from solaris_jobs.core import uris
    if "://" not in path:
        return Path(path).exists()
    import pyarrow.fs as pafs
    fs, p = uris.filesystem(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def _ref(folder: str, kind: str, factory: str | None = None) -> tuple[ModelRef, dict]:
    from models import load_checkpoint
    path = f"{folder}/{kind}.pt"
    if not _exists(path):
        raise FileNotFoundError(f"{path}: no {kind.upper()} checkpoint (train one with `solaris train {kind}`)")
    if kind == "fm":
        model, meta = load_fm(path, factory)
        ref = ModelRef(kind, str(path), meta["model_version"], dict(meta["config"]), factory)
        _check_fm_once(ref, model)
        return ref, meta
    _, meta = load_checkpoint(path, kind=kind)
    return ModelRef(kind, str(path), meta["model_version"], dict(meta["config"])), meta


def of_settings(s, kinds=KINDS) -> ModelSet:
    """``resolve`` of the settings' models folder, history length and FM factory."""
    return resolve(s.models, kinds, s.precompute.history_len, fm_factory=s.fm_factory)


def resolve(models: str | os.PathLike, kinds=KINDS, history_len: int | None = None,
            fm_factory: str | None = None) -> ModelSet:
    """Resolves the checkpoints of ``kinds`` in the folder ``models`` once, and checks them.

    Args:
        models: folder with fm.pt, ae.pt, vm.pt, or a pointer file naming it (``models_folder``: links and pointers
            are followed now, once); a local path or a URI.
        history_len: the run's FM history length (None: the FM's).
        fm_factory: the FM's ``package.module:factory`` when fm.pt is a user's own FM (None: a SOLARIS checkpoint).

    Raises:
        FileNotFoundError: a checkpoint is missing.
        ValueError: the autoencoder was trained on another FM, or ``history_len`` is not the FM's.
        models.protocol.FMRefused: the FM breaks the FM protocol on a probe batch (``check_fm``), before the run
            writes anything.
    """
    folder = models_folder(models)
    refs, metas = {}, {}
    for kind in kinds:
        refs[kind], metas[kind] = _ref(folder, kind, fm_factory if kind == "fm" else None)
    if "ae" in refs and "fm" in refs:
        check_ae_of_fm(metas["fm"], metas["ae"], refs["fm"].path, refs["ae"].path)
    out = ModelSet(**refs)
    if out.fm is not None:
        out.check_history_len(history_len)
    return out


_CHECKED: set = set()        # (path, version, factory) of FMs that passed the protocol's check in this process


def _check_fm_once(ref: ModelRef, model) -> None:
    """``models.protocol.check_fm`` on ``model``, the FM of ``ref``, once per version per process."""
    if (ref.path, ref.version, ref.factory) in _CHECKED:
        return
    from models.protocol import check_fm
    check_fm(model, ref.path)
    _CHECKED.add((ref.path, ref.version, ref.factory))


def load(ref: ModelRef, device: str = "auto", threads: int | None = 1):
    """The model of ``ref``, loaded once per Python worker, after checking that the file still holds that version.
    ``threads``: torch's threads in this process (an executor's share of its cores); None leaves them as they are
    (on the driver, whose other work, such as training in the same process, keeps its own).

    Returns:
        (model in eval mode on the device, checkpoint meta, torch device).

    Raises:
        RuntimeError: the file now holds another version than the run resolved.
    """
    key = (ref.path, ref.version, ref.factory, device)
    if key not in _LOADED:
        import torch

        from models import load_checkpoint
        if threads is not None:
            torch.set_num_threads(threads)
        dev = resolve_device(device)
        model, meta = load_fm(ref.path, ref.factory, dev) if ref.kind == "fm" else \
            load_checkpoint(ref.path, map_location=dev, kind=ref.kind)
        if meta["model_version"] != ref.version:
            raise RuntimeError(f"{ref.path} now holds {meta['model_version']}, not {ref.version} that this run "
                               f"resolved and stamps: the file was replaced during the run; rerun the interval")
        _LOADED[key] = (model.to(dev), meta, dev)
    return _LOADED[key]
