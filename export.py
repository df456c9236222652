"""After training: turn a sharded checkpoint into an adapter, merge an adapter into its base, publish to the Hub.

    python export.py consolidate outputs/run/checkpoint-500             # -> outputs/run/checkpoint-500/adapter
    python export.py merge outputs/run -o outputs/run-merged             # base + adapter -> one model folder
    python export.py publish outputs/run --repo_id me/my-adapter         # private unless --public

Each runs in one process on CPU or one GPU, never inside a sharded run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from recipe.engines.checkpoints import COMPLETE, damage
from recipe.reporting.report import PLOT_FILE, model_card, read_summary
from recipe.model.model_files import REPO_DIR, load_causal_lm, local_copy_of, refuse_pickled_weights

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def refuse_inside_sharded_run() -> None:
    """Merging needs every weight whole in one process; FSDP and ZeRO-3 hold shards."""
    from recipe.platform.launch import Launch

    launch = Launch.current()
    if launch.num_processes > 1 or launch.fsdp or launch.deepspeed:
        raise SystemExit("error: merging inside a sharded (FSDP / DeepSpeed) run is not supported: the weights are "
                         "split across processes. Run `python export.py merge <adapter folder>` afterwards, in one "
                         "process, on CPU or one GPU.")


def copy_present(names, source: Path, target: Path) -> list[str]:
    copied = []
    for name in names:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied


def refuse_damaged_checkpoint(folder: Path, otherwise: str) -> None:
    """A checkpoint folder (one with this recipe's marker) whose files are no longer as they were written."""
    if (folder / COMPLETE).is_file() and (why := damage(folder)):
        raise SystemExit(f"error: {folder} is damaged: {why}. Copy it again from where it is intact, or {otherwise}.")


def consolidate(checkpoint: Path, output: Path | None = None, trusted: bool = False) -> Path:
    """A sharded FSDP checkpoint (DCP files in pytorch_model_fsdp_0/) -> a PEFT adapter folder; only one this recipe
    marked complete, unless `trusted`."""
    from accelerate.utils import merge_fsdp_weights

    shards = checkpoint / "pytorch_model_fsdp_0"
    if not trusted and not (checkpoint / COMPLETE).is_file():
        raise SystemExit(f"error: {checkpoint} has no {COMPLETE} marker: it was not written (or not finished) by this "
                         "recipe, and its DCP .metadata is a pickle, which runs whatever code it carries when read. "
                         "If you trust the files, pass --trust_checkpoint.")
    refuse_damaged_checkpoint(checkpoint, "consolidate an earlier checkpoint")
    if not (shards / ".metadata").is_file():
        raise SystemExit(f"error: {checkpoint} holds no sharded FSDP model ({shards}/.metadata is missing); pass a "
                         "checkpoint-N folder written with fsdp_state_dict_type SHARDED_STATE_DICT.")
    if not (checkpoint / "adapter_config.json").is_file():
        raise SystemExit(f"error: {checkpoint} has no adapter_config.json (train.py writes one into every checkpoint); "
                         "copy the run's adapter_config.json next to it.")
    output = output or checkpoint / "adapter"
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as merged:
        merge_fsdp_weights(str(shards), merged, safe_serialization=True)  # accelerate gathers the DCP shards
        shutil.move(Path(merged) / "model.safetensors", output / "adapter_model.safetensors")
    copy_present(("adapter_config.json", *TOKENIZER_FILES), checkpoint, output)
    return output


def merge(adapter: Path, output: Path, dtype: str = "bfloat16", base: str | None = None) -> Path:
    """Base model + adapter -> one standard model folder (with the tokenizer), in `dtype`, never quantized."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoTokenizer

    refuse_inside_sharded_run()
    refuse_damaged_checkpoint(adapter, "merge an earlier checkpoint")
    refuse_pickled_weights(str(adapter))
    config = PeftConfig.from_pretrained(adapter)
    base = base or local_copy_of(config.base_model_name_or_path)
    # A QLoRA adapter was trained against the 4-bit base; it is merged into the unquantized base (merging into 4-bit
    # weights would re-quantize them and change generations).
    model = load_causal_lm(base, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # the template added tokens during training
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


def stage_for_hub(run_dir: Path, stage: Path, token: str | None = None) -> Path:
    """The folder that will be uploaded: adapter, tokenizer, model card, plot. Checked here, before any network call."""
    missing = [name for name in (*ADAPTER_FILES, "tokenizer_config.json") if not (run_dir / name).is_file()]
    if missing:
        raise SystemExit(f"error: {run_dir} lacks {', '.join(missing)}; publish the output folder of a finished run.")
    stage.mkdir(parents=True, exist_ok=True)
    copy_present((*ADAPTER_FILES, *TOKENIZER_FILES, PLOT_FILE), run_dir, stage)
    summary = read_summary(run_dir)
    summary["plot"] = (stage / PLOT_FILE).is_file()
    (stage / "README.md").write_text(model_card(summary))  # the output folder's card, with the plot that came along
    contents = {file.name: file.read_bytes() for file in stage.iterdir()}  # read once for both checks below
    base = json.loads(contents["adapter_config.json"]).get("base_model_name_or_path") or ""
    machine = {str(run_dir.resolve()), str(REPO_DIR), f"{tempfile.gettempdir()}/", f"{Path.home()}/"}
    local = [name for name, data in contents.items() if any(path.encode() in data for path in machine)]
    where = ([f"the adapter's base is {base}, a folder on this machine"] if Path(base).is_absolute()
             or Path(base).exists() else []) + ([f"{', '.join(local)} hold paths of this machine"] if local else [])
    if where:
        raise SystemExit(f"error: {' and '.join(where)}; nobody else could load it: not uploading. Train with "
                         "--base_model_id ORG/NAME (the Hub model the folder is a copy of), or set "
                         "base_model_name_or_path in adapter_config.json.")
    token = token or _saved_token()  # HF_TOKEN, else the saved login (huggingface_hub's own order)
    for name, data in contents.items():  # a token must never travel with the files
        if token and token.encode() in data:
            raise SystemExit(f"error: {name} contains the Hub token; not uploading.")
    return stage


def _saved_token() -> str | None:
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:
        return None


def publish(run_dir: Path, repo_id: str, private: bool = True, token: str | None = None) -> str:
    """Upload the staged folder; `token` (train.py's --hub_token) or the environment's / the saved login.

    A repository that exists keeps its visibility (create_repo(exist_ok=True) changes nothing): a public one gets the
    files only when publishing publicly was asked for."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    with tempfile.TemporaryDirectory() as tmp:
        stage = stage_for_hub(run_dir, Path(tmp) / "stage", token)
        api = HfApi(token=token)
        try:
            public = not api.repo_info(repo_id).private
        except RepositoryNotFoundError:  # also what the Hub answers for a private repository of someone else
            url = str(api.create_repo(repo_id, private=private))
        else:
            if public and private:
                raise SystemExit(f"error: {repo_id} exists and is public; nothing was uploaded. Publish there "
                                 "publicly with `export.py publish --public` (train.py: --hub_private_repo false), "
                                 "or choose another --repo_id / --hub_model_id.")
            url = f"{api.endpoint}/{repo_id}"
        api.upload_folder(repo_id=repo_id, folder_path=str(stage), commit_message="Upload adapter from sft recipe")
    return url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("consolidate", help="sharded FSDP checkpoint -> PEFT adapter folder")
    c.add_argument("checkpoint", type=Path)
    c.add_argument("-o", "--output", type=Path)
    c.add_argument("--trust_checkpoint", action="store_true",
                   help="consolidate a checkpoint without this recipe's completion marker (its DCP metadata is a "
                   "pickle: only for files you trust)")
    m = commands.add_parser("merge", help="adapter + its base -> one model folder")
    m.add_argument("adapter", type=Path)
    m.add_argument("-o", "--output", type=Path, required=True)
    m.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    m.add_argument("--base", help="the base model, when not the one recorded in adapter_config.json")
    p = commands.add_parser("publish", help="upload a run's adapter, tokenizer, card and plot to the Hub")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--repo_id", required=True)
    p.add_argument("--public", action="store_true", help="make the repo public (private by default)")
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        print(f"adapter written to {consolidate(args.checkpoint, args.output, args.trust_checkpoint)}")
    elif args.command == "merge":
        print(f"merged model written to {merge(args.adapter, args.output, args.dtype, args.base)}")
    else:
        print(f"published to {publish(args.run_dir, args.repo_id, private=not args.public)}")


if __name__ == "__main__":
    sys.exit(main())
