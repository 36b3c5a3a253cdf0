"""What a compressed image encoder kept: its embeddings' agreement with the original's (cosine, per
image) and, where the images sit in class subfolders, k-nearest-neighbour accuracy of each model's
embeddings (leave one out), a training-free stand-in for a linear probe."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from blockfold.data.images import image_files, pixel_batches
from blockfold.errors import BlockfoldError
from blockfold.models.handle import ModelHandle

KNN_NEIGHBOURS = 5


def image_labels(files: list[Path], root: str | Path) -> list[str] | None:
    """Each image's class: its first folder under ``root``; None unless there are two classes or more."""
    root = Path(root).expanduser()
    labels = [path.relative_to(root).parts[0] if len(path.relative_to(root).parts) > 1 else "" for path in files]
    return labels if len(set(labels)) > 1 and "" not in labels else None


@torch.no_grad()
def image_embeddings(handle: ModelHandle, folder: str | Path, batch_size: int = 8) -> tuple[torch.Tensor, list[str] | None]:
    """One embedding per image of ``folder``: the model's pooled output (its pooler, class token or
    attention-pooling head), else the mean of its last hidden states; and the images' classes."""
    if not handle.resident:
        raise BlockfoldError("--images runs the whole encoder: drop --pipeline sequential")
    if handle.tokenizer is None:
        raise BlockfoldError(f"{handle.spec or 'the model'} has no image processor (preprocessor_config.json): save "
                             "the model's image processor beside its weights")
    files = image_files(folder)
    batches, _ = pixel_batches(files, handle.tokenizer, handle.adapter, handle.config, batch_size)
    embeddings = []
    for batch in batches:
        output = handle.model(pixel_values=batch.pixel_values.to(handle.device, handle.dtype))
        pooled = getattr(output, "pooler_output", None)
        embeddings.append((pooled if pooled is not None else output.last_hidden_state.mean(1)).float().cpu())
    return torch.cat(embeddings), image_labels(files, folder)


def knn_accuracy(embeddings: torch.Tensor, labels: list[str], neighbours: int = KNN_NEIGHBOURS) -> float:
    """Leave-one-out accuracy of a majority vote among each image's nearest others (cosine)."""
    normed = F.normalize(embeddings.double(), dim=-1)
    similarity = normed @ normed.T
    similarity.fill_diagonal_(-float("inf"))
    nearest = similarity.topk(min(neighbours, len(labels) - 1), dim=-1).indices
    hits = [Counter(labels[j] for j in row.tolist()).most_common(1)[0][0] == labels[i] for i, row in enumerate(nearest)]
    return sum(hits) / len(hits)


def embedding_agreement(model: torch.Tensor, original: torch.Tensor) -> dict:
    """Cosine between each image's embedding under the two models: mean and worst image."""
    cosine = F.cosine_similarity(model.double(), original.double(), dim=-1)
    return {"cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min()), "images": len(cosine)}
