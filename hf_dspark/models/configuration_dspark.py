"""Configuration of the DSpark drafter (and of DFlash, which is DSpark without its sequential and confidence heads)."""

from __future__ import annotations

from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .configuration_common import DraftPreTrainedConfig
from .identity import BLOCK_DRAFTER_TYPE
from .target_info import default_target_layer_ids


# DeepSpec's published drafter settings per target (5 layers, block 7, Markov rank 256, confidence head).
DEEPSPEC_PRESETS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-4B": {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669},
    "Qwen/Qwen3-8B": {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669},
    "Qwen/Qwen3-14B": {"target_layer_ids": [1, 10, 19, 28, 37], "mask_token_id": 151669},
    "google/gemma-4-12B-it": {"target_layer_ids": [5, 17, 29, 41, 46], "mask_token_id": 4},
}
_PRESET_COMMON = {"num_hidden_layers": 5, "block_size": 7, "markov_head": "markov", "markov_rank": 256,
                  "confidence_head": True}


@strict
class DSparkDraftConfig(DraftPreTrainedConfig):
    r"""
    Configuration of a [`DSparkDraftModel`]: a parallel drafting backbone that predicts a whole block of
    `block_size` tokens in one pass from fused target hidden states, plus an optional sequential head and an
    optional confidence head.

    The width, heads, rotary embedding and vocabulary are copied from the target (see
    [`~DSparkDraftConfig.from_target_config`]) because the drafter shares the target's frozen embedding and
    LM head.

    Args:
        vocab_size (`int`): Target vocabulary size.
        hidden_size (`int`): Target hidden size (the drafter's width).
        intermediate_size (`int`): MLP width of each drafter layer.
        num_hidden_layers (`int`): Depth of the drafter (DeepSpec uses 5).
        num_attention_heads (`int`), num_key_value_heads (`int`), head_dim (`int`): Attention shape.
        hidden_act (`str`): MLP activation.
        rms_norm_eps (`float`): RMSNorm epsilon.
        max_position_embeddings (`int`): Longest position the rotary embedding is built for.
        rope_parameters (`dict`): Rotary parameters of the target's full-attention layers.
        attention_bias (`bool`): Whether the q/k/v/o projections have biases.
        qk_norm (`bool`): RMSNorm on queries and keys per head (Qwen3 style; DeepSpec's layout).
        block_size (`int`): Width of the input block `[anchor, MASK x (block_size - 1)]`. With
            `sample_from_anchor` (the default) every slot drafts: slot k predicts the token at anchor + k + 1, so
            gamma = block_size.
        sample_from_anchor (`bool`): The slot convention. True (DeepSpec, hf_dspark): the anchor's slot is itself
            the first prediction slot. False (`vllm-project/speculators`, z-lab DFlash): slot j predicts the token
            at anchor + j, slot 0 is never used, and a round drafts block_size - 1 tokens. The same weights read
            the other way give tau ~ 1, so the field is always written and always honoured.
        target_layer_ids (`list[int]`): Target decoder layers whose outputs are fused into the context
            (HF `hidden_states[i + 1]`); -1 is the embedding output (`hidden_states[0]`), as in DeepSpec. The
            target's last layer is not allowed (HF only exposes it after the final norm).
        target_num_hidden_layers (`int`): Depth of the target the drafter was built for.
        target_model_type (`str`): `model_type` of that target (informational).
        mask_token_id (`int`): Token whose target embedding fills the block slots after the anchor.
        markov_head (`str` or `None`): Sequential head that adds a bias from the previously sampled token to
            each slot's logits: `"markov"` (low-rank bigram), `"gated"` (bigram gated by the slot's hidden
            state), `"rnn"` (a gated recurrent state carried across slots), or `None` (DFlash).
        markov_rank (`int`): Rank r of the sequential head's token embedding W1 (V x r) and output W2 (r x V).
            With a draft vocabulary both are indexed by it (W1 has one more row shared by every token outside
            it), which keeps the head, and the checkpoint, small.
        markov_w1_full_vocab (`bool`): With a draft vocabulary, keep one W1 row per target token instead (how
            DeepSpec and speculators store W1); set when such a checkpoint's rows outside the draft vocabulary
            differ, so it loads exactly.
        confidence_head (`bool`): Predict, per slot, the probability that the slot is accepted given that its
            prefix was (sigmoid of a linear map of `[h_k ; W1[x_{k-1}]]`).
        confidence_temperatures (`list[float]`, *optional*): Sequential Temperature Scaling, one temperature per
            slot applied to the confidence logit at inference (`sigmoid(logit / T_k)`), fitted left to right on
            held-out generations by `hf_dspark.evaluation.calibration.fit_sequential_temperatures`. `None` = no scaling.
        draft_vocab_size (`int`, *optional*), suffix_drafting (`bool`), initializer_range (`float`): As for every
            drafter ([`DraftPreTrainedConfig`]).
        confidence_threshold_rule (`str`): What a static `assistant_confidence_threshold` t is compared with:
            `"cumulative"` (hf_dspark's rule: drafting stops at the first slot j whose survival c_1 ... c_j is
            below t) or `"per_slot"` (DeepSpec's `--confidence-threshold`: it stops at the first slot whose own
            c_j is below t). Drafters imported from DeepSpec get `"per_slot"`, so a threshold copied from DeepSpec
            gives the same draft lengths. Both decide from c_1..c_j before x_j is drawn, so both are lossless;
            seeds the drafter's `generation_config.dspark_confidence_threshold_rule`.
        deepspec_fields (`dict`, *optional*): Fields of an imported DeepSpec config.json that hf_dspark does not
            use (e.g. `num_anchors`, DeepSpec's loss settings), written back unchanged by `hf-dspark convert` when
            the drafter is exported again.
        final_logit_softcapping (`float`, *optional*): Soft-cap the drafter's logits to `cap * tanh(logits / cap)`
            (z-lab DFlash's setting of that name); `None` leaves them as the LM head gives them.
        input_embedding_scale (`float`, *optional*): Embed the block with the target's raw embedding rows times this
            scale (z-lab DFlash's setting: the weight rows, not the target's embedding module, which may scale them
            itself, as Gemma's does); `None` embeds through the target's embedding module.
        block_causal (`bool` or `list[bool]`): In-block causal attention: slot j sees the context and block slots
            0..j only, in every layer (`True`) or in the layers whose entry is True. False (the default): every slot
            sees its whole block.
        layer_types (`list[str]`, *optional*): Per layer `"full_attention"` (the whole context) or
            `"sliding_attention"` (with `sliding_window`: a query at position q sees keys at positions p with
            q - p < sliding_window, and unless the layer is block-causal also p - q < sliding_window, as z-lab's
            DFlash measures it). `None`: every layer is full attention.
        sliding_window (`int`, *optional*): The window of the `"sliding_attention"` layers.
    """

    model_type = BLOCK_DRAFTER_TYPE
    config_kind = "dspark"  # its fields are checked by `config_checks` (`DraftPreTrainedConfig.check_fields`)
    required_saved_fields: ClassVar[dict[str, str]] = {
        **DraftPreTrainedConfig.required_saved_fields,
        "mask_token_id": "Block slots after the anchor hold this token's embedding, and a default would change the "
                         "drafter's outputs: add the id it was trained with (from_target_config takes the target's "
                         "pad token, else its EOS).",
    }
    """config.json fields a saved drafter must have: loading refuses it without them rather than guess."""

    # The fields every drafter has are `DraftPreTrainedConfig`'s; DSpark's defaults for two of them, then its own.
    num_hidden_layers: int = 5
    qk_norm: bool = True
    sample_from_anchor: bool = True
    mask_token_id: int = 0
    markov_head: str | None = "markov"
    markov_rank: int = 256
    markov_w1_full_vocab: bool = False
    confidence_head: bool = True
    confidence_temperatures: list[float] | None = None
    confidence_threshold_rule: str = "cumulative"
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    block_causal: bool | list[bool] = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def _default_layer_ids(self) -> list[int]:
        depth = self.target_num_hidden_layers or 2 * self.num_hidden_layers + 3
        return default_target_layer_ids(depth, self.num_hidden_layers)

    @property
    def layer_attention(self) -> list[tuple[bool, int | None]]:
        """Per layer (block-causal, sliding window or None): how far each layer's block queries see."""
        layers = self.num_hidden_layers
        causal = self.block_causal if isinstance(self.block_causal, list) else [self.block_causal] * layers
        types = self.layer_types or ["full_attention"] * layers
        return [(bool(causal_layer), self.sliding_window if kind == "sliding_attention" else None)
                for causal_layer, kind in zip(causal, types)]

    @property
    def restricts_attention(self) -> bool:
        """Whether some layer is block-causal or sliding-window: its masks then depend on the keys' positions."""
        return any(causal or window is not None for causal, window in self.layer_attention)

    @property
    def drafting_options(self) -> dict[str, Any]:
        """The optional drafting settings this config turns on (soft-capped logits, a scaled raw input embedding,
        in-block causal or sliding-window attention), {field: value}; empty for a plain DSpark / DFlash drafter.
        Exports to layouts without these fields refuse a drafter that has any."""
        options = {"final_logit_softcapping": self.final_logit_softcapping,
                   "input_embedding_scale": self.input_embedding_scale,
                   "block_causal": self.block_causal if any(causal for causal, _ in self.layer_attention) else None,
                   "layer_types": self.layer_types if self.sliding_window is not None else None,
                   "sliding_window": self.sliding_window}
        return {name: value for name, value in options.items() if value is not None}

    @property
    def first_draft_slot(self) -> int:
        """The block slot whose output is the first draft: 0 with `sample_from_anchor`, else 1."""
        return 0 if self.sample_from_anchor else 1

    @property
    def num_draft_slots(self) -> int:
        """The draft length the drafter was trained for (gamma in the paper): the tokens one pass proposes, `block_size`,
        or `block_size - 1` when slot 0 is unused."""
        return self.block_size - self.first_draft_slot

    @property
    def is_dflash(self) -> bool:
        """True when this is a plain DFlash backbone (no sequential head, no confidence head)."""
        return self.markov_head is None and not self.confidence_head

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **overrides: Any) -> "DSparkDraftConfig":
        """Derive a drafter config from any causal-LM config (Llama, Qwen3, Gemma, ...).

        Sizes, heads and rotary parameters come from the target (and per-head q/k norms for families that use
        them, e.g. Qwen3 and Gemma3); `target_layer_ids` defaults to
        `num_hidden_layers` layers spread evenly over the target; `mask_token_id` defaults to the target's pad
        token (else its EOS token). Any field can be overridden.
        """
        fields = cls._fields_from_target(target_config, overrides)
        num_layers = fields.setdefault("num_hidden_layers", cls.num_hidden_layers)
        if "target_layer_ids" not in overrides:
            fields["target_layer_ids"] = default_target_layer_ids(fields["target_num_hidden_layers"], num_layers)
        if "mask_token_id" not in overrides:
            fields["mask_token_id"] = _default_mask_token_id(target_config)
        return cls(**fields)

    @classmethod
    def dflash_from_target_config(cls, target_config: PreTrainedConfig, **overrides: Any) -> "DSparkDraftConfig":
        """A DFlash drafter config: the DSpark backbone with no sequential head and no confidence head."""
        overrides.setdefault("markov_head", None)
        overrides.setdefault("markov_rank", 0)
        overrides.setdefault("confidence_head", False)
        return cls.from_target_config(target_config, **overrides)

    @classmethod
    def for_target(cls, name: str, target_config: PreTrainedConfig | None = None, **overrides: Any) -> "DSparkDraftConfig":
        """DeepSpec's settings for a published target (`DEEPSPEC_PRESETS`), sized from its config.

        `target_config` defaults to `AutoConfig.from_pretrained(name)` (the Hub or its local cache). Raises if the
        name has no preset or the preset's target layers do not fit the config's depth.
        """
        if name not in DEEPSPEC_PRESETS:
            raise ValueError(f"no DeepSpec preset for {name!r}; presets: {', '.join(DEEPSPEC_PRESETS)}. "
                             "Use DSparkDraftConfig.from_target_config(target.config) for any other target.")
        if target_config is None:
            from transformers import AutoConfig

            target_config = AutoConfig.from_pretrained(name)
        preset = DEEPSPEC_PRESETS[name]
        depth = target_config.get_text_config().num_hidden_layers
        if max(preset["target_layer_ids"]) > depth - 2:
            raise ValueError(f"the {name} preset reads target layers {preset['target_layer_ids']}, which do not fit "
                             f"this {depth}-layer config; pass the config of the model the preset names")
        return cls.from_target_config(target_config, **{**_PRESET_COMMON, **preset, **overrides})


def _default_mask_token_id(target_config: PreTrainedConfig) -> int:
    text = target_config.get_text_config()
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(text, name, None)
        if value is None:
            value = getattr(target_config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


__all__ = ["DSparkDraftConfig"]
