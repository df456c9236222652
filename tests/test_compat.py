"""Canaries for compat.py: each fails when the upstream code a patch relies on changes (then the patch is looked at
again before it silently stops doing what it says)."""

import inspect

import compat


def test_peft_rewrites_moe_targets_where_the_patch_expects():
    """compat.peft_keeps_split_experts replaces two module attributes of peft.utils.transformers_weight_conversion;
    PEFT imports both from that module at call time, so the replacement is what runs."""
    import peft
    from peft.tuners.tuners_utils import BaseTuner
    from peft.utils import save_and_load

    assert peft.__version__.startswith(compat.PEFT_VERSION)
    inject = inspect.getsource(BaseTuner.inject_adapter)
    assert "from peft.utils.transformers_weight_conversion import" in inject
    assert "convert_peft_config_for_transformers(" in inject
    load = inspect.getsource(save_and_load.set_peft_model_state_dict)
    assert "from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers" \
        in load


def test_the_patch_passes_stock_models_through_and_stops_only_for_split_experts():
    from peft.utils import transformers_weight_conversion as conversion

    compat.peft_keeps_split_experts()
    compat.peft_keeps_split_experts()  # once only, however often it is asked
    assert conversion.convert_peft_config_for_transformers.__wrapped__.__module__ == conversion.__name__
    assert conversion.convert_peft_adapter_state_dict_for_transformers.__wrapped__.__module__ == conversion.__name__
    assert not hasattr(conversion.convert_peft_config_for_transformers.__wrapped__, "__wrapped__")
