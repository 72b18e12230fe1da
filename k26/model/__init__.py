from .batch import AttnBatch
from .layers import TPInfo
from .model import KimiK2, compile_layers

__all__ = ["AttnBatch", "KimiK2", "TPInfo", "compile_layers"]
