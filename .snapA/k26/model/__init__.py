from .batch import AttnBatch
from .layers import TPInfo
from .model import CompiledLayers, KimiK2

__all__ = ["AttnBatch", "CompiledLayers", "KimiK2", "TPInfo"]
