"""`AutoDrafter`: one loader for every drafter layout hf_dspark reads, picking the class and the layout from the
checkpoint's config.json, as transformers' Auto classes pick a model class."""

from __future__ import annotations

from .errors import DrafterLoadError
from .formats import LOADER_CALL, layout_of, load_layout, unread_layout_refusal
from .identity import BLOCK_DRAFTER_TYPE, DFLASH2_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE
from .saved_config import read_config


class AutoDrafter:
    r"""Loads a drafter from a folder or Hub repository in any layout hf_dspark reads, with no convert step:

    * hf_dspark's own (`model_type` `dspark` / `eagle3_draft` / `dflash2_draft`: what `hf-dspark train` and
      `save_pretrained` write);
    * DeepSpec's `Qwen3DSparkModel` (vanilla / gated / rnn heads, with or without confidence head, DFlash) and
      `Qwen3Eagle3Model`;
    * `vllm-project/speculators`' (`speculators_model_type` `dspark`, `dflash`, `dflash2`, `eagle3`);
    * z-lab's `DFlashDraftModel` and `DFlash2DraftModel` (DFlash 2);
    * SpecForge / RadixArk `DSparkDraftModel` (also as rewritten for SGLang), LiquidAI's LFM2.5
      `Lfm2DSparkDraftModel` (interleaved rotary included) and Kimi K3's `k3_dspark` (MLA layers);
    * a target checkpoint carrying a DSpark module (DeepSeek-V4 `mtp.*`, Mistral Large 4 `mtp_dspark.*`): found
      from its config and shard index, and refused with what building it would take.

    Other layouts are converted in memory (weights checked strictly; one log line names the layout found), and a
    checkpoint whose slot j predicts anchor + j (`sample_from_anchor: false`) keeps that convention.

    ```python
    >>> drafter = hf_dspark.AutoDrafter.from_pretrained("path/or/org-name")
    >>> out = target.generate(input_ids, assistant_model=drafter, max_new_tokens=256)
    ```
    """

    def __init__(self):
        raise EnvironmentError(f"AutoDrafter is not instantiated; use {LOADER_CALL}.")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """The drafter at `pretrained_model_name_or_path` (a folder or a Hub id). `kwargs` are `from_pretrained`'s:
        `dtype`, `device_map` and the Hub options for every layout, all of them for hf_dspark's own."""
        from .modeling_dflash2 import DFlash2DraftModel
        from .modeling_dspark import DSparkDraftModel
        from .modeling_eagle3 import Eagle3DraftModel

        config, _ = read_config(pretrained_model_name_or_path, kwargs)
        own = {BLOCK_DRAFTER_TYPE: DSparkDraftModel, EAGLE3_DRAFTER_TYPE: Eagle3DraftModel,
               DFLASH2_DRAFTER_TYPE: DFlash2DraftModel}
        if config.get("model_type") in own:
            return own[config["model_type"]].from_pretrained(pretrained_model_name_or_path, **kwargs)
        module = layout_of(config)
        if module is None:
            refusal = unread_layout_refusal(config, pretrained_model_name_or_path)  # a layout known and not read
            if refusal is not None:
                raise DrafterLoadError(refusal)
            raise DrafterLoadError(
                f"{pretrained_model_name_or_path} holds no drafter layout hf_dspark reads (model_type "
                f"{config.get('model_type')!r}, architectures {config.get('architectures')}). It reads hf_dspark's "
                "own drafters, DeepSpec's Qwen3DSparkModel / Qwen3Eagle3Model, vllm-project/speculators' dspark / "
                "dflash / dflash2 / eagle3, z-lab's DFlashDraftModel / DFlash2DraftModel, SpecForge's "
                "DSparkDraftModel, LiquidAI's Lfm2DSparkDraftModel and Kimi K3's k3_dspark; a target model goes to "
                "--target / the target side."
            )
        return load_layout(pretrained_model_name_or_path, config, module, **kwargs)


__all__ = ["AutoDrafter"]
