"""Model surgery: folding transforms, removing blocks, saving atomically."""

from blockfold.surgery.fold import fold_into_down_proj, fold_through_linearized_norm
from blockfold.surgery.remove import remove_blocks
from blockfold.surgery.save import MANIFEST_NAME, check_output_folder, read_manifest, save_compressed

__all__ = ["MANIFEST_NAME", "check_output_folder", "fold_into_down_proj", "fold_through_linearized_norm", "read_manifest", "remove_blocks",
           "save_compressed"]
