"""PyTorch models of SOLARIS: the foundation model (FM), the autoencoder (AE) and the vertical model (VM)."""
from models.autoencoder import AEConfig, Autoencoder
from models.checkpoint import load_checkpoint, save_checkpoint
from models.common import batch_to_tensors
from models.fm import FMConfig, FoundationModel
from models.vm import TIERS, VMConfig, VerticalModel

__all__ = ["AEConfig", "Autoencoder", "FMConfig", "FoundationModel", "VMConfig", "VerticalModel", "TIERS",
           "batch_to_tensors", "load_checkpoint", "save_checkpoint"]
