"""blockfold: training-free depth compression of transformer LMs with fitted linear maps.

The public names load on first use, so ``blockfold --help`` and ``import blockfold.runtime`` do not
import transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

#: public name → the module that defines it
_EXPORTS = {
    **dict.fromkeys(("CompressionResult", "compress", "evaluate", "heal", "open_model", "save"), "blockfold.api"),
    "BlockfoldError": "blockfold.errors",
    **dict.fromkeys(("ModelHandle", "load_model"), "blockfold.models"),
    **dict.fromkeys(("CalibrationConfig", "Recipe"), "blockfold.recipe"),
    "Execution": "blockfold.runtime",
    **dict.fromkeys(("NBL", "SLEB", "UIDL", "DropAttention", "DropBlock", "LaCo", "LinearPatch", "LLMPruner", "NBLBlock", "PruneComp",
                     "ReplaceMe", "SliceGPT", "Streamline", "SvdLlm"), "blockfold.settings"),
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'blockfold' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
