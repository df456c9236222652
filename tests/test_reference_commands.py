"""The reference recipe's four launch commands (tests/reference/, verbatim) pass `train.py --check` unchanged but for
the model and the dataset: its spellings (`--max_seq_len`, `--warmup_ratio`), its no-op data flags for chat data, and
its non-reentrant checkpointing under ZeRO-3 (overridden, as TRL overrides it) are taken, each with a note."""

import shlex
from pathlib import Path

import pytest

import train
from recipe.settings.configuration import configure

REFERENCE = Path(__file__).parent / "reference"


def check_argv(script: Path, model_dir, data_dir) -> list[str]:
    """`accelerate launch --config_file C train.py ARGS` as `train.py --check --accelerate_config C ARGS`."""
    words = shlex.split(script.read_text().replace("\\\n", " "))  # as bash joins continued lines
    assert words[:2] == ["accelerate", "launch"], script
    args = words[words.index("train.py") + 1:]
    for flag, local in (("--model_name_or_path", model_dir), ("--dataset_name", data_dir)):
        args[args.index(flag) + 1] = str(local)
    return ["--check", "--accelerate_config", words[words.index("--config_file") + 1], *args]


@pytest.fixture(scope="module")
def cached_model(tiny_model_dir, tmp_path_factory):
    """The tiny model where the Hugging Face cache would keep the commands' model: the adapter records its Hub id."""
    import shutil

    folder = tmp_path_factory.mktemp("hub") / "models--meta-llama--Llama-2-70b-hf" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir, folder)
    return folder


@pytest.mark.e2e  # runs the recipe's command (--check)
@pytest.mark.parametrize("script", sorted(REFERENCE.glob("*.sh")), ids=lambda path: path.stem)
def test_reference_command_passes_check(script, cached_model, chat_dir, capsys):
    argv = check_argv(script, cached_model, chat_dir)
    train.run(argv)  # a refusal would exit
    output = capsys.readouterr().out
    assert "check passed" in output, output

    config = configure(argv)
    assert config.training.max_length == 2048 and config.training.warmup_steps == 0
    assert f"given as {'max_seq_len' if '--max_seq_len' in argv else 'warmup_ratio'}" in output
    if "deepspeed" in script.stem:  # ZeRO-3 + LoRA recomputes reentrant checkpoints only
        assert config.training.activation_checkpointing_kwargs == {"use_reentrant": True}
    assert config.model.use_4bit_quantization == ("qlora" in script.stem)
    assert config.base_model_id == "meta-llama/Llama-2-70b-hf" and config.publish_to  # --push_to_hub: published
