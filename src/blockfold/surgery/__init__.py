"""Model surgery: folding transforms, removing blocks, saving atomically."""

from blockfold.surgery.fold import (
    fold_into_down_proj, fold_into_projection, fold_into_mlp_output, fold_through_linearized_norm, scale_block_output,
)
from blockfold.surgery.linearize import (
    LINEARIZED_FIELD, LOW_RANK_FIELD, attach_sliced, factor_projections, prune_projections, linearized_entries, register_linearized_classes,
    replace_sublayers,
)
from blockfold.surgery.remove import remove_blocks
from blockfold.surgery.save import (
    MANIFEST_NAME, RECIPE_NAME, check_output_folder, read_manifest, resume_folder, save_compressed, staged_folder,
    write_checkpoint,
)

__all__ = ["LINEARIZED_FIELD", "LOW_RANK_FIELD", "MANIFEST_NAME", "attach_sliced", "factor_projections", "prune_projections", "RECIPE_NAME", "check_output_folder", "fold_into_down_proj", "fold_into_projection",
           "fold_into_mlp_output", "fold_through_linearized_norm", "linearized_entries", "read_manifest", "register_linearized_classes",
           "remove_blocks", "replace_sublayers", "resume_folder", "save_compressed", "scale_block_output", "staged_folder",
           "write_checkpoint"]
