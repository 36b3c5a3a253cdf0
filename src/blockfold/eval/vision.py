"""What a compressed image encoder kept: its embeddings' agreement with the original's (cosine, per
image) and, where the images sit in class subfolders, k-nearest-neighbour accuracy of each model's
embeddings (leave one out), a training-free stand-in for a linear probe; for an image-text dual encoder
(CLIP, SigLIP), zero-shot classification as the ReplaceMe paper measures it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from blockfold.data.images import image_files, pixel_batches
from blockfold.errors import BlockfoldError
from blockfold.models.handle import ModelHandle

KNN_NEIGHBOURS = 5
#: CLIP's prompt for a class name
ZERO_SHOT_TEMPLATE = "a photo of a {}."
#: a file in a zero-shot folder naming each class subfolder's class: {"n01440764": "tench", ...}
CLASS_NAMES_FILE = "class_names.json"


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


@torch.no_grad()
def zero_shot_accuracy(handle: ModelHandle, folder: str | Path, batch_size: int = 8,
                       template: str = ZERO_SHOT_TEMPLATE,
                       embedded: tuple[torch.Tensor, list[str] | None] | None = None) -> dict:
    """Top-1 and top-5 accuracy of a dual encoder picking each image's class among all classes by the
    cosine of its image embedding with the embedding of the class's prompt. Classes are the image's
    first folder under ``folder``, named by ``class_names.json`` there or by the folder (``_`` as spaces).
    ``embedded``: what ``image_embeddings`` gave for ``folder``, where it has already run."""
    import json

    from transformers import AutoTokenizer

    container = handle.container
    if container is None or not hasattr(container, "get_text_features"):
        raise BlockfoldError(f"{handle.spec or 'the model'} has no text tower: --zero-shot is for image-text dual "
                             "encoders (CLIP, SigLIP); use --images for k-NN accuracy")
    if not handle.resident:
        raise BlockfoldError("--zero-shot runs the whole model: drop --pipeline sequential")
    pooled, labels = embedded if embedded is not None else image_embeddings(handle, folder, batch_size)
    if labels is None:
        raise BlockfoldError(f"{folder}: --zero-shot needs the images in two or more class subfolders")
    names_file = Path(folder).expanduser() / CLASS_NAMES_FILE
    names = json.loads(names_file.read_text()) if names_file.is_file() else {}
    classes = sorted(set(labels))
    prompts = [template.format(names.get(label, label.replace("_", " "))) for label in classes]
    tokenizer = AutoTokenizer.from_pretrained(handle.path)
    padding = "max_length" if container.config.model_type == "siglip" else True  # SigLIP was trained padded to 64
    text = tokenizer(prompts, padding=padding, return_tensors="pt").to(handle.device)
    text_embeddings = F.normalize(_features(container.get_text_features(**text)).float(), dim=-1)
    # the image embedding get_image_features gives, from the tower's pooled output: CLIP projects it, SigLIP's
    # attention-pooling head already is the embedding
    projection = getattr(container, "visual_projection", None)
    images = pooled.to(handle.device, handle.dtype)
    images = F.normalize((projection(images) if projection is not None else images).float(), dim=-1)
    scores = (images @ text_embeddings.T).cpu()
    truth = torch.tensor([classes.index(label) for label in labels])
    ranked = scores.topk(min(5, len(classes)), dim=-1).indices
    return {"top1": float((ranked[:, 0] == truth).double().mean()),
            "top5": float((ranked == truth[:, None]).any(-1).double().mean()),
            "classes": len(classes), "images": len(labels), "template": template}


def _features(output) -> torch.Tensor:
    """The projected embeddings ``get_text_features`` returns (a tensor, or an output holding them as its pooled output)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output
