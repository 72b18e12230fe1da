from .batch import AttnBatch
from .layers import TPInfo
from .model import KimiK2

__all__ = ["AttnBatch", "KimiK2", "TPInfo"]
