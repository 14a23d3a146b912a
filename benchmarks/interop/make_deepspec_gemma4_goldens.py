"""Write tests/data/deepspec_golden/gemma4_*: tiny random Gemma 4 drafters built, saved and run by DeepSpec's own code.

    python benchmarks/interop/make_deepspec_gemma4_goldens.py --deepspec /path/to/DeepSpec [--out tests/data/deepspec_golden]

The Gemma 4 sibling of make_deepspec_goldens.py (whose helpers it reuses): the same steps, on DeepSpec's
`Gemma4DSparkModel` / `Gemma4Eagle3Model` (`deepspec/modeling/{dspark,eagle3}/gemma4/`), their `build_draft_config`
(which reads a top-level `gemma4` target config's `text_config`) and evaluators (`Gemma4DSparkEvaluator`,
`Gemma4Eagle3Evaluator`). Besides the weights it randomizes each layer's `layer_scalar` buffer (DeepSpec leaves it
at 1, which would hide a dropped scalar). DeepSpec's Gemma 4 code needs transformers 5.10.2: later releases move
`global_head_dim` into per-layer overrides (DeepSpec asserts the attribute) and drop the rotary embedding's
`layer_type` argument. Run it where that release is importable (tests/data/deepspec_golden/README.md has the
commands).

Two tiny Gemma 4 text targets (not saved; their hidden states are): sliding layers [0, 1, 3, 4] with window 4, full
layers [2, 5] with global_head_dim 32 (the sliding layers' head_dim is 16), proportional rotary on the full layers
(partial_rotary_factor 0.25), final_logit_softcapping 5 (small enough to bend these logits), untied embedding; one
with `attention_k_eq_v` (values are the keys' projection; 1 global KV head), one without (a v_proj; 2 KV heads).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_deepspec_goldens as base  # noqa: E402  (the Qwen3 goldens' helpers and constants)

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA4_TEXT = dict(vocab_size=base.VOCAB, hidden_size=base.HIDDEN, intermediate_size=base.INTERMEDIATE,
                   num_hidden_layers=base.TARGET_LAYERS, num_attention_heads=base.HEADS,
                   num_key_value_heads=base.KV_HEADS, head_dim=base.HEAD_DIM, global_head_dim=32,
                   sliding_window=4, layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
                   hidden_size_per_layer_input=0, final_logit_softcapping=5.0, max_position_embeddings=256,
                   tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
TARGETS = {"k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1), "v_proj": dict(attention_k_eq_v=False)}

# name -> (target, DeepSpec `model` config section), as in DeepSpec's config/{dspark,dflash,eagle3}/*_gemma4_12b.py.
VARIANTS = {
    "gemma4_dspark_vanilla": ("k_eq_v", dict(target_layer_ids=[-1, 1, 3], markov_rank=base.MARKOV_RANK,
                                             markov_head_type="vanilla", confidence_head_alpha=1.0,
                                             confidence_head_with_markov=True)),
    "gemma4_dspark_gated": ("k_eq_v", dict(target_layer_ids=[0, 2, 4], markov_rank=base.MARKOV_RANK,
                                           markov_head_type="gated", confidence_head_alpha=0.0)),
    "gemma4_dspark_rnn": ("v_proj", dict(target_layer_ids=[1, 2, 4], markov_rank=base.MARKOV_RANK,
                                         markov_head_type="rnn", confidence_head_alpha=1.0,
                                         confidence_head_with_markov=False)),
    "gemma4_dflash": ("v_proj", dict(target_layer_ids=[1, 3], markov_rank=0, confidence_head_alpha=0.0)),
    "gemma4_eagle3": ("k_eq_v", dict(target_layer_ids=base.EAGLE3_LAYERS)),
}


def import_deepspec(path: Path) -> SimpleNamespace:
    sys.path.insert(0, str(path))
    from deepspec.eval.dspark import evaluator as dspark_evaluator
    from deepspec.eval.eagle3 import evaluator as eagle3_evaluator
    from deepspec.modeling.dspark.gemma4 import Gemma4DSparkModel, build_draft_config as dspark_config
    from deepspec.modeling.eagle3.gemma4 import Gemma4Eagle3Model, build_draft_config as eagle3_config
    from deepspec.utils.config import ConfigNode

    return SimpleNamespace(Gemma4DSparkModel=Gemma4DSparkModel, Gemma4Eagle3Model=Gemma4Eagle3Model,
                           dspark_config=dspark_config, eagle3_config=eagle3_config, ConfigNode=ConfigNode,
                           dspark_evaluator=dspark_evaluator, eagle3_evaluator=eagle3_evaluator)


def tiny_target(kind: str, generator: torch.Generator):
    """A Gemma 4 text model (for its hidden states) and the top-level `gemma4` config DeepSpec builds drafters from."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4TextConfig

    text = Gemma4TextConfig(**GEMMA4_TEXT, **TARGETS[kind])
    target = Gemma4ForCausalLM(text).eval()
    base.randomize(target, generator)
    return target, Gemma4Config(text_config=text.to_dict())


def randomize_layer_scalars(model: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(1 + 0.2 * torch.randn(buffer.shape, generator=generator))


def build_drafter(ds, name: str, target, top_config, generator: torch.Generator):
    """DeepSpec's config builder and class, seeded weights and layer scalars, the target's embedding and head."""
    section = VARIANTS[name][1]
    if name == "gemma4_eagle3":
        args = ds.ConfigNode(target_model_name_or_path="tiny-random-gemma4", ttt_length=base.TTT_LENGTH,
                             step_loss_decay=0.8, draft_num_hidden_layers=1, **section)
        model = ds.Gemma4Eagle3Model(ds.eagle3_config(target_config=top_config, model_args=args))
    else:
        args = ds.ConfigNode(block_size=base.BLOCK_SIZE, num_draft_layers=base.DRAFT_LAYERS,
                             mask_token_id=base.MASK_TOKEN_ID, num_anchors=512, **section)
        model = ds.Gemma4DSparkModel(ds.dspark_config(top_config, args))
    base.randomize(model, generator, skip=("embed_tokens", "lm_head"))
    randomize_layer_scalars(model, generator)
    model.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    return model


def write_variant(ds, name: str, out: Path, generator: torch.Generator) -> None:
    target, top_config = tiny_target(VARIANTS[name][0], generator)
    sequence = torch.randint(6, base.VOCAB, (1, base.SEQUENCE_LENGTH), generator=generator)
    with torch.inference_mode():
        hidden_states = target(input_ids=sequence, output_hidden_states=True).hidden_states
    folder = out / name
    drafter = build_drafter(ds, name, target, top_config, generator)
    drafter.save_pretrained(folder)
    model = type(drafter).from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    for key, value in drafter.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), f"{name}: {key} changed through save/load"
    with torch.inference_mode():
        # The helpers name the Qwen3 evaluators; DeepSpec's Gemma 4 ones subclass them with the Gemma 4 classes.
        gemma4 = {"Qwen3DSparkEvaluator": ds.dspark_evaluator.Gemma4DSparkEvaluator,
                  "Qwen3Eagle3Evaluator": ds.eagle3_evaluator.Gemma4Eagle3Evaluator}
        seen = SimpleNamespace(dspark_evaluator=_Renamed(ds.dspark_evaluator, gemma4),
                               eagle3_evaluator=_Renamed(ds.eagle3_evaluator, gemma4))
        rounds = base.eagle3_rounds if name == "gemma4_eagle3" else base.dspark_rounds
        tensors = rounds(seen, model, hidden_states, sequence)
    tensors["input_ids"] = sequence
    tensors["target_hidden_states"] = torch.stack(hidden_states).squeeze(1)
    tensors = {key: value.detach().contiguous().clone() for key, value in tensors.items()}
    save_file(tensors, str(folder / "golden.safetensors"),
              metadata={"prompt_length": str(base.PROMPT_LENGTH), "accepted": str(base.ACCEPTED)})
    print(f"{name}: {({path.name: path.stat().st_size for path in sorted(folder.iterdir())})}")


class _Renamed:
    """An evaluator module with some names mapped to others (`names`); attributes set on it are set on the module,
    so a recorder installed on `forward_dspark_draft_block` is what DeepSpec's evaluator calls."""

    def __init__(self, module, names: dict):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_names", names)

    def __getattr__(self, name):
        return self._names[name] if name in self._names else getattr(self._module, name)

    def __setattr__(self, name, value):
        setattr(self._module, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspec", type=Path, required=True, help="a checkout of github.com/deepseek-ai/DeepSpec")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests/data/deepspec_golden")
    args = parser.parse_args()
    import transformers

    if transformers.__version__ != base.DEEPSPEC_TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__} is installed; DeepSpec's Gemma 4 code needs "
                 f"{base.DEEPSPEC_TRANSFORMERS} (global_head_dim as an attribute, the rotary embedding's layer_type).")
    torch.use_deterministic_algorithms(True)
    ds = import_deepspec(args.deepspec.resolve())
    generator = torch.Generator().manual_seed(20261204)
    for name in VARIANTS:
        write_variant(ds, name, args.out, generator)
    print(json.dumps(base.environment(args.deepspec), indent=2))


if __name__ == "__main__":
    main()
