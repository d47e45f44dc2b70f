"""PyTorch models of SOLARIS: the foundation model (FM), the autoencoder (AE) and the vertical model (VM), and their
checkpoint format (``checkpoint``: kind, config, version and weights in one file, so that loading rebuilds the exact
model). The only I/O here is that file; everything else (registries, versions a run resolves) lives in
``solaris_jobs.pipeline.model_refs``.

May import: ``solaris_jobs.core`` (the tiers and token vocabularies the model inputs share).
"""
from models.autoencoder import AEConfig, Autoencoder
from models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from models.common import batch_to_tensors
from models.fm import FMConfig, FoundationModel
from models.vm import TIERS, VMConfig, VerticalModel

__all__ = ["AEConfig", "Autoencoder", "FMConfig", "FoundationModel", "VMConfig", "VerticalModel", "TIERS",
           "batch_to_tensors", "CheckpointError", "load_checkpoint", "save_checkpoint"]
