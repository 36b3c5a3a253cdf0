"""Self-generated calibration: the model samples its own text (ReplaceMe's data-free setting)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.progress import bar
from blockfold.recipe import CalibrationConfig


@torch.no_grad()
def generate_sequences(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: CalibrationConfig
) -> list[torch.Tensor]:
    """``num_sequences`` sampled continuations of the BOS token, each ``sequence_length`` long."""
    generator_seed = torch.random.initial_seed()
    torch.manual_seed(config.seed)
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    sequences: list[torch.Tensor] = []
    for first in bar(range(0, config.num_sequences, config.batch_size), desc="self-generating calibration"):
        count = min(config.batch_size, config.num_sequences - first)
        prompt = torch.full((count, 1), start, dtype=torch.long, device=device)
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            temperature=config.generation_temperature,
            top_p=config.generation_top_p,
            max_new_tokens=config.sequence_length - 1,
            min_new_tokens=config.sequence_length - 1,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else start,
        )
        sequences.extend(row.cpu() for row in out)
    torch.manual_seed(generator_seed)
    return sequences
