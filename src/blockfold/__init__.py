"""blockfold: training-free depth compression of transformer LMs with fitted linear maps."""

__version__ = "0.2.0"

from blockfold.api import CompressionResult, compress, evaluate, heal, open_model, save  # noqa: E402
from blockfold.errors import BlockfoldError  # noqa: E402
from blockfold.models import ModelHandle, load_model  # noqa: E402
from blockfold.recipe import CalibrationConfig, Recipe  # noqa: E402
from blockfold.runtime import Execution  # noqa: E402
from blockfold.settings import NBL, SLEB, UIDL, DropAttention, DropBlock, LaCo, LinearPatch, NBLBlock, PruneComp, ReplaceMe, Streamline  # noqa: E402

__all__ = ["NBL", "SLEB", "UIDL", "BlockfoldError", "CalibrationConfig", "CompressionResult", "DropAttention",
           "DropBlock", "Execution", "LaCo", "LinearPatch", "ModelHandle", "NBLBlock", "PruneComp", "Recipe", "ReplaceMe", "Streamline", "__version__", "compress", "evaluate",
           "heal", "load_model", "open_model", "save"]
