"""Write tests/data/specforge_golden/: tiny random `DSparkDraftModel` drafters built, saved and run by SpecForge's own
code (sgl-project/SpecForge, Apache-2.0; PyPI `specforge` 0.2.0 = commit a6b6b02).

    pip install --no-deps --target /tmp/overlay_specforge specforge==0.2.0
    PYTHONPATH=/tmp/overlay_specforge python benchmarks/interop/make_specforge_goldens.py \
        [--out tests/data/specforge_golden]

`specforge` pins sglang and transformers 5.8; its draft modelling (`specforge.modeling.draft`, `.auto`,
`specforge.export.checkpoint_io`) imports only torch and transformers and runs with this repository's transformers,
so it is installed without dependencies into an overlay directory, never into the environment. Per variant the script

1. writes a tiny config.json in the shape of SpecForge's `configs/qwen3-8b-dspark.json` and builds the drafter with
   `AutoDraftModelConfig.from_file` and `AutoDraftModel.from_config` (what `specforge export --to hf` calls,
   through `materialize_draft`);
2. gives every weight a seeded random value (SpecForge's init leaves norms at 1 and biases at 0);
3. saves it as `export_to_hf` does: `model.save_pretrained(out)` then `apply_legacy_rope_scaling(out)`;
4. runs SpecForge's forward on a tiny Qwen3 target's features (`DFlashDraftModel.forward` with the target's
   embedding of `[anchor, mask x (B - 1)]`, the target's LM head), then its heads under teacher forcing
   (`apply_logits_head` with the previous tokens `[anchor, t_1 .. t_{B-1}]`, `predict_confidence`), and records
   the inputs and the per-slot logits in golden.safetensors, with the target's embedding and LM head.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, TARGET_LAYERS = 128, 64, 96, 4, 2, 16, 6
BLOCK, DRAFT_LAYERS, RANK, MASK, PROMPT = 4, 2, 16, 5, 9
VARIANTS = {  # name -> dflash_config head fields (SpecForge's names)
    "vanilla": {"markov_rank": RANK, "markov_head_type": "vanilla", "enable_confidence_head": True,
                "confidence_head_with_markov": True, "confidence_head_alpha": 1.0},
    "gated": {"markov_rank": RANK, "markov_head_type": "gated", "confidence_head_alpha": 0.0},
    "rnn": {"markov_rank": RANK, "markov_head_type": "rnn", "enable_confidence_head": True,
            "confidence_head_with_markov": False, "confidence_head_alpha": 1.0},
    "no_markov": {"markov_rank": 0, "enable_confidence_head": True, "confidence_head_alpha": 1.0},
}
LAYER_IDS = {"vanilla": [0, 2, 4], "gated": [1, 3], "rnn": [-1, 2, 4], "no_markov": [1, 4]}


def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1 and name.endswith("weight"):
                param.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed" in name or "markov_w1" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[1]))


def tiny_target(generator: torch.Generator):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=256, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    target = Qwen3ForCausalLM(config).eval()
    randomize(target, generator)
    return target


def draft_config(name: str) -> dict:
    """The shape of SpecForge's configs/qwen3-8b-dspark.json, tiny."""
    return {
        "architectures": ["DSparkDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dspark.DSparkDraftModel"}, "block_size": BLOCK,
        "dflash_config": {"attention_mode": "gqa", "mask_token_id": MASK, "projector_type": "dspark",
                          "target_layer_ids": LAYER_IDS[name], **VARIANTS[name]},
        "dtype": "float32", "head_dim": HEAD_DIM, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": INTERMEDIATE, "layer_types": ["full_attention"] * DRAFT_LAYERS,
        "max_position_embeddings": 256, "max_window_layers": DRAFT_LAYERS, "model_type": "qwen3",
        "num_attention_heads": HEADS, "num_hidden_layers": DRAFT_LAYERS, "num_key_value_heads": KV_HEADS,
        "num_target_layers": TARGET_LAYERS, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def build_and_save(name: str, folder: Path, generator: torch.Generator):
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "config.json"
        path.write_text(json.dumps(draft_config(name)))
        model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(path))).float().eval()
    randomize(model, generator)
    model.save_pretrained(folder)
    apply_legacy_rope_scaling(str(folder))
    return model


def golden(model, target, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """SpecForge's forward on a prompt's features and one block, its heads under teacher forcing."""
    ids = torch.randint(6, VOCAB, (1, PROMPT + BLOCK), generator=generator)
    with torch.no_grad():
        states = target(ids[:, :PROMPT], output_hidden_states=True).hidden_states
        features = torch.cat([states[i + 1] for i in model.target_layer_ids], dim=-1)
        block = torch.tensor([[int(ids[0, PROMPT - 1])] + [MASK] * (BLOCK - 1)])
        positions = torch.arange(PROMPT + BLOCK)[None]
        hidden = model(position_ids=positions, noise_embedding=target.model.embed_tokens(block),
                       target_hidden=features)
        base = target.lm_head(hidden)
        previous = torch.cat([block[:, :1], ids[:, PROMPT : PROMPT + BLOCK - 1]], dim=1)
        logits = model.apply_logits_head(base, prev_token_ids=previous, hidden_states=hidden)
        confidence = model.predict_confidence(hidden, prev_token_ids=previous)
    tensors = {"features": features, "block": block, "previous": previous, "base_logits": base, "logits": logits,
               "embed_tokens": target.model.embed_tokens.weight, "lm_head": target.lm_head.weight}
    if confidence is not None:
        tensors["confidence_logits"] = confidence
    return {key: value.detach().clone() for key, value in tensors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/data/specforge_golden")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    for index, name in enumerate(VARIANTS):
        generator = torch.Generator().manual_seed(100 + index)
        target = tiny_target(generator)
        folder = Path(args.out) / name
        model = build_and_save(name, folder, generator)
        save_file(golden(model, target, generator), str(folder / "golden.safetensors"))
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
