"""Building blocks shared by every drafter: target introspection, normalisation, rotary embeddings, the
context K/V cache, and the base class that binds a drafter to the frozen embedding and LM head of its target."""

from __future__ import annotations

import json
import math
import numbers
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import logging

logger = logging.get_logger(__name__)


BLOCK_DRAFTER_TYPE = "dspark"
"""`model_type` of DSpark and DFlash drafters (`DSparkDraftConfig`)."""
EAGLE3_DRAFTER_TYPE = "eagle3_draft"
"""`model_type` of Eagle3 drafters (`Eagle3DraftConfig`)."""


def drafter_type(model) -> str | None:
    """`BLOCK_DRAFTER_TYPE`, `EAGLE3_DRAFTER_TYPE` or None. Read from the config rather than the class so that
    a drafter loaded with `trust_remote_code=True` (another copy of our classes) is recognised too."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if model_type in (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE) else None


def drafter_kind(config) -> str | None:
    """`"dspark"` (any sequential head), `"dflash"` or `"eagle3"` for a drafter config; None for anything else."""
    if config.model_type == EAGLE3_DRAFTER_TYPE:
        return "eagle3"
    if config.model_type == BLOCK_DRAFTER_TYPE:
        return "dflash" if config.markov_head is None else "dspark"
    return None


class UserInputError(ValueError):
    """A mistake the user can fix (a path, a setting, a file): the message names the problem and the fix. The
    `hf-dspark` command line prints it on one line and exits with code 2; anything else keeps its traceback."""


class DrafterTargetMismatchError(UserInputError):
    """A drafter was used with a target model whose shapes, depth or device it was not built for."""


class DrafterLoadError(UserInputError):
    """A drafter folder that cannot be loaded as it is (another architecture, a missing config field, unreadable
    weights); the message names the file, the field and the fix."""


# --------------------------------------------------------------------------------------------------------------
# Target introspection
# --------------------------------------------------------------------------------------------------------------


def target_text_config(target_config: PreTrainedConfig) -> PreTrainedConfig:
    """The decoder config of a target (the text config of multimodal wrappers such as Gemma3)."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def global_rope_parameters(text_config: PreTrainedConfig) -> dict[str, Any]:
    """The rotary parameters of the target's full-attention layers.

    Families with per-layer-type rope (Gemma3: ``{"full_attention": {...}, "sliding_attention": {...}}``) are
    reduced to the full-attention entry because a drafter attends over the whole context.
    """
    rope = getattr(text_config, "rope_parameters", None) or {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    rope = dict(rope)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    return rope


def target_shape_fields(target_config: PreTrainedConfig) -> dict[str, Any]:
    """Every size a drafter copies from its target so that it can share the target's embedding and LM head."""
    text = target_text_config(target_config)
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    hidden_act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu"
    return {
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or num_heads,
        "head_dim": head_dim,
        "hidden_act": hidden_act,
        "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
        "max_position_embeddings": getattr(text, "max_position_embeddings", 4096),
        "rope_parameters": global_rope_parameters(text),
        "target_num_hidden_layers": text.num_hidden_layers,
        "target_model_type": text.model_type,
    }


EMBEDDING_OUTPUT = -1
"""A `target_layer_ids` entry for the target's embedding output (HF `hidden_states[0]`), as in DeepSpec."""


def check_target_layer_ids(layer_ids) -> None:
    """Structural check of a drafter config's `target_layer_ids`: integers, each a decoder layer (>= 0) or
    `EMBEDDING_OUTPUT` (-1). Whether they fit a given target is `check_drafter_matches_target`'s job."""
    bad = [i for i in layer_ids if isinstance(i, bool) or not isinstance(i, int) or i < EMBEDDING_OUTPUT]
    if bad:
        raise ValueError(f"target_layer_ids must be decoder layer indices (0, 1, ...) or -1 for the embedding "
                         f"output, got {bad} in {list(layer_ids)}")


CONFIDENCE_THRESHOLD_RULES = ("cumulative", "per_slot")
"""How a static `confidence_threshold` t stops drafting: `"cumulative"` at the first slot j whose survival
c_1 ... c_j < t (hf_dspark), `"per_slot"` at the first slot whose own c_j < t (DeepSpec's --confidence-threshold)."""


def below_confidence_threshold(rule: str, survival: float, confidence: float, threshold: float) -> bool:
    """Whether slot j is not drafted under `rule` (see `CONFIDENCE_THRESHOLD_RULES`), from its conditional
    confidence c_j and the survival c_1 ... c_j. Neither looks at x_j, which keeps the draft length lossless."""
    if rule == "per_slot":
        return confidence < threshold
    if rule == "cumulative":
        return survival < threshold
    raise ValueError(f"confidence_threshold_rule must be one of {CONFIDENCE_THRESHOLD_RULES}, got {rule!r}")


# Families whose attention normalises queries and keys per head; drafters for them do the same.
QK_NORM_FAMILIES = {"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "olmo2", "olmo3"}


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to layer L-3 (DFlash's rule; gives DeepSpec's Qwen3
    presets [1, 9, 17, 25, 33] for 36 layers). Shallow targets get fewer, distinct layers."""
    last_allowed = num_target_layers - 2  # HF returns the final layer only after the final norm
    if last_allowed < 0:
        raise ValueError(f"a target needs at least 2 decoder layers to feed a drafter, got {num_target_layers}")
    low, high = min(1, last_allowed), max(min(1, last_allowed), num_target_layers - 3)
    if count == 1:
        return [(low + high) // 2]
    ids = [round(low + (high - low) * i / (count - 1)) for i in range(count)]
    return sorted(set(ids))


def check_drafter_matches_target(draft_config: PreTrainedConfig, target_config: PreTrainedConfig) -> None:
    """Raise :class:`DrafterTargetMismatchError` naming the problem and the fix when a drafter cannot serve a
    target. Called before any token is produced."""
    text = target_text_config(target_config)
    name = type(draft_config).__name__
    fix = (
        "Use a drafter trained for this target, or build one with "
        f"`{name}.from_target_config(target.config)` and train it."
    )
    if draft_config.hidden_size != text.hidden_size:
        raise DrafterTargetMismatchError(
            f"The drafter's hidden_size ({draft_config.hidden_size}) differs from the target's ({text.hidden_size}): "
            f"it cannot share the target's embedding and LM head. {fix}"
        )
    if draft_config.vocab_size != text.vocab_size:
        raise DrafterTargetMismatchError(
            f"The drafter's vocab_size ({draft_config.vocab_size}) differs from the target's ({text.vocab_size}): "
            f"they do not share a tokenizer. {fix}"
        )
    last_allowed = text.num_hidden_layers - 2
    bad = [i for i in draft_config.target_layer_ids if not EMBEDDING_OUTPUT <= i <= last_allowed]
    if bad:
        raise DrafterTargetMismatchError(
            f"The drafter reads target layers {bad}, but this target has {text.num_hidden_layers} layers "
            f"(usable ids are 0..{last_allowed}, and -1 for the embedding output; the last layer is only exposed "
            f"after the final norm). {fix}"
        )
    mask_id = getattr(draft_config, "mask_token_id", None)
    if mask_id is not None and not 0 <= mask_id < text.vocab_size:
        raise DrafterTargetMismatchError(
            f"The drafter's mask_token_id ({mask_id}) is outside the target's vocabulary of {text.vocab_size}. {fix}"
        )


# --------------------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------------------


class DraftRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DraftMLP(nn.Module):
    def __init__(self, config: PreTrainedConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DraftRotaryEmbedding(nn.Module):
    """Rotary embedding with the target's rope type and parameters (default, llama3, yarn, ...)."""

    def __init__(self, config: PreTrainedConfig):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = self.compute_inv_freq()
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def compute_inv_freq(self) -> tuple[torch.Tensor, float]:
        rope_type = self.config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            dim = self.config.head_dim
            base = self.config.rope_parameters["rope_theta"]
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        return ROPE_INIT_FUNCTIONS[rope_type](self.config)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (batch, heads, length, head_dim) by per-position (batch, length, head_dim) angles."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class DraftContextCache:
    """Per-layer keys and values of the context a drafter has already projected.

    Only context rows live here (target features for DSpark/DFlash, target features plus own chain steps for
    Eagle3); speculative rows are cropped away after each round so rejected tokens leave no trace.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []

    def get_seq_length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[-2]

    def update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (batch, kv_heads, new, head_dim) rows for one layer and return all rows of that layer."""
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is not None:
            keys = torch.cat([self.keys[layer_idx], keys], dim=-2)
            values = torch.cat([self.values[layer_idx], values], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = keys, values
        return keys, values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` rows of every layer."""
        if length < 0:
            raise ValueError(f"cannot crop a drafter cache to a negative length ({length})")
        self.keys = [None if k is None else k[..., :length, :] for k in self.keys]
        self.values = [None if v is None else v[..., :length, :] for v in self.values]


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads; ``attention_mask`` is boolean (True = may attend)."""
    return nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=attention_mask, scale=scaling, enable_gqa=keys.shape[1] != query.shape[1]
    )


# --------------------------------------------------------------------------------------------------------------
# Hub hooks: what save_pretrained / push_to_hub do beyond stock transformers, installed from above (hf_dspark.hub)
# --------------------------------------------------------------------------------------------------------------


class HubHooks:
    """Set by `hf_dspark.hub` when `import hf_dspark` runs, so that this module never imports the hub layer:
    `save_extras(folder)` writes what stock transformers needs besides the modeling code (`custom_generate/`), and
    `push(drafter, repo_id, **options)` uploads with a model card. Both stay None in a copy of this module loaded
    as remote code without hf_dspark, which then saves and pushes as stock transformers does."""

    save_extras: Callable[[str | Path], Any] | None = None
    push: Callable[..., Any] | None = None


def install_hub_hooks(*, save_extras: Callable[[str | Path], Any], push: Callable[..., Any]) -> None:
    HubHooks.save_extras, HubHooks.push = save_extras, push


def _hub_hooks() -> type[HubHooks]:
    """These hooks, or those of hf_dspark itself when this module is a remote-code copy and hf_dspark is loaded."""
    if HubHooks.save_extras is None and __name__ != "hf_dspark.models.common":
        installed = sys.modules.get("hf_dspark.models.common")
        if installed is not None and getattr(installed, "HubHooks", None) is not None:
            return installed.HubHooks
    return HubHooks


# --------------------------------------------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------------------------------------------


_RUNNABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Target dtypes a drafter follows in `attach_target(follow=True)`; under any other (float8 storage, quantized
weights reported as integers) it keeps its own dtype and its inputs are cast to it."""


class _TargetHeads:
    """Holds the target's embedding and LM head without registering them as drafter submodules, so they are
    neither saved with the drafter nor trained by it."""

    def __init__(self, embed_tokens: nn.Module, lm_head: nn.Module):
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.draft_weight: torch.Tensor | None = None  # LM-head rows of the draft vocabulary, sliced once


class DraftPreTrainedModel(PreTrainedModel):
    """Common behaviour of hf_dspark drafters: safetensors checkpoints, target binding and compatibility."""

    base_model_prefix = "drafter"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    def __init__(self, config: PreTrainedConfig):
        super().__init__(config)
        self._target_heads: _TargetHeads | None = None
        self._precision_stash: list[tuple] | None = None  # the weights a dtype-following cast replaced
        self.confidence_threshold: float | None = None
        """Optional static threshold t (confidence-headed drafters): drafting stops at the first slot j whose
        survival c_1 ... c_j falls below t, or, with `confidence_threshold_rule = "per_slot"` (DeepSpec's meaning),
        whose own c_j does. At batch 1 and in a batch alike."""
        self.confidence_threshold_rule = getattr(config, "confidence_threshold_rule", "cumulative")
        self.num_draft_tokens = None  # drafts per round: 1..config.block_size, None = block_size (checked)
        self.verification_costs = None
        """Optional `hf_dspark.scheduling.VerificationCostTable`: with a confidence head, each round drafts only
        as many tokens as maximise expected tokens per second (`ThroughputDraftLength`); at batch 1 each round
        also skips the drafter when, by the recent rounds, a plain step or a suffix proposal pays more
        (`RoundPlanner`)."""
        self.learn_round_costs: bool = True
        """Batch 1 with `verification_costs`: price each round with the target forwards and drafter passes timed
        in this loop (per forward size, smoothed, kept in `proposal_statistics`), the table filling in sizes not run
        yet. A table profiled once can be far off under other load, another context length, dtype or sampling
        setting. Timing needs the phase clock (`time_phases`: always on the CPU). False prices rounds by the table
        alone."""
        self.round_planning: bool = True
        """Batch 1: decide each round, before drafting and from earlier rounds only, whether the drafter's block, a
        suffix proposal (`suffix_drafting`) or no draft (a plain step, priced with `verification_costs`) promises
        the most tokens per second (`RoundPlanner`). False runs the drafter every round (the confidence schedule
        still sets its length)."""
        self.suffix_drafting: bool = bool(getattr(config, "suffix_drafting", False))
        """Batch 1: also propose suffix matches over the prompt and the text so far, and verify whichever proposal
        promises more tokens per second (lossless). Set False to measure the drafter alone."""
        self.proposal_statistics = None
        """`hf_dspark.scheduling.draft_length.ProposalStatistics` learnt by earlier generations at batch 1 (suffix
        acceptance, the drafter's expected tokens per round); created on first use."""
        self.verification_policy = None
        """How many drafts each row verifies when `generate()` gets a batch of prompts (the batched engine; DSpark
        and DFlash only). None derives it from the attributes above, so a drafter behaves alike at every batch
        size: a `DSparkScheduler(verification_costs)` when a cost table is set and the drafter has a confidence
        head, else `("threshold", confidence_threshold)` when a threshold is set (confidence head again), else
        `"all"` (up to `num_draft_tokens`). Otherwise a policy name (`"all"`), a `(policy, policy_arg)` pair such
        as `("fixed", 2)` or `("threshold", 0.4)`, or a scheduler object, e.g.
        `DSparkScheduler(costs, mode="two_steps_ago")`; see `hf_dspark.generation.batched`."""
        self.time_phases: bool | None = None
        """Whether generation records per-phase seconds (`last_generation_stats.seconds`). None (the default) times
        them on the CPU only: on an accelerator every reading synchronises the device first (a host round-trip per
        phase), so set True there to see where a round's time goes, at that cost."""
        self.last_generation_stats = None
        """`SpeculativeStats` of the latest `generate()` call (a batch: every request's rounds merged)."""
        self.last_batch_output = None
        """The per-request `BatchedOutput` of the latest batched `generate()` call (None until there is one)."""
        if config.draft_vocab_size is not None:
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_to_target = None

    @property
    def confidence_threshold_rule(self) -> str:
        """`"cumulative"` (default) or `"per_slot"`: what `confidence_threshold` is compared with (see
        `CONFIDENCE_THRESHOLD_RULES`); starts from `config.confidence_threshold_rule`."""
        return self._confidence_threshold_rule

    @confidence_threshold_rule.setter
    def confidence_threshold_rule(self, rule: str) -> None:
        if rule not in CONFIDENCE_THRESHOLD_RULES:
            raise ValueError(f"confidence_threshold_rule must be one of {CONFIDENCE_THRESHOLD_RULES}, got {rule!r}")
        self._confidence_threshold_rule = rule

    def below_confidence_threshold(self, survival: float, confidence: float) -> bool:
        """Whether `confidence_threshold` stops drafting at a slot with conditional confidence `confidence` and
        survival `survival` (False when no threshold is set)."""
        if self.confidence_threshold is None:
            return False
        return below_confidence_threshold(self.confidence_threshold_rule, survival, confidence,
                                          self.confidence_threshold)

    @property
    def num_draft_tokens(self) -> int | None:
        """Drafts per round, at most ``config.block_size`` (the slots the drafter was trained for); None (the
        default) drafts ``block_size``. The same rule holds for one prompt and for a batch: anything else (0, a
        negative number, more than ``block_size``) raises a ValueError when set."""
        return self._num_draft_tokens

    @num_draft_tokens.setter
    def num_draft_tokens(self, value: int | None) -> None:
        self._num_draft_tokens = _checked_draft_length(value, self.config.num_draft_slots)

    @property
    def output_vocab_size(self) -> int:
        """Width of the drafter's logits: the draft vocabulary if it has one, else the target's."""
        return self.config.draft_vocab_size or self.config.vocab_size

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft over these target token ids (e.g. the most frequent tokens of the training answers)."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if self.draft_to_target is None or token_ids.numel() != self.draft_to_target.numel():
            raise ValueError(f"expected {self.output_vocab_size} token ids, got {token_ids.numel()}")
        if token_ids.unique().numel() != token_ids.numel() or not (0 <= token_ids).all() or not (token_ids < self.config.vocab_size).all():
            raise ValueError("draft vocabulary ids must be distinct target token ids")
        self.draft_to_target.copy_(token_ids.to(self.draft_to_target.device))
        if self._target_heads is not None:
            self._target_heads.draft_weight = None

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DraftRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, DraftRotaryEmbedding):
            # Non-persistent buffer: from_pretrained leaves it uninitialised unless it is recomputed here.
            with torch.no_grad():
                module.inv_freq.copy_(module.compute_inv_freq()[0])

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a drafter from safetensors only, refusing checkpoints with missing or mis-shaped weights
        (stock loading would silently re-initialise them and the drafter would propose garbage), a config.json of
        another architecture or without a field whose default would change the drafter's outputs
        (`config_class.required_saved_fields`), and unreadable weights (`DrafterLoadError`, naming the file)."""
        converted = _load_other_layout(cls, pretrained_model_name_or_path, kwargs)
        if converted is not None:
            return converted
        if kwargs.get("use_safetensors") is False:
            raise ValueError("hf_dspark drafters load weights from safetensors only; drop use_safetensors=False.")
        kwargs["use_safetensors"] = True
        return_info = kwargs.pop("output_loading_info", False)
        _check_saved_config(cls, pretrained_model_name_or_path, kwargs)  # AutoModel passes the config it read
        from .weight_files import check_floating_weights, checked_weight_files  # it imports this module

        # use_safetensors=True still reads whatever an index or config.json's transformers_weights names (a pickle,
        # a path outside the folder): resolve and check those files before anything is read.
        files = checked_weight_files(pretrained_model_name_or_path, "drafter", **kwargs) \
            if pretrained_model_name_or_path is not None else []
        fix = (
            "It was saved for a different drafter config or is incomplete: load it with the config.json saved "
            "beside it, or re-save it with save_pretrained() from a matching drafter."
        )
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        except RuntimeError as error:
            if "mismatched_sizes" not in str(error):
                raise
            raise ValueError(
                f"The checkpoint at {pretrained_model_name_or_path!r} has weights with the wrong shape for "
                f"{cls.__name__} (see the load report above). {fix}"
            ) from error
        except SafetensorError as error:
            local = Path(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
            files = sorted(str(f) for f in local.glob("*.safetensors")) if local.is_dir() else []
            where = ", ".join(files) or f"the safetensors weights of {str(pretrained_model_name_or_path)!r}"
            raise DrafterLoadError(
                f"{where} cannot be read ({error}): the file is truncated or corrupt, e.g. by an interrupted "
                "download or copy. Download or save the drafter again."
            ) from error
        problems = []
        if info.get("missing_keys"):
            problems.append(f"missing weights {sorted(info['missing_keys'])[:8]}")
        if info.get("unexpected_keys"):
            problems.append(f"weights this drafter does not have {sorted(info['unexpected_keys'])[:8]}")
        if info.get("mismatched_keys"):
            problems.append(f"weights with the wrong shape {[k for k, *_ in info['mismatched_keys']][:8]}")
        if problems:
            raise ValueError(
                f"The checkpoint at {pretrained_model_name_or_path!r} does not fit {cls.__name__} "
                f"({'; '.join(problems)}). {fix}"
            )
        check_floating_weights(files, model, "drafter")  # int8 weights were cast into the floats silently
        return (model, info) if return_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save config and safetensors weights, plus what stock `transformers` needs to use the folder without
        hf_dspark: the modeling code with `auto_map` (our classes are registered for the Auto classes on
        `import hf_dspark`) and a `custom_generate/` folder running hf_dspark's decoding loop. With
        `push_to_hub=True` the folder is uploaded once complete (`push_to_hub(repo_id)`)."""
        upload = kwargs.pop("push_to_hub", False)
        repo_id = kwargs.pop("repo_id", None) or str(save_directory).rstrip("/").split("/")[-1]
        super().save_pretrained(save_directory, *args, **kwargs)
        hooks = _hub_hooks()
        if hooks.save_extras is None:  # this class was itself loaded as remote code, without hf_dspark
            logger.warning("hf_dspark is not loaded: %s gets no custom_generate/ folder (import hf_dspark first)",
                           save_directory)
        elif kwargs.get("is_main_process", True):
            hooks.save_extras(save_directory)
        if upload:
            self.push_to_hub(repo_id, token=kwargs.get("token"))

    def push_to_hub(self, repo_id: str, *, card: str | None = None, base_model: str | None = None,
                    eval_results=None, private: bool | None = None, token: str | None = None,
                    commit_message: str | None = None, revision: str | None = None, create_pr: bool = False,
                    **kwargs):
        """Upload the drafter with its model card to the Hub, or to the server `HF_ENDPOINT` points at.

        Args:
            repo_id: `org/name` of the model repository (created if missing).
            card: model card text; default: the card of the folder the drafter was loaded from, else one rendered
                from `hf_dspark/hub/templates/drafter_card.md` (then `base_model`, the target's Hub id, is required).
            eval_results: an `hf-dspark eval` results.json (path or dict) whose numbers fill the card's results.
        """
        push = _hub_hooks().push
        if push is None:  # loaded as remote code without hf_dspark: the stock upload (no card rendering)
            return super().push_to_hub(repo_id, private=private, token=token, commit_message=commit_message,
                                       revision=revision, create_pr=create_pr, **kwargs)
        if kwargs:
            raise TypeError(f"push_to_hub() got options hf_dspark's upload does not take: {sorted(kwargs)}")
        return push(self, repo_id, card=card, base_model=base_model, eval_results=eval_results, private=private,
                    token=token, commit_message=commit_message, revision=revision, create_pr=create_pr)

    # -- target binding -------------------------------------------------------------------------------------

    def check_compatible(self, target_config: PreTrainedConfig) -> None:
        check_drafter_matches_target(self.config, target_config)

    def attach_target(self, target: PreTrainedModel, *, follow: bool = False) -> None:
        """Share ``target``'s (frozen) input embedding and LM head; with ``follow``, first move the drafter beside
        them. `generate()` calls `attach_target(target, follow=True)` for you.

        Args:
            target: the causal LM the drafter was built for (loaded with `AutoModelForCausalLM`).
            follow: what generation wants. True moves the drafter to the device of the target's LM head, which
                computes its logits (with a `device_map` spreading the target over several devices, the drafter
                goes with the LM head; its token embeddings come back from the embedding's device, and the target's
                features must be moved to `drafter.device`), and casts it to the target's dtype when that is a
                dtype it can run in (float16, bfloat16, float32, float64): a float32 drafter drafts for a bfloat16
                target in bfloat16, as if it had been loaded with `dtype=torch.bfloat16`. The weights it replaces are
                kept: `restore_own_precision()` (which generate() calls when it returns, and the next following
                attach does first) brings the drafter's own back bit for bit. A drafter whose weights
                are not loaded (meta) or that is spread over several devices cannot follow and is refused, as is
                a target whose LM head is offloaded. False, the default and what training passes, changes nothing
                on the drafter: a float32 drafter being trained stays float32 beside a bfloat16 target, and one on
                another device than the target's embedding or LM head is refused with the fix.
        """
        self.check_compatible(target.config)
        lm_head = target.get_output_embeddings()
        if lm_head is None:
            raise DrafterTargetMismatchError(
                f"{type(target).__name__} has no LM head; load the target with AutoModelForCausalLM."
            )
        embedding = target.get_input_embeddings()
        if follow:
            self._follow(target, embedding, lm_head)
        else:
            mine = next(self.parameters()).device
            for name, module in (("input embedding", embedding), ("LM head", lm_head)):
                theirs = module.weight.device
                if theirs != mine:
                    raise DrafterTargetMismatchError(
                        f"the drafter is on {mine} but the target's {name} is on {theirs}: the drafter runs on its "
                        f"target's features and shares its embedding and LM head. Move it with "
                        f"drafter.to({str(theirs)!r}), or attach it with attach_target(target, follow=True), which "
                        "moves it and casts it to the target's dtype (what generate() does)."
                    )
        self._target_heads = _TargetHeads(embedding, lm_head)

    def attach_stored_heads(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Use a checkpoint's frozen copies of its target's input embedding (V, d) and LM head (V, d) until a target
        is attached (DeepSpec stores them), so the drafter runs, and its logits can be compared, with no target
        loaded. `attach_target` replaces them with the target's own; they are never saved with the drafter."""
        vocab, hidden = self.config.vocab_size, self.config.hidden_size
        for name, weight in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(weight.shape) != (vocab, hidden):
                raise DrafterLoadError(f"the stored {name} has shape {tuple(weight.shape)}, but the drafter's target "
                                       f"has vocab_size {vocab} and hidden_size {hidden}; the checkpoint is corrupt.")
        embedding = nn.Embedding.from_pretrained(embed_tokens.detach(), freeze=True)
        head = nn.Linear(hidden, vocab, bias=False, device=lm_head.device, dtype=lm_head.dtype).requires_grad_(False)
        head.weight.data = lm_head.detach()
        self._target_heads = _TargetHeads(embedding, head)

    def _follow(self, target: PreTrainedModel, embedding: nn.Module, lm_head: nn.Module) -> None:
        """`attach_target(follow=True)`: move the drafter to the LM head's device and cast it to the target's dtype,
        or say why it cannot."""
        head_device = lm_head.weight.device
        if head_device.type == "meta":
            raise DrafterTargetMismatchError(
                f"the target's LM head is offloaded (its weight is on the meta device, loaded only while "
                f"{type(target).__name__} runs), but the drafter computes its logits with that weight directly. Keep "
                "the LM head on a device: load the target without offloading, or with a device_map that puts "
                "'lm_head' on a GPU or the CPU."
            )
        if embedding.weight.device.type == "meta" and not hasattr(embedding, "_hf_hook"):
            raise DrafterTargetMismatchError(
                "the target's input embedding has no weights (meta device) and no offloading hook to load them; "
                "load the target's weights before generating."
            )
        unloaded = [name for name, param in self.named_parameters() if param.device.type == "meta"]
        if unloaded:
            raise DrafterTargetMismatchError(
                f"the drafter cannot follow its target to {head_device}: {len(unloaded)} of its weights "
                f"({unloaded[0]}, ...) are on the meta device, not loaded. Load the drafter whole, e.g. "
                "AutoModel.from_pretrained(path) or hf_dspark.models.loading.load_drafter(path, dtype, device), "
                "without a device_map."
            )
        spread = {str(place) for place in (getattr(self, "hf_device_map", None) or {}).values()}
        if len(spread) > 1:
            raise DrafterTargetMismatchError(
                f"the drafter is spread over {', '.join(sorted(spread))} by a device_map, but a drafter runs whole "
                f"beside its target's LM head ({head_device}); load it without device_map and generation moves it."
            )
        self.restore_own_precision()  # a cast for an earlier target starts again from the drafter's own weights
        if any(param.device != head_device for param in self.parameters()):
            self.to(head_device)
        dtype = target.dtype
        if dtype in _RUNNABLE_DTYPES:
            self._cast_floating_weights(dtype)

    def _cast_floating_weights(self, dtype: torch.dtype) -> None:
        """Cast floating parameters and saved buffers to ``dtype``, keeping the tensors they replace so that
        `restore_own_precision` brings back the drafter's own weights bit for bit. Buffers no checkpoint holds
        (rotary inverse frequencies, computed in float32 at init) keep their precision, as
        `from_pretrained(dtype=...)` leaves them, so a drafter cast here drafts exactly as one loaded in ``dtype``."""
        stash = []
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if param.is_floating_point() and param.dtype != dtype:
                    original = param.data
                    param.data = original.to(dtype)
                    stash.append((module, "parameter", name, original, param.data_ptr(), param._version))
            for name, buffer in module.named_buffers(recurse=False):
                if (buffer.is_floating_point() and buffer.dtype != dtype
                        and name not in module._non_persistent_buffers_set):
                    module._buffers[name] = cast = buffer.to(dtype)
                    stash.append((module, "buffer", name, buffer, cast.data_ptr(), cast._version))
        if stash:
            self._precision_stash = stash

    def restore_own_precision(self) -> bool:
        """Undo the dtype cast of `attach_target(follow=True)`: the drafter's weights as they were before it, bit
        for bit (a float32 drafter used with a bfloat16 target drafts in bfloat16, then is float32 again; a cast
        and a cast back would round it). generate() calls this when it returns. Weights changed since the cast
        (trained, loaded, cast by hand) are the user's: they are kept and the old ones dropped. Returns whether
        anything was restored."""
        stash, self._precision_stash = self._precision_stash, None
        if not stash:
            return False
        current = [module._parameters[name] if kind == "parameter" else module._buffers[name]
                   for module, kind, name, *_ in stash]
        if any(tensor is None or tensor.data_ptr() != pointer or tensor._version != version
               for tensor, (*_, pointer, version) in zip(current, stash)):
            return False
        for tensor, (module, kind, name, original, *_) in zip(current, stash):
            original = original.to(tensor.device)  # where the drafter went with its target
            if kind == "parameter":
                tensor.data = original
            else:
                module._buffers[name] = original
        return True

    def get_input_embeddings(self) -> None:
        """None: the drafter owns no embedding (it uses its target's, see `attach_target`). Said explicitly because
        transformers' default raises, and FSDP2 preparation (accelerate) asks for it to shard the embedding apart;
        the target's frozen embedding and LM head must stay out of the drafter's sharding."""
        return None

    def get_output_embeddings(self) -> None:
        """None: the drafter owns no LM head (its target's is shared, not a drafter parameter)."""
        return None

    @property
    def target_heads(self) -> _TargetHeads:
        if self._target_heads is None:
            raise RuntimeError(
                f"{type(self).__name__} shares its target's embedding and LM head, and none is attached. "
                "Call `drafter.attach_target(target)` first (generate() and the trainer do it for you)."
            )
        return self._target_heads

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of ``input_ids``, on the drafter's device: with a `device_map` the target's
        embedding may sit on another device than its LM head, beside which the drafter runs (`attach_target`).
        With `config.input_embedding_scale` (z-lab DFlash's setting), the embedding weight's raw rows times that
        scale, multiplied in the weight's dtype as z-lab does, bypassing any scaling inside the target's module."""
        embedding = self.target_heads.embed_tokens
        scale = getattr(self.config, "input_embedding_scale", None)
        if embedding.weight.device.type != "meta":  # meta: an offloading hook moves the ids itself
            input_ids = input_ids.to(embedding.weight.device)
        elif scale is not None:
            raise DrafterTargetMismatchError(
                "this drafter embeds with its target's raw embedding rows (input_embedding_scale), but the target's "
                "embedding is offloaded (meta device); load the target with its embedding on a device.")
        if scale is not None:
            return (nn.functional.embedding(input_ids, embedding.weight) * float(scale)).to(self.device)
        return embedding(input_ids).to(self.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The drafter's logits over its output vocabulary (the draft vocabulary if set) from final normed states:
        the target's LM head, soft-capped to `cap * tanh(logits / cap)` when `config.final_logit_softcapping` is
        set."""
        logits = self.lm_head_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / float(cap)) * float(cap)  # z-lab's expression, bit for bit
        return logits

    def lm_head_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's LM head over the drafter's output vocabulary, nothing of the drafter's own on top: what
        training reads the target's own distribution with (the target's final states through its LM head)."""
        heads = self.target_heads
        weight = heads.lm_head.weight
        if self.draft_to_target is not None:
            if heads.draft_weight is None or heads.draft_weight.device != weight.device:
                heads.draft_weight = weight.detach()[self.draft_to_target.to(weight.device)]
            weight = heads.draft_weight
        bias = getattr(heads.lm_head, "bias", None)
        if bias is not None and self.draft_to_target is not None:
            bias = bias[self.draft_to_target.to(bias.device)]
        return nn.functional.linear(hidden_states.to(weight.dtype), weight, bias)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Spread draft-vocabulary logits over the full target vocabulary (-inf for tokens never drafted)."""
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_to_target.to(logits.device), logits)

    @property
    def target_hidden_state_indices(self) -> list[int]:
        """Indices into a target's ``hidden_states`` tuple (index 0 is the embeddings) that the drafter reads:
        ``i + 1`` per target layer id, so -1 (`EMBEDDING_OUTPUT`) reads the embedding output."""
        return [i + 1 for i in self.config.target_layer_ids]

    def draft_length(self) -> int:
        """Drafts per round: `num_draft_tokens`, or ``config.num_draft_slots`` (gamma) when it is None."""
        length = _checked_draft_length(self._num_draft_tokens, self.config.num_draft_slots)
        return self.config.num_draft_slots if length is None else length


def _checked_draft_length(value, slots: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= slots:
        raise ValueError(
            f"num_draft_tokens must be an int from 1 to the drafter's {slots} draft slots (config.num_draft_slots), "
            f"or None for all of them; got {value!r}. A drafter predicts only the slots it was trained for."
        )
    return int(value)


_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "local_files_only", "revision", "subfolder")


def _load_other_layout(cls, path, kwargs: dict):
    """The drafter at `path` converted in memory when its config.json is another project's layout (DeepSpec,
    speculators, z-lab DFlash; `formats.load_layout`), else None (hf_dspark's own layout, or nothing readable:
    the stock path then says what is wrong)."""
    if path is None or kwargs.get("config") is not None:  # AutoModel already read an hf_dspark config
        return None
    try:  # absolute: a copy of this file saved as remote code (no hf_dspark beside it) reads only its own layout
        from hf_dspark.models.formats import layout_of, load_layout, read_config
    except ImportError:
        return None

    try:
        config, _ = read_config(path, kwargs)
    except (OSError, ValueError):
        return None
    module = layout_of(config)
    if module is None:
        return None
    if kwargs.pop("output_loading_info", False):
        raise UserInputError(f"{path} is a {module.FORMAT} checkpoint, converted while it loads, so there is no "
                             "transformers loading report: drop output_loading_info (the conversion is strict).")
    return load_layout(path, config, module, expected_class=cls, **kwargs)


def _check_saved_config(cls, path, kwargs: dict) -> None:
    """Refuse a drafter folder whose config.json names another architecture, or lacks a field whose default would
    silently change the drafter's outputs (`config_class.required_saved_fields`). Unreadable folders are left to
    `from_pretrained`'s own error."""
    local = Path(path, kwargs.get("subfolder") or "", "config.json")
    source = str(local) if local.is_file() else f"config.json of {str(path)!r}"
    try:
        if local.is_file():
            saved = json.loads(local.read_text(encoding="utf-8"))
        else:
            saved, _ = PreTrainedConfig.get_config_dict(path, **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
    except json.JSONDecodeError as error:
        raise DrafterLoadError(f"{source} is not valid JSON ({error}); restore it from the drafter's original "
                               "folder or save the drafter again.") from error
    except OSError:
        return
    expected = cls.config_class.model_type
    found = saved.get("model_type")
    if found != expected:
        if found in (BLOCK_DRAFTER_TYPE, EAGLE3_DRAFTER_TYPE):
            fix = "load it with AutoModel.from_pretrained (after `import hf_dspark`), which picks the class from it"
        else:
            fix = ("it is not a drafter layout hf_dspark reads (its own, DeepSpec's, vllm-project/speculators' or "
                   "z-lab DFlash's, which hf_dspark.AutoDrafter.from_pretrained(path) and this class load directly, "
                   "and `hf-dspark convert` writes out): pass a folder written by `hf-dspark train`, a drafter's "
                   "save_pretrained() or one of those projects")
        raise DrafterLoadError(f"{source} has model_type {found!r}, but {cls.__name__} is {expected!r}: {fix}.")
    for field, hint in getattr(cls.config_class, "required_saved_fields", {}).items():
        if saved.get(field) is None:
            legacy = saved.get("rope_theta") if field == "rope_parameters" else None
            extra = f" (it has the old field rope_theta={legacy}: move it into rope_parameters)" if legacy else ""
            raise DrafterLoadError(f"{source} has no {field!r}{extra}. {hint}")
    rope = saved.get("rope_parameters")
    if "rope_parameters" in getattr(cls.config_class, "required_saved_fields", {}) and not (
        isinstance(rope, dict) and "rope_theta" in rope
    ):
        raise DrafterLoadError(f"{source} has rope_parameters {rope!r} without a rope_theta. "
                               f"{cls.config_class.required_saved_fields['rope_parameters']}")


def attention_scaling(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
