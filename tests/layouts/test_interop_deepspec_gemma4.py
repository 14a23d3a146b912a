"""Gemma 4 targets and DeepSpec's Gemma 4 drafters (issue 32).

Drafters made with `from_target_config` for a tiny random `gemma4_text` target (sliding and full-attention layers of
different head sizes, values equal to keys, soft-capped logits, a scaled embedding) generate exactly what plain
greedy decoding does, at batch 1 and in the batched engine. DeepSpec's own `Gemma4DSparkModel` / `Gemma4Eagle3Model`
(tests/data/deepspec_golden/gemma4_*, built, saved and run by DeepSpec's code: see the README there) load strictly
into the one modeling file per algorithm and give DeepSpec's per-slot logits; `hf-dspark convert --to deepspec`
writes the layout back exactly, and speculators' layout, which has no Gemma 4 layers, is refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4TextConfig

import hf_dspark
from hf_dspark.generation.round.drafting import draft_block
from hf_dspark.hub.convert import export_deepspec
from hf_dspark.hub.export_speculators import export_speculators
from hf_dspark.models.errors import DrafterLoadError, UserInputError
from hf_dspark.models.formats import deepspec
from hf_dspark.models.layers import DraftContextCache
from test_interop_deepspec import RecordingGreedy, our_features

GOLDEN = Path(__file__).parents[1] / "data" / "deepspec_golden"
BLOCK_VARIANTS = ["gemma4_dspark_vanilla", "gemma4_dspark_gated", "gemma4_dspark_rnn", "gemma4_dflash"]
K_EQ_V = {"gemma4_dspark_vanilla": True, "gemma4_dspark_gated": True, "gemma4_dspark_rnn": False,
          "gemma4_dflash": False, "gemma4_eagle3": True}  # the target each golden was made for
TOLERANCE = dict(rtol=0, atol=1e-5)
SLIDING, FULL = "sliding_attention", "full_attention"


def gemma4_text_config(vocab_size: int = 128, k_eq_v: bool = True, **overrides) -> Gemma4TextConfig:
    """The goldens' target shapes: sliding layers of head_dim 16 (window 4), full layers of global_head_dim 32."""
    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4,
                  layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL], hidden_size_per_layer_input=0,
                  final_logit_softcapping=5.0, max_position_embeddings=256, tie_word_embeddings=False,
                  attention_k_eq_v=k_eq_v, num_global_key_value_heads=1 if k_eq_v else None,
                  pad_token_id=0, bos_token_id=2, eos_token_id=None)
    return Gemma4TextConfig(**{**fields, **overrides})


def gemma4_target(seed: int = 0, **config) -> Gemma4ForCausalLM:
    """A tiny random Gemma 4 text model; its norms and layer scalars moved off 1 (as trained ones are)."""
    torch.manual_seed(seed)
    target = Gemma4ForCausalLM(gemma4_text_config(**config)).eval()
    with torch.no_grad():
        for name, tensor in [*target.named_parameters(), *target.named_buffers()]:
            if "norm" in name or name.endswith("layer_scalar"):
                tensor.add_(0.2 * torch.randn_like(tensor))
    return target


def gemma4_drafter(target, kind: str, seed: int = 1):
    torch.manual_seed(seed)
    if kind == "eagle3":
        return hf_dspark.Eagle3DraftModel(hf_dspark.Eagle3DraftConfig.from_target_config(
            target.config, block_size=4)).eval()
    if kind == "dflash":
        return hf_dspark.DSparkDraftModel(hf_dspark.build_dflash_config(
            target.config, num_hidden_layers=2, block_size=4)).eval()
    return hf_dspark.DSparkDraftModel(hf_dspark.DSparkDraftConfig.from_target_config(
        target.config, num_hidden_layers=2, block_size=4, markov_head=kind, markov_rank=16)).eval()


def load_golden(name: str):
    return deepspec.load(GOLDEN / name, json.loads((GOLDEN / name / "config.json").read_text())), \
        load_file(GOLDEN / name / "golden.safetensors")


# ---------------------------------------------------------------------------------------------------------
# Drafters for Gemma 4 targets
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_level", [False, True])
def test_drafter_configs_take_the_full_attention_layers_shape(top_level):
    """transformers keeps Gemma 4's head_dim per layer (reading config.head_dim raises); the drafter attends over
    the whole context, so it takes the full-attention layers' head size and KV heads, as DeepSpec's does."""
    text = gemma4_text_config()
    config = Gemma4Config(text_config=text.to_dict()) if top_level else text
    for build in (hf_dspark.DSparkDraftConfig.from_target_config, hf_dspark.build_dflash_config,
                  hf_dspark.Eagle3DraftConfig.from_target_config):
        ours = build(config)
        assert (ours.head_dim, ours.num_key_value_heads, ours.layer_style, ours.attention_k_eq_v) == (32, 1, "gemma4",
                                                                                                      True)
        assert ours.final_logit_softcapping == 5.0 and ours.hidden_act == "gelu_pytorch_tanh"
        assert ours.rope_parameters["rope_type"] == "proportional" and ours.target_model_type == "gemma4_text"
    without = hf_dspark.DSparkDraftConfig.from_target_config(gemma4_text_config(k_eq_v=False))
    assert (without.head_dim, without.num_key_value_heads, without.attention_k_eq_v) == (32, 2, False)
    layer = hf_dspark.DSparkDraftModel(without).layers[0]
    assert layer.self_attn.v_proj is not None and layer.self_attn.scaling == 1.0 and layer.sandwich


def left_padded(prompt_list):
    width = max(p.shape[1] for p in prompt_list)
    ids = torch.zeros(len(prompt_list), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompt_list):
        ids[row, width - prompt.shape[1]:], mask[row, width - prompt.shape[1]:] = prompt[0], 1
    return ids, mask


GENERATION_VOCAB = 8  # small, so that random drafters get some drafts accepted (partial acceptance is exercised)


@pytest.mark.parametrize("kind,k_eq_v", [("markov", True), ("rnn", False), ("dflash", True), ("eagle3", True),
                                         ("eagle3", False)])
def test_greedy_generation_equals_plain_at_batch_1_and_in_batches(kind, k_eq_v):
    target = gemma4_target(vocab_size=GENERATION_VOCAB, k_eq_v=k_eq_v)
    drafter = gemma4_drafter(target, kind)
    drafter.generation_config.dspark_round_planning = False  # every round drafts, whatever this machine's speed
    prompt_list = [torch.randint(1, GENERATION_VOCAB, (1, 5 + i), generator=torch.Generator().manual_seed(i))
                   for i in range(3)]
    references = [target.generate(p, max_new_tokens=16, do_sample=False)[0] for p in prompt_list]
    accepted = []
    for prompt, reference in zip(prompt_list, references):  # well past the sliding window of 4
        assert torch.equal(target.generate(prompt, assistant_model=drafter, max_new_tokens=16, do_sample=False)[0],
                           reference)
        accepted += drafter.last_generation_stats.accepted
    ids, mask = left_padded(prompt_list)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=16, do_sample=False)
    for row, (prompt, reference) in enumerate(zip(prompt_list, references)):
        assert torch.equal(out[row, ids.shape[1] - prompt.shape[1]:], reference), f"row {row}"
    if kind in ("markov", "rnn"):
        assert max(accepted + drafter.last_generation_stats.accepted) > 0


@pytest.mark.parametrize("kind", ["markov", "eagle3"])
def test_targets_with_per_layer_inputs_or_shared_kv_layers(kind):
    """Gemma 4's small models add per-layer inputs (PLE) and let their last layers reuse earlier layers' keys and
    values (num_kv_shared_layers): the drafter reads the same hidden states. In the engine a KV-shared layer attends
    over its producer's entries, holes included, with the mask of its own attention kind."""
    ple = gemma4_target(vocab_size=GENERATION_VOCAB, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=GENERATION_VOCAB)
    shared = gemma4_target(vocab_size=GENERATION_VOCAB, num_kv_shared_layers=2)
    prompt_list = [torch.randint(1, GENERATION_VOCAB, (1, 5 + i), generator=torch.Generator().manual_seed(i))
                   for i in range(2)]
    ids, mask = left_padded(prompt_list)
    targets = [ple]
    try:
        shared.generate(prompt_list[0], max_new_tokens=2, do_sample=False)
        targets.append(shared)
    except TypeError as error:  # transformers 5.24.0's own slicing before the KV-shared layers (per_layer_inputs)
        stock_failure = f"plain generate of a KV-shared Gemma 4 target fails in transformers itself: {error}"
    for target in targets:
        drafter = gemma4_drafter(target, kind)
        references = [target.generate(p, max_new_tokens=12, do_sample=False)[0] for p in prompt_list]
        for prompt, reference in zip(prompt_list, references):
            assert torch.equal(target.generate(prompt, assistant_model=drafter, max_new_tokens=12,
                                               do_sample=False)[0], reference)
    for target in targets:
        drafter = gemma4_drafter(target, kind)
        drafter.generation_config.dspark_round_planning = False  # every round drafts: partial acceptance
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12, do_sample=False)
        for row, prompt in enumerate(prompt_list):
            assert torch.equal(out[row, ids.shape[1] - prompt.shape[1]:],
                               target.generate(prompt, max_new_tokens=12, do_sample=False)[0])
        stats = drafter.last_generation_stats
        assert 0 < sum(stats.accepted) < sum(stats.draft_lengths)  # some drafts accepted, some rejected
    if shared not in targets:
        pytest.skip(stock_failure)


# ---------------------------------------------------------------------------------------------------------
# DeepSpec's Gemma 4 drafters against DeepSpec's own forward
# ---------------------------------------------------------------------------------------------------------


def two_rounds(golden):
    prompt = golden["round1_context"].shape[1]
    return {1: (0, prompt), 2: (prompt, prompt + golden["round2_context"].shape[1])}


@pytest.mark.parametrize("name", BLOCK_VARIANTS)
def test_block_drafter_slot_logits_equal_deepspecs(name):
    drafter, golden = load_golden(name)
    assert drafter.config.layer_style == "gemma4" and (drafter.layers[0].self_attn.v_proj is None) == K_EQ_V[name]
    cache = DraftContextCache()
    with torch.no_grad():
        for round_, bounds in two_rounds(golden).items():
            key = f"round{round_}_"
            features = our_features(drafter, golden, *bounds)
            torch.testing.assert_close(features, golden[key + "context"], rtol=0, atol=0)
            block = golden[key + "block"]
            out = drafter(input_ids=block, target_hidden_states=features, cache=cache)
            torch.testing.assert_close(out.base_logits, golden[key + "base_logits"], **TOLERANCE)
            sampling = RecordingGreedy()
            tokens, _, confidences = draft_block(drafter, out, block[:, 0], drafter.config.num_draft_slots, sampling)
            torch.testing.assert_close(torch.stack(sampling.logits, dim=1), golden[key + "logits"], **TOLERANCE)
            assert torch.equal(tokens, golden[key + "tokens"])
            if key + "confidence_logits" in golden:
                torch.testing.assert_close(confidences, golden[key + "confidence_logits"].sigmoid(), **TOLERANCE)
            else:
                assert confidences is None


def test_eagle3_chain_logits_equal_deepspecs():
    drafter, golden = load_golden("gemma4_eagle3")
    assert isinstance(drafter, hf_dspark.Eagle3DraftModel) and drafter.config.final_logit_softcapping == 5.0
    cache = DraftContextCache()
    with torch.no_grad():
        for round_, bounds in two_rounds(golden).items():
            key = f"round{round_}_"
            features = our_features(drafter, golden, *bounds)
            assert cache.get_seq_length() == int(golden[key + "cache_length"])
            out = drafter(input_ids=golden[key + "input_ids"], target_hidden_states=features, cache=cache)
            context_length = cache.get_seq_length()
            logits, state, tokens = [out.logits[:, -1]], out.hidden_states[:, -1:], []
            for step in range(drafter.config.block_size):
                tokens.append(logits[-1].argmax(dim=-1))
                if step + 1 < drafter.config.block_size:
                    out = drafter(input_ids=tokens[-1][:, None], hidden_states=state, cache=cache)
                    logits.append(out.logits[:, -1])
                    state = out.hidden_states
            cache.crop(context_length)
            torch.testing.assert_close(torch.stack(logits, dim=1), golden[key + "logits"], **TOLERANCE)
            assert torch.equal(torch.stack(tokens, dim=1), golden[key + "tokens"])


def test_the_stored_embedding_is_scaled_as_gemmas():
    drafter, _ = load_golden("gemma4_dspark_vanilla")
    rows = load_file(GOLDEN / "gemma4_dspark_vanilla" / "model.safetensors")["embed_tokens.weight"]
    ids = torch.tensor([[3, 7, 5]])
    torch.testing.assert_close(drafter.embed(ids), rows[ids] * 8.0, rtol=0, atol=0)  # sqrt(hidden_size = 64)


@pytest.mark.parametrize("name", [*BLOCK_VARIANTS, "gemma4_eagle3"])
def test_loaded_drafters_generate_losslessly_on_a_gemma4_target(name):
    drafter, _ = load_golden(name)
    target = gemma4_target(k_eq_v=K_EQ_V[name])
    for seed in (0, 1):
        prompt = torch.randint(1, 128, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(prompt, max_new_tokens=10, do_sample=False)
        assert torch.equal(target.generate(prompt, assistant_model=drafter, max_new_tokens=10, do_sample=False), plain)
    assert drafter.target_heads.embed_tokens is target.get_input_embeddings()


@pytest.mark.parametrize("name", ["gemma4_dspark_rnn", "gemma4_eagle3"])
def test_autodrafter_and_the_class_loaders_read_the_folders(name):
    drafter, _ = load_golden(name)
    for loader in (hf_dspark.AutoDrafter, type(drafter)):
        loaded = loader.from_pretrained(GOLDEN / name)
        assert type(loaded) is type(drafter) and loaded.config.to_dict() == drafter.config.to_dict()
        assert all(torch.equal(loaded.state_dict()[key], value) for key, value in drafter.state_dict().items())


def copy_golden(name: str, folder: Path, changes: dict | None = None, weights=None) -> Path:
    shutil.copytree(GOLDEN / name, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **(changes or {})}))
    if weights is not None:
        save_file(weights(load_file(folder / "model.safetensors")), str(folder / "model.safetensors"))
    return folder


REFUSALS = [
    ("gemma4_dspark_vanilla", {}, lambda w: {k: v for k, v in w.items() if k != "layers.1.layer_scalar"},
     "missing \\['layers.1.layer_scalar'\\]"),
    ("gemma4_dspark_vanilla", {}, lambda w: {**w, "layers.0.self_attn.v_proj.weight": torch.zeros(32, 64)},
     "v_proj"),
    ("gemma4_dflash", {"attention_k_eq_v": True, "num_global_key_value_heads": 2}, None, "v_proj"),
    ("gemma4_dspark_vanilla", {"hidden_size_per_layer_input": 256}, None, "hidden_size_per_layer_input=256"),
    ("gemma4_dspark_vanilla", {"enable_moe_block": True}, None, "enable_moe_block=True"),
    ("gemma4_dspark_gated", {"use_double_wide_mlp": True, "num_kv_shared_layers": 1}, None, "use_double_wide_mlp"),
    ("gemma4_dspark_gated", {"attention_chunk_size": 8}, None, "attention_chunk_size"),
    ("gemma4_eagle3", {"attention_k_eq_v": True, "num_global_key_value_heads": None}, None,
     "num_global_key_value_heads"),
    ("gemma4_eagle3", {"global_head_dim": 16}, None, "q_proj.weight \\(128, 128\\) stored.*global_head_dim"),
]


@pytest.mark.parametrize("name,changes,weights,message", REFUSALS)
def test_what_does_not_fit_is_refused_naming_it(tmp_path, name, changes, weights, message):
    folder = copy_golden(name, tmp_path / "c", changes, weights)
    with pytest.raises(DrafterLoadError, match=message):
        hf_dspark.AutoDrafter.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------
# Exports
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*BLOCK_VARIANTS, "gemma4_eagle3"])
def test_deepspec_round_trip_is_exact(tmp_path, name):
    drafter, golden = load_golden(name)
    folder = export_deepspec(drafter, tmp_path / "out")
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == json.loads((GOLDEN / name / "config.json").read_text())["architectures"]
    assert written["global_head_dim"] == 32 and written["final_logit_softcapping"] == 5.0
    back = deepspec.load(folder, written)
    assert back.config.to_dict() == drafter.config.to_dict()
    assert all(torch.equal(back.state_dict()[key], value) for key, value in drafter.state_dict().items())


@pytest.mark.parametrize("kind", ["markov", "eagle3"])
def test_export_with_the_target_stores_its_heads_and_loads_back(tmp_path, kind):
    target = gemma4_target()
    drafter = gemma4_drafter(target, kind)
    folder = export_deepspec(drafter, tmp_path / kind, target=target)
    written = json.loads((folder / "config.json").read_text())
    assert written["model_type"] == "gemma4_text" and written["head_dim"] == 16 and "per_layer_config" not in written
    back = deepspec.load(folder, written)  # runs on the stored (scaled) embedding and LM head, no target
    drafter.attach_target(target)
    features = torch.randn(1, 5, len(drafter.config.target_layer_ids) * 64)
    ids = torch.randint(0, 128, (1, 5 if kind == "eagle3" else 4))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, target_hidden_states=features).logits,
                                   drafter(input_ids=ids, target_hidden_states=features).logits, **TOLERANCE)


@pytest.mark.parametrize("name", ["gemma4_dspark_vanilla", "gemma4_dflash", "gemma4_eagle3"])
def test_speculators_export_is_refused_naming_why(tmp_path, name):
    drafter, _ = load_golden(name)
    with pytest.raises(UserInputError, match="layer_style='gemma4'.*no Gemma|Gemma 4's sandwich norms"):
        export_speculators(drafter, tmp_path / "out")
