"""Model surgery: folding transforms, removing blocks, saving atomically."""

from blockfold.surgery.fold import fold_into_down_proj
from blockfold.surgery.remove import remove_blocks
from blockfold.surgery.save import MANIFEST_NAME, check_output_folder, read_manifest, save_compressed

__all__ = ["MANIFEST_NAME", "check_output_folder", "fold_into_down_proj", "read_manifest", "remove_blocks",
           "save_compressed"]
