"""Mixture-of-experts layers as the recipe trains them: each expert's matrices as separate linear modules.

transformers 5 stores the experts of a MoE layer as fused 3-D parameters (`experts.gate_up_proj`: experts x 2I x H,
`experts.down_proj`: experts x H x I), not as `nn.Linear`. bitsandbytes' quantizer replaces only `nn.Linear`, so under
QLoRA the experts (96% of Mixtral's weights) would stay in 16 bits, and PEFT's `all-linear` would leave them out.
`split_experts` replaces each fused experts module by `ExpertLinears`: one module per expert holding its gate, up and
down projections as `nn.Linear` views of the fused weights (LoRA: no copy), or as bitsandbytes `Linear4bit` quantized
one expert at a time (QLoRA: the fused 16-bit tensor of a layer is freed once its experts are packed). From there the
experts are ordinary linear layers: PEFT adapts them under `all-linear`, FSDP and ZeRO-3 shard their 4-bit payloads
like the attention's (sharding.py), and the routing computes what the fused module computed.

The experts take the names of the transformers 4 checkpoints (Mixtral `w1`/`w3`/`w2`, the others
`gate_proj`/`up_proj`/`down_proj`), so an adapter trained here loads onto the stock transformers 5 model: PEFT 0.21
converts such adapters into its fused `target_parameters` form on load (peft/utils/transformers_weight_conversion.py).
gpt-oss was fused from its first release: its adapter loads onto a model split here (`split_experts`).

The router (`mlp.gate` / `mlp.router`) is a parameter of its own, not a linear module: `all-linear` never adapts it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """How one family's fused experts compute, and the per-expert names its transformers 4 checkpoints used."""

    gate: str
    up: str
    down: str
    interleaved: bool = False  # gpt-oss: gate and up alternate in gate_up_proj, stored in x @ W order, with biases


STANDARD = Layout("gate_proj", "up_proj", "down_proj")
LAYOUTS = {"MixtralExperts": Layout("w1", "w3", "w2"), "GptOssExperts": Layout("gate_proj", "up_proj", "down_proj",
                                                                               interleaved=True)}


def fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every fused experts module: a 3-D `gate_up_proj` parameter."""
    return [(name, module) for name, module in model.named_modules() if is_fused_experts(module)]


def is_fused_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and module.gate_up_proj.dim() == 3


def layout_of(module: nn.Module) -> Layout | None:
    """The module's layout, or None where it holds parameters this file does not know how to split."""
    layout = LAYOUTS.get(type(module).__name__, STANDARD)
    known = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if layout.interleaved else set())
    names = {name for name, _ in module.named_parameters(recurse=False)}
    return layout if names == known and module.down_proj.dim() == 3 else None


class Expert(nn.Module):
    """One expert: down(glu(gate(x), up(x))), its three projections named as `layout` says."""

    def __init__(self, layout: Layout, gate: nn.Module, up: nn.Module, down: nn.Module, glu):
        super().__init__()
        self.layout, self.glu = layout, glu
        setattr(self, layout.gate, gate)
        setattr(self, layout.up, up)
        setattr(self, layout.down, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = getattr(self, self.layout.gate)(x)
        up = getattr(self, self.layout.up)(x)
        return getattr(self, self.layout.down)(self.glu(gate, up))


class ExpertLinears(nn.ModuleList):
    """A MoE layer's experts, one module each; called as the fused module was: (hidden states, each token's top-k
    expert indices, their routing weights)."""

    _recipe_split_experts = True  # compat.SPLIT_EXPERTS_MARK: how compat recognises them without importing this file

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():  # the fused modules' own routing: for each expert, its (top-k slot, token) pairs
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        reached = [index for index in hit[:, 0].tolist() if index < len(self)]
        reached_set = set(reached)
        for index in reached:
            top_k_pos, token_idx = torch.where(expert_mask[index])
            out = self[index](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        # An expert no token of this rank reached still gets a (zero) gradient for each trainable parameter: FSDP
        # reduce-scatters the gradients a unit's parameters have, and a rank that sent fewer than another would stop
        # the run ("Detected mismatch between collectives": one expert's LoRA weights, seen on a 2-layer Mixtral).
        unreached = [p for index, expert in enumerate(self) if index not in reached_set
                     for p in expert.parameters() if p.requires_grad]
        if unreached:
            final = final + torch.stack([p.sum().to(final.dtype) for p in unreached]).sum() * 0
        return final


def standard_glu(act_fn):
    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act_fn(gate) * up
    return glu


def gpt_oss_glu(alpha: float, limit: float):
    """GptOssExperts._apply_gate on gate and up already apart."""
    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return glu


@dataclass(frozen=True)
class FourBit:
    """bitsandbytes' 4-bit settings, as the recipe's BitsAndBytesConfig has them for the other linear layers."""

    compute_dtype: torch.dtype
    quant_type: str
    nested: bool
    storage: torch.dtype

    @classmethod
    def of(cls, quantization_config) -> FourBit | None:
        if quantization_config is None or not getattr(quantization_config, "load_in_4bit", False):
            return None
        return cls(quantization_config.bnb_4bit_compute_dtype, quantization_config.bnb_4bit_quant_type,
                   quantization_config.bnb_4bit_use_double_quant, quantization_config.bnb_4bit_quant_storage)


class ExpertLinear(nn.Linear):
    """nn.Linear over weights given to it, so without an initialisation of its own: a large MoE builds thousands
    (Qwen3-30B-A3B: 18,432), and initialising each on the meta device was three quarters of its `--check`."""

    def reset_parameters(self) -> None:
        pass


@functools.cache
def expert_linear_4bit() -> type:
    """bitsandbytes' Linear4bit, likewise without an initialisation of its own (defined once bitsandbytes is needed)."""
    import bitsandbytes as bnb

    class ExpertLinear4bit(bnb.nn.Linear4bit):
        reset_parameters = ExpertLinear.reset_parameters

    return ExpertLinear4bit


def linear(weight: torch.Tensor, bias: torch.Tensor | None, four_bit: FourBit | None) -> nn.Module:
    """An nn.Linear over `weight` (out x in, shared, not copied), or a bitsandbytes Linear4bit holding it quantized
    (on the meta device: unquantized, sharding.receive_from_rank0 gives it rank 0's packed weight)."""
    out_features, in_features = weight.shape
    if four_bit is None:
        module = ExpertLinear(in_features, out_features, bias=bias is not None, device="meta")
        module.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        if bias is not None:
            module.bias = nn.Parameter(bias, requires_grad=bias.requires_grad)
        return module
    import bitsandbytes as bnb

    module = expert_linear_4bit()(in_features, out_features, bias=bias is not None, device="meta",
                                  compute_dtype=four_bit.compute_dtype, compress_statistics=four_bit.nested,
                                  quant_type=four_bit.quant_type, quant_storage=four_bit.storage)
    module.weight = bnb.nn.Params4bit(weight.detach().contiguous(), requires_grad=False,
                                      compress_statistics=four_bit.nested, quant_type=four_bit.quant_type,
                                      quant_storage=four_bit.storage, module=module)
    if weight.device.type != "meta":
        module.weight = module.weight.to(weight.device)  # quantizes: bitsandbytes packs on the first move
    if bias is not None:
        module.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return module


def split(module: nn.Module, layout: Layout, four_bit: FourBit | None) -> ExpertLinears:
    """`module`'s experts as ExpertLinears (the fused parameters are released by the caller's replacement)."""
    gate_up, down = module.gate_up_proj, module.down_proj
    glu = gpt_oss_glu(module.alpha, module.limit) if layout.interleaved else standard_glu(module.act_fn)
    experts = ExpertLinears()
    for e in range(gate_up.shape[0]):
        if layout.interleaved:  # x @ W: the transposes are the linear weights; gate and up alternate in the columns
            w, b = gate_up[e].t(), module.gate_up_proj_bias[e]
            parts = [(w[0::2], b[0::2]), (w[1::2], b[1::2]), (down[e].t(), module.down_proj_bias[e])]
            if four_bit is None:  # strided views: one contiguous copy each, once
                parts = [(w.contiguous(), b.contiguous()) for w, b in parts]
        else:
            half = gate_up.shape[1] // 2
            parts = [(gate_up[e, :half], None), (gate_up[e, half:], None), (down[e], None)]
        gate, up, down_linear = (linear(w, b, four_bit) for w, b in parts)
        experts.append(Expert(layout, gate, up, down_linear, glu))
    return experts


def split_experts(model: nn.Module, quantization_config=None) -> dict[str, int]:
    """Replace every fused experts module of `model` by ExpertLinears (4-bit when `quantization_config` loads in 4
    bits); returns the count of expert matrices by name, e.g. {"w1": 256, "w3": 256, "w2": 256}. Raises ValueError
    for a fused layout this file does not know. (A load through compat.TRANSFORMERS_SPLITS_EXPERTS_AS_LOADED has
    split each layer's experts as they arrived: what is left here is what a meta-device model holds.)"""
    from recipe.compat import peft_keeps_split_experts

    peft_keeps_split_experts()  # else PEFT would turn the experts' names into fused targets that no longer exist
    four_bit = FourBit.of(quantization_config)
    for name, module in fused_experts(model):
        replace_by_split(model, name, module, four_bit)
    counts: dict[str, int] = {}
    for experts in (module for module in model.modules() if isinstance(module, ExpertLinears)):
        layout = experts[0].layout
        for role in (layout.gate, layout.up, layout.down):
            counts[role] = counts.get(role, 0) + len(experts)
    return counts


def replace_by_split(model: nn.Module, name: str, module: nn.Module, four_bit: FourBit | None) -> Layout:
    """Put ExpertLinears of the fused experts `module` (at `name` in `model`) in its place; returns its layout."""
    layout = layout_of(module)
    if layout is None:
        raise ValueError(f"{name} ({type(module).__name__}) stores its experts in a layout the recipe cannot split "
                         "into linear layers; train it without 4-bit quantization, with LoRA on attention only "
                         "(--lora_target_modules q_proj,k_proj,v_proj,o_proj)")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, split(module, layout, four_bit))
    return layout


def split_as_loaded(model: nn.Module, module_name: str, quantization_config=None) -> bool:
    """Split the fused experts module at `module_name` once every one of its parameters has been loaded (not on the
    meta device): each expert becomes its Linear4bit (QLoRA) or nn.Linear (LoRA) and the layer's 16-bit fused tensors
    are released, so a load holds at most one layer's experts in 16 bits. True if it split."""
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    if not is_fused_experts(module):
        return False
    if any(param.device.type == "meta" for param in module.parameters(recurse=False)) or layout_of(module) is None:
        return False
    replace_by_split(model, module_name, module, FourBit.of(quantization_config))
    for part in model.get_submodule(module_name).modules():  # loaded: transformers' initialisation leaves them alone
        part._is_hf_initialized = True
        for param in part.parameters(recurse=False):
            param._is_hf_initialized = True
    return True


def has_split_experts(model: nn.Module) -> bool:
    return any(isinstance(module, ExpertLinears) for module in model.modules())


def is_moe(config) -> bool:
    """The model routes tokens to experts (its config names how many)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(getattr(text, key, None) for key in ("num_local_experts", "num_experts", "n_routed_experts"))


def router_weights(model: nn.Module) -> list[str]:
    """The router weight of each MoE layer, as PEFT's target_parameters names them (e.g. "mlp.gate.weight")."""
    names = {f"{name.split('.')[-2]}.{name.split('.')[-1]}.weight" for name, module in model.named_modules()
             if type(module).__name__.endswith("Router") and isinstance(getattr(module, "weight", None), nn.Parameter)}
    return sorted(names)


def mark_zero3_leaves(model: nn.Module) -> int:
    """Each MoE layer's experts as one ZeRO-3 leaf (DeepSpeed's set_z3_leaf_modules): their parameters are gathered
    whole on entry, on every rank, so no rank waits in an all-gather for an expert its tokens never reached while
    another rank's did. Returns how many layers were marked."""
    if not has_split_experts(model):
        return 0
    from deepspeed.utils import set_z3_leaf_modules

    return len(set_z3_leaf_modules(model, [ExpertLinears]))
