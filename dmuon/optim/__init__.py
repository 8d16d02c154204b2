from .muon import Muon
from .newton_schulz import orthogonalize

__all__ = ["Muon", "orthogonalize"]
