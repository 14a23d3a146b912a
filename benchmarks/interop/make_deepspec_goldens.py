"""Write tests/data/deepspec_golden/: tiny random drafters built, saved and run by DeepSpec's own code.

    python benchmarks/interop/make_deepspec_goldens.py --deepspec /path/to/DeepSpec [--out tests/data/deepspec_golden]

DeepSpec (github.com/deepseek-ai/DeepSpec) has no package: `--deepspec` is a checkout of it, put on `sys.path` here
and never copied into this repository. For each variant this script

1. builds the drafter config with DeepSpec's own `build_draft_config` from a tiny random Qwen3 target config, and
   the drafter with DeepSpec's class (`Qwen3DSparkModel`, `Qwen3Eagle3Model`);
2. gives every weight a seeded random value (DeepSpec's init leaves norms at 1 and biases at 0, which would hide a
   mis-mapped norm or bias), then copies the target's embedding and LM head in with DeepSpec's
   `initialize_embeddings_and_head`, as its trainer does;
3. saves it with DeepSpec's `save_pretrained` (config.json + model.safetensors), reloads it as DeepSpec's evaluator
   does (`from_pretrained(..., attn_implementation="sdpa")`, float32 here instead of bfloat16);
4. runs two drafting rounds through DeepSpec's evaluator methods (`_init_context`, `_propose`, `_update`, at
   temperature 0, i.e. greedy) on the hidden states of the tiny target, recording what the drafter was given and
   the per-slot logits it produced, into golden.safetensors.

Run it with DeepSpec's pinned transformers 5.10.2 (tests/data/deepspec_golden/README.md has the commands): DeepSpec's
evaluator crops its draft cache with `DynamicCache.crop(n)`, n > 0, which later transformers releases refuse.

The verification between the rounds is simulated: `ACCEPTED` drafts are taken as accepted and the committed text is
the fixed sequence itself (the drafter only ever sees the target's hidden states of committed positions and the
anchor token, so its inputs are the same as in a real run that committed that text).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, TARGET_LAYERS = 128, 64, 96, 4, 2, 16, 6
PROMPT_LENGTH, SEQUENCE_LENGTH, ACCEPTED = 9, 20, 2
MASK_TOKEN_ID = 5
BLOCK_SIZE, DRAFT_LAYERS, MARKOV_RANK, TTT_LENGTH = 4, 2, 16, 4

# name -> DeepSpec `model` config section (as in DeepSpec's config/dspark|dflash|eagle3/*.py), tiny.
DSPARK_VARIANTS = {
    "dspark_vanilla": dict(target_layer_ids=[-1, 1, 3], markov_rank=MARKOV_RANK, markov_head_type="vanilla",
                           confidence_head_alpha=1.0, confidence_head_with_markov=True),
    "dspark_gated": dict(target_layer_ids=[0, 2, 4], markov_rank=MARKOV_RANK, markov_head_type="gated",
                         confidence_head_alpha=0.0),
    "dspark_rnn": dict(target_layer_ids=[1, 2, 4], markov_rank=MARKOV_RANK, markov_head_type="rnn",
                       confidence_head_alpha=1.0, confidence_head_with_markov=False),
    "dflash": dict(target_layer_ids=[1, 3], markov_rank=0, confidence_head_alpha=0.0),
}
DEEPSPEC_TRANSFORMERS = "5.10.2"  # DeepSpec's requirements.txt
EAGLE3_VARIANT = "eagle3"
EAGLE3_LAYERS = [0, 1, 2, 3, 4]  # DeepSpec's Eagle3 takes exactly 5 target layers, never the last one


def import_deepspec(path: Path) -> SimpleNamespace:
    sys.path.insert(0, str(path))
    from deepspec.eval.dspark import evaluator as dspark_evaluator
    from deepspec.eval.eagle3 import evaluator as eagle3_evaluator
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel, build_draft_config as dspark_config
    from deepspec.modeling.eagle3.qwen3 import Qwen3Eagle3Model, build_draft_config as eagle3_config
    from deepspec.utils.config import ConfigNode

    return SimpleNamespace(Qwen3DSparkModel=Qwen3DSparkModel, Qwen3Eagle3Model=Qwen3Eagle3Model,
                           dspark_config=dspark_config, eagle3_config=eagle3_config, ConfigNode=ConfigNode,
                           dspark_evaluator=dspark_evaluator, eagle3_evaluator=eagle3_evaluator)


def randomize(model: torch.nn.Module, generator: torch.Generator, skip=()) -> None:
    """Seeded weights of unit-scale activations: norms 1 + noise, biases small, linear maps 1/sqrt(fan_in)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(skip):
                continue
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
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    target = Qwen3ForCausalLM(config).eval()
    randomize(target, generator)
    return target


def build_drafter(ds, name: str, target, generator: torch.Generator):
    """DeepSpec's config builder and class, seeded weights, the target's embedding and LM head copied in."""
    if name == EAGLE3_VARIANT:
        args = ds.ConfigNode(target_model_name_or_path="tiny-random-qwen3", target_layer_ids=EAGLE3_LAYERS,
                             ttt_length=TTT_LENGTH, step_loss_decay=0.8, draft_num_hidden_layers=1)
        model = ds.Qwen3Eagle3Model(ds.eagle3_config(target_config=target.config, model_args=args))
    else:
        args = ds.ConfigNode(block_size=BLOCK_SIZE, num_draft_layers=DRAFT_LAYERS, mask_token_id=MASK_TOKEN_ID,
                             num_anchors=512, **DSPARK_VARIANTS[name])
        model = ds.Qwen3DSparkModel(ds.dspark_config(target.config, args))
    randomize(model, generator, skip=("embed_tokens", "lm_head"))
    model.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    return model


def record_calls(obj, attribute: str, log: list, keep, before=lambda args, kwargs: None):
    """Wrap `obj.attribute` so that each call appends `keep(args, kwargs, result, before(args, kwargs))` to `log`
    (`before` sees the arguments before the call, e.g. a cache's length that the call changes)."""
    original = getattr(obj, attribute)

    def recording(*args, **kwargs):
        seen = before(args, kwargs)
        result = original(*args, **kwargs)
        log.append(keep(args, kwargs, result, seen))
        return result

    setattr(obj, attribute, recording)


def layer_rows(hidden_states, start: int, stop: int):
    """The target's hidden-state tuple restricted to positions start..stop-1 (what a target forward on them gives)."""
    return tuple(state[:, start:stop] for state in hidden_states)


def fake_verification(hidden_states, start: int, stop: int, **fields) -> SimpleNamespace:
    """What DeepSpec's `_update` reads of a verification: the target's hidden states of the verified positions."""
    output = SimpleNamespace(hidden_states=layer_rows(hidden_states, start, stop))
    return SimpleNamespace(target_output=output, **fields)


def dspark_rounds(ds, model, hidden_states, sequence) -> dict[str, torch.Tensor]:
    """Two rounds of DeepSpec's DSpark evaluator (`_init_context`, `_propose`, `_update`) at temperature 0."""
    module = ds.dspark_evaluator
    evaluator = module.Qwen3DSparkEvaluator.__new__(module.Qwen3DSparkEvaluator)
    evaluator.draft_model = model
    evaluator.args = SimpleNamespace(temperature=0.0, confidence_threshold=0.0)
    blocks, heads, confidences = [], [], []
    record_calls(module, "forward_dspark_draft_block", blocks,
                 lambda a, k, r, cached: {"context": k["target_hidden_states"], "block": k["draft_input_ids"],
                                          "positions": k["position_ids"][:, cached : k["start"] + k["block_size"]]},
                 before=lambda a, k: k["past_key_values_draft"].get_seq_length())
    record_calls(model, "sample_draft_tokens", heads,
                 lambda a, k, r, _: {"base_logits": a[0], "tokens": r[0], "logits": r[1]})
    record_calls(model, "predict_confidence_step", confidences, lambda a, k, r, _: r)
    n = PROMPT_LENGTH
    position_ids = torch.arange(sequence.shape[1] + BLOCK_SIZE + 1).unsqueeze(0)
    output_ids = torch.cat([sequence, sequence.new_zeros(1, BLOCK_SIZE + 1)], dim=1)
    context = evaluator._init_context(initial_output=SimpleNamespace(hidden_states=layer_rows(hidden_states, 0, n)))
    evaluator._propose(context=context, output_ids=output_ids, position_ids=position_ids, start=n)
    evaluator._update(context, fake_verification(hidden_states, n, n + BLOCK_SIZE + 1, accepted_draft_tokens=ACCEPTED))
    evaluator._propose(context=context, output_ids=output_ids, position_ids=position_ids, start=n + ACCEPTED + 1)
    tensors = {}
    for index, (block, head) in enumerate(zip(blocks, heads, strict=True), start=1):
        tensors |= {f"round{index}_context": block["context"], f"round{index}_block": block["block"],
                    f"round{index}_position_ids": block["positions"], f"round{index}_base_logits": head["base_logits"],
                    f"round{index}_logits": head["logits"], f"round{index}_tokens": head["tokens"]}
        if confidences:
            tensors[f"round{index}_confidence_logits"] = confidences[index - 1]
    return tensors


def eagle3_rounds(ds, model, hidden_states, sequence) -> dict[str, torch.Tensor]:
    """Two rounds of DeepSpec's Eagle3 evaluator (`_init_context`, `_propose`, `_update`) at temperature 0."""
    module = ds.eagle3_evaluator
    evaluator = module.Qwen3Eagle3Evaluator.__new__(module.Qwen3Eagle3Evaluator)
    evaluator.draft_model = model
    evaluator.args = SimpleNamespace(temperature=0.0)
    contexts, logits = [], []
    record_calls(model, "extend_draft_cache", contexts,
                 lambda a, k, r, cached: {"context": k["hidden_states"], "input_ids": k["input_ids"],
                                          "positions": k["position_ids"], "cached": cached},
                 before=lambda a, k: k["past_key_values"].get_seq_length())
    record_calls(model, "compute_logits", logits, lambda a, k, r, _: r)
    n, committed = PROMPT_LENGTH, ACCEPTED + 1
    position_ids = torch.arange(sequence.shape[1] + TTT_LENGTH + 1).unsqueeze(0)
    output_ids = torch.cat([sequence, sequence.new_zeros(1, TTT_LENGTH + 1)], dim=1)
    context = evaluator._init_context(initial_output=SimpleNamespace(hidden_states=layer_rows(hidden_states, 0, n)),
                                      output_ids=output_ids, position_ids=position_ids, num_input_tokens=n)
    proposals = [evaluator._propose(context=context, output_ids=output_ids, position_ids=position_ids, start=n)]
    evaluator._update(context, fake_verification(hidden_states, n, n + TTT_LENGTH + 1,
                                                 committed_tokens=sequence[:, n + 1 : n + 1 + committed]))
    proposals.append(evaluator._propose(context=context, output_ids=output_ids, position_ids=position_ids,
                                        start=n + committed))
    tensors = {}
    for index, (extension, proposal) in enumerate(zip(contexts, proposals, strict=True), start=1):
        chain = torch.cat(logits[(index - 1) * TTT_LENGTH : index * TTT_LENGTH], dim=1)
        tensors |= {f"round{index}_context": extension["context"], f"round{index}_input_ids": extension["input_ids"],
                    f"round{index}_position_ids": extension["positions"],
                    f"round{index}_cache_length": torch.tensor([extension["cached"]]),
                    f"round{index}_logits": chain, f"round{index}_tokens": proposal.verify_input_ids[:, 1:]}
    return tensors


def write_variant(ds, name: str, target, hidden_states, sequence, out: Path, generator: torch.Generator) -> None:
    folder = out / name
    drafter = build_drafter(ds, name, target, generator)
    drafter.save_pretrained(folder)  # DeepSpec's trainer saves with save_pretrained: config.json + model.safetensors
    cls = type(drafter)
    model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    for key, value in drafter.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), f"{name}: {key} changed through save/load"
    with torch.inference_mode():
        rounds = eagle3_rounds if name == EAGLE3_VARIANT else dspark_rounds
        tensors = rounds(ds, model, hidden_states, sequence)
    tensors["input_ids"] = sequence
    tensors["target_hidden_states"] = torch.stack(hidden_states).squeeze(1)  # (layers + 1, positions, hidden)
    tensors = {key: value.detach().contiguous().clone() for key, value in tensors.items()}
    save_file(tensors, str(folder / "golden.safetensors"),
              metadata={"prompt_length": str(PROMPT_LENGTH), "accepted": str(ACCEPTED)})
    sizes = {path.name: path.stat().st_size for path in sorted(folder.iterdir())}
    print(f"{name}: {sizes}")


def environment(deepspec: Path) -> dict:
    import safetensors
    import transformers

    commit = subprocess.run(["git", "-C", str(deepspec), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"deepspec_commit": commit.stdout.strip() or "unknown", "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspec", type=Path, required=True, help="a checkout of github.com/deepseek-ai/DeepSpec")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests/data/deepspec_golden")
    args = parser.parse_args()
    import transformers

    if transformers.__version__ != DEEPSPEC_TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__} is installed; DeepSpec pins {DEEPSPEC_TRANSFORMERS} and its "
                 "evaluator's cache handling needs it: run this in a virtual environment with that version.")
    torch.use_deterministic_algorithms(True)
    ds = import_deepspec(args.deepspec.resolve())
    generator = torch.Generator().manual_seed(20260701)
    target = tiny_target(generator)
    sequence = torch.randint(6, VOCAB, (1, SEQUENCE_LENGTH), generator=generator)
    with torch.inference_mode():
        hidden_states = target(input_ids=sequence, output_hidden_states=True).hidden_states
    for name in (*DSPARK_VARIANTS, EAGLE3_VARIANT):
        write_variant(ds, name, target, hidden_states, sequence, args.out, generator)
    print(json.dumps(environment(args.deepspec), indent=2))


if __name__ == "__main__":
    main()
