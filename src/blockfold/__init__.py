"""blockfold: training-free depth compression of transformer LMs with fitted linear maps."""

__version__ = "0.1.0"

from blockfold.api import CompressionResult, compress  # noqa: E402
from blockfold.errors import BlockfoldError  # noqa: E402
from blockfold.models import load_model  # noqa: E402
from blockfold.recipe import CalibrationConfig, Recipe  # noqa: E402

__all__ = ["BlockfoldError", "CalibrationConfig", "CompressionResult", "Recipe", "__version__", "compress", "load_model"]
