"""FSDP1 (raw, over gloo: accelerate does not prepare FSDP1 on CPU) wraps a LoRA model as the FSDP1 launchers do,
with PEFT's wrap policy and use_orig_params false; sharding.gather_adapter gathers its trainable parameters onto
rank 0, which saves them next to what the unwrapped model holds."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.utils.other import fsdp_auto_wrap_policy  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from sharding import gather_adapter  # noqa: E402


def main(model_dir: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # non-zero, so a half left out of the gather would show
            torch.nn.init.normal_(param)
    expected = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    wrapped = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), use_orig_params=False,
                   device_id=torch.device("cpu"))
    gathered = gather_adapter(wrapped)
    if dist.get_rank() == 0:
        torch.save({"expected": expected, "gathered": gathered}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
