"""Every use hf_dspark makes of transformers' private API, in one package: one named function (or class) per use,
each with a check that the installed release still behaves as relied on, pinned by the tests on both ends of the
supported range (CI runs them on the oldest release, `scripts/test_transformers_range.sh` on any other). Code outside
this package calls these functions and touches no private transformers attribute, method or module itself
(tests/coexistence/test_transformers_internals.py walks the source to hold that).

The package sits below every other hf_dspark package (it imports none of them), so the drafter models can use it too.

Modules, the private names each touches, and why:

* `cache_layers`: the engine's target cache and the static-cache runner. `cache.layers` and a layer's
  `keys` / `values` / `is_initialized`, replaced (never written into) by `crop` / `batch_select_indices`
  (`GrowingLayer` appends in place, the undo keeps references); `StaticLayer(max_cache_len=...)` and the model's
  `_previous_max_cache_length` (`use_static_layers`: `generate` sizes its next static cache from it);
  `inspect.getsource` of a decoder's `forward` (`takes_mask_mapping`: does it take ready
  masks per layer type?). Checked by `internals_problems`.
* `attention`: the attention the engine's forwards run. A config's `_attn_implementation_internal` and a model's
  `_supports_sdpa` (`mask_taking_attention` swaps in, while a forward runs, transformers' sdpa with torch's
  grouped-query kernel where it is exact, registered through `AttentionInterface`); `sdpa_attention_forward` and
  `sdpa_mask`. Checked by `attention_problems`.
* `recurrent_states`: a hybrid target's recurrent and convolution layers (`conv_states`, `recurrent_states`,
  `recurrent_states_history`, `record_past`, `DummyLayer`, `Cache.activate_past_recording(recurrent_states_to_keep=)`),
  picked per row after a round. Checked by `state_problems` on a tiny hybrid model.
* `generate_hooks`: `GenerationMixin._assisted_decoding`, `_validate_generation_mode` and
  `_extract_generation_mode_kwargs`, replaced at class level to route `generate(..., assistant_model=<drafter>)`;
  each wrapper keeps the method it replaced as `_hf_dspark_stock`. Checked by `signature_problems` (at import, and
  pinned by tests/coexistence/test_integration.py).
* `accessors`: `generation_config._pad_token_tensor`, which `_prepare_special_tokens` writes (`pad_token_tensor`),
  `config._attn_implementation` (`attention_implementation`), `_supports_logits_to_keep()`
  (`supports_logits_to_keep`), `_valid_auto_compile_criteria(...)` (`generate_would_compile`),
  `_optimize_model_for_decode` (`decoding_step_context`), `_is_stateful` (`is_stateful`), `config._name_or_path`
  (`config_name_or_path`), `config._getattr_without_heterogeneous_validation(...)` (`global_config_value`). Checked by
  `accessor_problems`.
* `trainer_hooks`: `Trainer._get_output_dir` and `Trainer._save_checkpoint`, overridden to stage checkpoints
  (`TrainerCheckpointHooks` gives them public names), and `Trainer._prepare_inputs` (`prepare_inputs`). Checked by
  `trainer_problems`.

Outside this package, hf_dspark's drafter classes (`hf_dspark/models/`) declare what transformers' model-authoring
guide has every model class declare: `_init_weights`, `_no_split_modules`, `_supports_sdpa` (`MODEL_DECLARATIONS`).
Those are definitions transformers reads, not uses of its internals, and only there are they allowed.
"""

# The private transformers names this package uses (the AST test refuses each of them anywhere else).
PRIVATE_NAMES = frozenset({
    "_assisted_decoding", "_validate_generation_mode", "_extract_generation_mode_kwargs",  # generate_hooks
    "_attn_implementation_internal", "_supports_sdpa",  # attention
    "_previous_max_cache_length",  # cache_layers
    "_pad_token_tensor", "_prepare_special_tokens", "_attn_implementation", "_supports_logits_to_keep",  # accessors
    "_valid_auto_compile_criteria", "_optimize_model_for_decode", "_is_stateful", "_name_or_path",
    "_getattr_without_heterogeneous_validation",
    "_get_output_dir", "_save_checkpoint", "_prepare_inputs",  # trainer_hooks
})

# What a model class declares for transformers to read (the model-authoring protocol), allowed in class bodies under
# hf_dspark/models/ only.
MODEL_DECLARATIONS = frozenset({"_init_weights", "_no_split_modules", "_supports_sdpa"})
