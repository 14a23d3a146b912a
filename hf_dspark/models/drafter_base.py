"""The base class of hf_dspark drafters: safetensors-only loading with the checks a drafter folder needs, saving
and pushing with what stock transformers needs to run it, the draft vocabulary, and the runtime drafting settings;
the target binding is `TargetBindingMixin`'s."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils import logging

from .drafting_config import (GENERATION_CONFIG_FILE, check_saved_settings, drafting_generation_config,
                              load_drafting_config, save_drafting_config)
from .errors import DrafterLoadError
from .hub_hooks import _hub_hooks
from .layers import DraftDecoderLayer, DraftRMSNorm, DraftRotaryEmbedding
from .saved_config import check_saved_config, load_other_layout
from .target_binding import TargetBindingMixin
from .weight_files import (HUB_OPTIONS, check_fits_before_building, check_floating_weights, checked_weight_files,
                           stored_tensor_headers)

logger = logging.get_logger(__name__)


MOVED_SETTINGS = {
    "num_draft_tokens": "num_assistant_tokens", "confidence_threshold": "assistant_confidence_threshold",
    "confidence_threshold_rule": "dspark_confidence_threshold_rule", "verification_costs": "dspark_cost_table",
    "learn_round_costs": "dspark_learn_round_costs", "round_planning": "dspark_round_planning",
    "suffix_drafting": "dspark_suffix_drafting", "verification_policy": "dspark_verification_policy",
    "time_phases": "dspark_time_phases", "proposal_statistics": None, "last_batch_output": None,
}
"""Drafter attributes of earlier releases and the `generate()` option that replaced each (None: no option)."""


class DraftPreTrainedModel(TargetBindingMixin, PreTrainedModel):
    """Common behaviour of hf_dspark drafters: safetensors checkpoints, target binding and compatibility."""

    base_model_prefix = "drafter"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    def __init__(self, config: PreTrainedConfig):
        super().__init__(config)
        self._target_heads = None  # TargetBindingMixin's: the target's embedding and LM head once attached
        self._precision_stash = None  # TargetBindingMixin's: the weights a dtype-following cast replaced
        self.generation_config = drafting_generation_config(config)
        """The drafter's drafting defaults (`num_assistant_tokens`, `assistant_confidence_threshold`, `dspark_*`;
        `hf_dspark.generation.call.settings`), saved beside its config and overridable per `generate()` call."""
        self.last_generation_stats = None
        """Convenience: the `SpeculativeStats` of the latest `generate()` call with this drafter (a batch: every
        request's rounds merged). The output of `generate(..., return_dict_in_generate=True)` carries them too."""
        if config.draft_vocab_size is not None:
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_to_target = None

    def __setattr__(self, name: str, value) -> None:
        if name in MOVED_SETTINGS:  # an assignment that would otherwise be silently ignored
            new = MOVED_SETTINGS[name]
            raise AttributeError(
                f"drafter.{name} is no longer a drafter attribute: drafting settings are generate() options. Pass "
                f"{new}=... to generate() for one call, or set drafter.generation_config.{new} for the drafter's "
                "default (saved with it)." if new else
                f"drafter.{name} is gone: what rounds learn lives in a hf_dspark.DraftingState passed to generate() "
                "as dspark_state=..., and a batch's per-request statistics are in the output of "
                "generate(..., return_dict_in_generate=True) (request_stats).")
        super().__setattr__(name, value)

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
            if module.weight is not None:  # Gemma 4's value norm has no scale
                nn.init.ones_(module.weight)
        elif isinstance(module, DraftDecoderLayer) and module.sandwich:
            nn.init.ones_(module.layer_scalar)
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
        converted = load_other_layout(cls, pretrained_model_name_or_path, kwargs)
        if converted is not None:
            return converted
        if kwargs.get("use_safetensors") is False:
            raise ValueError("hf_dspark drafters load weights from safetensors only; drop use_safetensors=False.")
        kwargs["use_safetensors"] = True
        return_info = kwargs.pop("output_loading_info", False)
        saved = check_saved_config(cls, pretrained_model_name_or_path, kwargs)  # AutoModel passes the config it read

        # use_safetensors=True still reads whatever an index or config.json's transformers_weights names (a pickle,
        # a path outside the folder): resolve and check those files before anything is read.
        files = checked_weight_files(pretrained_model_name_or_path, "drafter", **kwargs) \
            if pretrained_model_name_or_path is not None else []
        fix = (
            "It was saved for a different drafter config or is incomplete: load it with the config.json saved "
            "beside it, or re-save it with save_pretrained() from a matching drafter."
        )
        try:
            if files and saved is not None:  # the weights' shapes (headers only) against the config: nothing built
                cls._check_weights_fit(saved[0], files, Path(pretrained_model_name_or_path, kwargs.get("subfolder")
                                                              or ""), kwargs.get("config"), fix)
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        except RuntimeError as error:
            if "mismatched_sizes" not in str(error):
                raise
            raise DrafterLoadError(
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
            raise DrafterLoadError(
                f"The checkpoint at {pretrained_model_name_or_path!r} does not fit {cls.__name__} "
                f"({'; '.join(problems)}). {fix}"
            )
        check_floating_weights(files, model, "drafter")  # int8 weights were cast into the floats silently
        model.generation_config = load_drafting_config(
            pretrained_model_name_or_path, model.config, **{k: kwargs[k] for k in HUB_OPTIONS if k in kwargs})
        local = Path(pretrained_model_name_or_path, kwargs.get("subfolder") or "", GENERATION_CONFIG_FILE)
        check_saved_settings(model, str(local) if local.parent.is_dir() else
                             f"the {GENERATION_CONFIG_FILE} of {str(pretrained_model_name_or_path)!r}")
        return (model, info) if return_info else model

    @classmethod
    def _check_weights_fit(cls, saved: dict, files: list[str], where, config, fix: str) -> None:
        """The shapes in the safetensors headers of `files` against the drafter `saved` (its config.json) or
        `config` (one AutoModel passed) describes, before transformers builds it: a size the weights do not have is
        one `DrafterLoadError` naming the tensors (shared with the other layouts' readers)."""
        if not isinstance(config, PreTrainedConfig):
            config = cls.config_class.from_dict(dict(saved))
        check_fits_before_building(cls, config, stored_tensor_headers(files), where, "drafter", fix, shapes_only=True)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save config and safetensors weights, plus what stock `transformers` needs to use the folder without
        hf_dspark: the modeling code with `auto_map` (our classes are registered for the Auto classes on
        `import hf_dspark`) and a `custom_generate/` folder running hf_dspark's decoding loop. With
        `push_to_hub=True` the folder is uploaded once complete (`push_to_hub(repo_id)`)."""
        upload = kwargs.pop("push_to_hub", False)
        repo_id = kwargs.pop("repo_id", None) or str(save_directory).rstrip("/").split("/")[-1]
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            save_drafting_config(self.generation_config, save_directory)
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


__all__ = ["DraftPreTrainedModel"]
