"""z-lab DFlash drafters (the `dflash` package from PyPI, run as installed) read by
`hf_dspark.models.formats.zlab_dflash`: the same per-slot draft logits, the same greedy tokens and acceptance as
z-lab's own `spec_generate` loop, with and without z-lab's optional settings (soft-capped logits, a scaled input
embedding, in-block causal and sliding-window layers), and every feature hf_dspark does not build refused by name."""

import json
import pickle
import time
from pathlib import Path

import dflash.model as zlab
import pytest
import torch
from dflash import DFlashDraftModel
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

import hf_dspark  # also routes generate(assistant_model=...) to hf_dspark's loop
from factories import tiny_drafter, tiny_target
from hf_dspark.models.errors import DrafterLoadError
from hf_dspark.models.layers import DraftContextCache
from hf_dspark.models.formats import zlab_dflash

# Their models still pass `past_key_values`, which transformers 5.24+ deprecates (pyproject.toml makes the warning an
# error for hf_dspark's own code).
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

VOCAB, BLOCK, MASK = 128, 4, 5
STICKY = 7  # a token the designed target often goes to and the drafter drafts (see `_agreeing_pair`)


def _zlab_config(top_level: dict | None = None, **dflash_config) -> Qwen3Config:
    settings = {"mask_token_id": MASK, "target_layer_ids": [0, 2], "block_size": BLOCK, **dflash_config}
    return Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       initializer_range=0.2, num_target_layers=4, dflash_config=settings,
                       architectures=["DFlashDraftModel"], **(top_level or {}))


def _zlab_drafter(seed: int = 1, top_level: dict | None = None, **dflash_config) -> DFlashDraftModel:
    """z-lab's own class with random weights, the norms too (init leaves them at 1, which would hide a misplaced
    norm); `top_level` Qwen3Config fields (is_causal, layer_types, ...) and `dflash_config` settings."""
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(_zlab_config(top_level, **dflash_config)).eval()
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return drafter


def _saved(drafter, folder: Path) -> tuple[Path, dict]:
    drafter.save_pretrained(folder)  # as z-lab saves: config.json + model.safetensors
    return folder, json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _saved(_zlab_drafter(), tmp_path_factory.mktemp("zlab"))


def _context(target, length: int, seed: int = 5):
    """A prompt, the target's features at the drafter's layers (HF hidden_states[i + 1]) and the block that drafts
    after it."""
    ids = torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in (0, 2)], dim=-1)
    block = torch.tensor([[int(ids[0, -1])] + [MASK] * (BLOCK - 1)])
    return features[:, :-1], block


def _zlab_slot_logits(drafter, target, features, block, first_position: int = 0):
    """z-lab's draft logits of slots 1..B-1 (the slots its loop reads), context at positions from
    `first_position`, the block embedded as its loop embeds it (raw rows times input_embedding_scale)."""
    positions = torch.arange(first_position, first_position + features.shape[1] + block.shape[1])[None]
    scale = float(zlab._draft_value(drafter.config, "input_embedding_scale", 1.0))
    with torch.no_grad():
        hidden = drafter(position_ids=positions, noise_embedding=zlab._raw_input_embeddings(target, block, scale),
                         target_hidden=features)
        return drafter.compute_logits(hidden[:, 1:], target.lm_head)


def _our_slot_logits(ours, features, block, layout: str = "fresh"):
    """Our draft logits of slots 1..B-1 for the same context: positions from 0 ("fresh") or from 9 ("shifted") in one
    call, or ("cached") the first context rows projected into a cache by an earlier call, as generation does."""
    first_position = 9 if layout == "shifted" else 0
    context_positions = torch.arange(first_position, first_position + features.shape[1])[None]
    block_positions = torch.arange(BLOCK)[None] + context_positions[:, -1:] + 1
    with torch.no_grad():
        if layout != "cached":
            out = ours(input_ids=block, target_hidden_states=features, context_position_ids=context_positions,
                       position_ids=block_positions)
        else:
            cache = DraftContextCache()
            # 7 of 8 context rows cached: a sliding layer's window (2-3 positions) then reaches into the cache
            ours(input_ids=block, target_hidden_states=features[:, :7], cache=cache)
            out = ours(input_ids=block, target_hidden_states=features[:, 7:], cache=cache)
    return out.logits[:, ours.config.first_draft_slot:]


def test_matches_zlab_configs_only(saved, target):
    assert zlab_dflash.matches(saved[1])
    assert zlab_dflash.matches({**saved[1], "architectures": None})  # a Qwen3 config with a dflash_config
    assert not zlab_dflash.matches(target.config.to_dict())
    assert not zlab_dflash.matches(tiny_drafter(target, "dflash").config.to_dict())


@pytest.mark.parametrize("output_multiplier", [None, 0.7])
@pytest.mark.parametrize("first_position", [0, 9])
def test_per_slot_logits_match_zlab(tmp_path, target, output_multiplier, first_position):
    settings = {} if output_multiplier is None else {"output_multiplier": output_multiplier}
    theirs = _zlab_drafter(**settings)
    ours = zlab_dflash.load(*_saved(theirs, tmp_path))
    config = ours.config
    assert (config.sample_from_anchor, config.markov_head, config.confidence_head, config.qk_norm) == (
        False, None, False, True)
    assert (config.target_layer_ids, config.mask_token_id, config.block_size) == ([0, 2], MASK, BLOCK)
    assert config.target_num_hidden_layers == 4 and ours.dtype == torch.float32 and not ours.training

    assert config.drafting_options == {}  # none of z-lab's optional settings: a plain DFlash drafter

    ours.attach_target(target)
    features, block = _context(target, length=9)
    mine = _our_slot_logits(ours, features, block, "shifted" if first_position else "fresh")
    expected = _zlab_slot_logits(theirs, target, features, block, first_position)
    assert mine.shape == expected.shape == (1, BLOCK - 1, VOCAB)
    torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)


_SLIDING = {"use_sliding_window": True, "sliding_window": 3}
SUPPORTED = {  # z-lab's settings (top-level Qwen3Config fields, dflash_config) -> what our config holds
    "softcapping": ({}, {"final_logit_softcapping": 2.0}, {"final_logit_softcapping": 2.0}),
    "embedding_scale": ({}, {"input_embedding_scale": 3.0}, {"input_embedding_scale": 3.0}),
    "causal": ({"is_causal": True}, {}, {"block_causal": True}),
    "sliding": ({"is_causal": False, **_SLIDING, "layer_types": ["sliding_attention", "full_attention"]}, {},
                {"block_causal": False, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}),
    # is_causal unset: z-lab makes its sliding layers block-causal and leaves the full ones bidirectional
    "sliding_causal": ({**_SLIDING, "layer_types": ["full_attention", "sliding_attention"]}, {},
                       {"block_causal": [False, True], "layer_types": ["full_attention", "sliding_attention"],
                        "sliding_window": 3}),
    # sliding layers without use_sliding_window: Qwen3Config drops the window, z-lab still makes them causal
    "sliding_no_window": ({"layer_types": ["sliding_attention", "full_attention"]}, {},
                          {"block_causal": [True, False], "layer_types": None, "sliding_window": None}),
    "everything": ({"is_causal": True, "use_sliding_window": True, "sliding_window": 2,
                    "layer_types": ["sliding_attention", "sliding_attention"]},
                   {"final_logit_softcapping": 2.0, "input_embedding_scale": 0.5, "output_multiplier": 1.5},
                   {"block_causal": True, "sliding_window": 2, "final_logit_softcapping": 2.0,
                    "input_embedding_scale": 0.5}),
}


@pytest.mark.parametrize("layout", ["fresh", "shifted", "cached"])
@pytest.mark.parametrize("case", sorted(SUPPORTED))
def test_optional_settings_match_zlab_per_slot(tmp_path, target, case, layout):
    top_level, nested, fields = SUPPORTED[case]
    theirs = _zlab_drafter(top_level=top_level, **nested)
    ours = zlab_dflash.load(*_saved(theirs, tmp_path))
    assert {name: getattr(ours.config, name) for name in fields} == fields
    ours.attach_target(target)
    features, block = _context(target, length=9)
    expected = _zlab_slot_logits(theirs, target, features, block, 9 if layout == "shifted" else 0)
    torch.testing.assert_close(_our_slot_logits(ours, features, block, layout), expected, atol=1e-5, rtol=0)

    # The setting matters: z-lab's drafter without it drafts other logits from the same weights.
    without = DFlashDraftModel(_zlab_config(**{k: v for k, v in nested.items() if k == "output_multiplier"})).eval()
    without.load_state_dict(theirs.state_dict())
    assert not torch.allclose(_zlab_slot_logits(without, target, features, block), expected, atol=1e-3)


def test_scaled_embedding_is_the_raw_rows_scaled_in_the_targets_dtype(tmp_path):
    """z-lab multiplies the embedding weight's rows, in the target's dtype, and never calls the target's embedding
    module (Gemma's scales its rows by sqrt(hidden_size) itself)."""
    gemma = tiny_target("gemma3", vocab_size=VOCAB).to(torch.bfloat16)
    ours = zlab_dflash.load(*_saved(_zlab_drafter(input_embedding_scale=3.0), tmp_path))
    ours.attach_target(gemma)
    ids = torch.randint(2, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(0))
    raw = zlab._raw_input_embeddings(gemma, ids, 3.0)
    embedded = ours.embed(ids)
    assert raw.dtype == embedded.dtype == torch.bfloat16 and torch.equal(embedded, raw)
    assert not torch.allclose(embedded.float(), gemma.get_input_embeddings()(ids).float() * 3.0)


def test_bfloat16_checkpoint_loads_as_float32_of_the_stored_values(tmp_path):
    theirs = _zlab_drafter().to(torch.bfloat16)
    ours = zlab_dflash.load(*_saved(theirs, tmp_path))
    stored = load_file(tmp_path / "model.safetensors")
    assert {tensor.dtype for tensor in stored.values()} == {torch.bfloat16}
    for name, tensor in ours.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, stored[name].float()), name


def _agreeing_pair(target_seed: int = 0, top_level: dict | None = None, **dflash_config):
    """A tiny Qwen3 target and a z-lab drafter that agree often enough for non-trivial acceptance, without training:
    both nearly skip their layers (attention and MLP outputs scaled down), so each predicts mostly from its input
    token's embedding; the target's LM-head row STICKY points at the embeddings of MASK and a few other tokens, so
    the target often goes to STICKY next and the drafter (whose mask slots read MASK's embedding) drafts STICKY. The
    layers' small outputs stay, so every draft logit still depends on the context and the positions."""
    target = tiny_target("qwen3", vocab_size=VOCAB, seed=target_seed)
    drafter = _zlab_drafter(top_level=top_level, **dflash_config)
    make_agree(target, drafter)
    return target, drafter


def make_agree(target, drafter) -> None:
    """Scales both models' layer outputs down, sets the drafter's norms to 1 and points the target's LM-head row
    STICKY at MASK's and a few other embeddings (`_agreeing_pair`; the DFlash 2 tests rig their pair the same way)."""
    with torch.no_grad():
        for model, factor in ((target, 0.02), (drafter, 0.002)):
            for name, param in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.mul_(factor)
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
        embeddings = target.get_input_embeddings().weight
        normed = embeddings * embeddings.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        target.lm_head.weight[STICKY] = 0.3 * normed[[MASK, *range(20, 25)]].sum(0)


def _latest_new_token(sequence: torch.LongTensor, prompt_length: int) -> tuple[int, int]:
    """The generated token whose first occurrence comes last, and that occurrence's index among new tokens."""
    new = sequence[0, prompt_length:].tolist()
    token = max(set(new), key=new.index)
    return token, new.index(token)


# "sliding_no_window" is left out: z-lab's own loop cannot run it (transformers' DynamicCache wants the window of
# its sliding layers); its per-slot logits are compared above.
@pytest.mark.parametrize("case", ["plain", *sorted(set(SUPPORTED) - {"sliding_no_window"})])
@pytest.mark.parametrize("with_stop_token", [False, True])
def test_greedy_generation_matches_zlab_spec_generate(tmp_path, monkeypatch, with_stop_token, case):
    top_level, nested, _ = SUPPORTED.get(case, ({}, {}, {}))
    target, theirs = _agreeing_pair(top_level=top_level, **nested)
    ours = zlab_dflash.load(*_saved(theirs, tmp_path))
    # Draft the full block every round, as z-lab does.
    ours.generation_config.update(dspark_round_planning=False, dspark_suffix_drafting=False)
    # z-lab's stats clock synchronises CUDA; on the CPU it only needs a clock (nothing else in its loop changes).
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)
    theirs_blocks, our_logits = [], []
    theirs.register_forward_hook(lambda module, args, output: theirs_blocks.append(output))
    compute_logits = ours.compute_logits  # drafting computes the drafted slots' logits after the pass

    def recorded_logits(hidden):
        logits = compute_logits(hidden)
        if logits.numel():  # the pass itself asks for none
            our_logits.append(logits)
        return logits

    monkeypatch.setattr(ours, "compute_logits", recorded_logits)
    accepting_rounds = 0
    for prompt_seed in range(3):
        prompt = torch.randint(2, VOCAB, (1, 6 + prompt_seed), generator=torch.Generator().manual_seed(prompt_seed))
        expected = theirs.spec_generate(target, prompt, max_new_tokens=24, stop_token_ids=None)
        stop_ids = None
        if with_stop_token:  # stop at a token that first comes late, so rounds run before it
            stop, index = _latest_new_token(expected, prompt.shape[1])
            assert index >= 8
            stop_ids = [stop]
            expected = theirs.spec_generate(target, prompt, max_new_tokens=24, stop_token_ids=stop_ids)
            assert expected.shape[1] == prompt.shape[1] + index + 1
        target.generation_config.eos_token_id = stop_ids[0] if stop_ids else None
        theirs_blocks.clear()
        our_logits.clear()
        run = zlab.dflash_generate(theirs, target, prompt, 24, stop_ids, return_stats=True)
        mine = target.generate(prompt, assistant_model=ours, do_sample=False, max_new_tokens=24)
        assert torch.equal(run.output_ids, expected)
        assert torch.equal(mine, expected)
        assert torch.equal(mine, target.generate(prompt, do_sample=False, max_new_tokens=24))

        # z-lab shrinks its block near max_length (fewer slots, so other drafts); compare its full-block rounds.
        full = [block for block in theirs_blocks if block.shape[1] == BLOCK]
        assert len(full) >= 3
        with torch.inference_mode():
            for block, logits in zip(full, our_logits):
                slots = logits.shape[1]  # ours drafts fewer near max_new_tokens: its budget, not the block
                torch.testing.assert_close(logits, theirs.compute_logits(block[:, 1 : 1 + slots], target.lm_head),
                                           atol=1e-5, rtol=0)
        # z-lab records the tokens each round produced (accepted drafts + 1, cut at a stop token); hf_dspark
        # records the accepted drafts: the same quantity on every full-block round but the one that stopped.
        stats = ours.last_generation_stats
        compared = len(full) - (with_stop_token and len(full) == len(run.acceptance_lengths))
        assert [a + 1 for a in stats.accepted[:compared]] == run.acceptance_lengths[:compared]
        assert stats.draft_lengths[: compared - 1] == [BLOCK - 1] * (compared - 1)
        accepting_rounds += sum(a > 1 for a in run.acceptance_lengths[:compared])
    assert accepting_rounds >= 3  # the comparison saw rounds that accepted drafts, not only rejections


def test_default_target_layers_follow_zlab_rule():
    for depth, layers in [(36, 5), (28, 3), (4, 1), (61, 8), (10, 2)]:
        assert zlab_dflash.zlab_default_layer_ids(depth, layers) == zlab.build_target_layer_ids(depth, layers)


@pytest.mark.parametrize("case", ["nested", "top_level", "default_layers"])
def test_draft_settings_are_read_as_zlab_reads_them(tmp_path, case):
    """dflash_config first, then the top-level field (z-lab's older configs), then z-lab's defaults."""
    theirs = _zlab_drafter()
    if case == "top_level":
        theirs.config.dflash_config = {"target_layer_ids": [0, 2]}
        theirs.config.block_size, theirs.config.mask_token_id = 6, 9
    elif case == "default_layers":  # block size 16, layers from num_target_layers
        config = _zlab_config()
        config.dflash_config = {"mask_token_id": MASK}
        theirs = DFlashDraftModel(config).eval()
    folder, config = _saved(theirs, tmp_path)
    reread = DFlashDraftModel(Qwen3Config.from_dict(config))  # what z-lab's from_pretrained would build
    ours = zlab_dflash.load(folder, config).config
    assert (ours.block_size, ours.mask_token_id, ours.target_layer_ids) == (
        reread.block_size, reread.mask_token_id, list(reread.target_layer_ids))
    assert (ours.block_size, ours.mask_token_id) == {"nested": (BLOCK, MASK), "top_level": (6, 9),
                                                     "default_layers": (16, MASK)}[case]


REFUSED = {
    "chunked_layers": ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
    "is_causal_not_bool": ({"is_causal": "yes"}, "is_causal='yes'"),
    "no_window": ({"use_sliding_window": True, "sliding_window": 0,
                   "layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    # DFlash 2 loads (tests/layouts/test_interop_zlab_dflash2.py); its settings beside DFlash's class contradict it
    "dflash_class_with_dflash2_settings": ({"dflash_config": {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}}, "ignores them"),
    "unknown_setting": ({"dflash_config": {"sample_from_anchor": True}}, "'sample_from_anchor'"),
    "unknown_field": ({"partial_rotary_factor": 0.5}, "'partial_rotary_factor'"),
    "mask_outside_vocab": ({"dflash_config": {"mask_token_id": VOCAB}}, f"mask_token_id={VOCAB}"),
    "no_mask": ({"dflash_config": {"mask_token_id": None}}, "mask_token_id=None"),
}


def _with(config: dict, change: dict) -> dict:
    changed = {**config, **{k: v for k, v in change.items() if k != "dflash_config"}}
    changed["dflash_config"] = {**config["dflash_config"], **change.get("dflash_config", {})}
    return changed


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_fields_are_refused_by_name(saved, case):
    folder, config = saved
    change, named = REFUSED[case]
    with pytest.raises(DrafterLoadError, match="config.json") as error:
        zlab_dflash.load(folder, _with(config, change))
    assert named in str(error.value)


@pytest.mark.parametrize("change", ["extra", "missing", "integer"])
def test_weights_must_be_exactly_the_drafters(saved, tmp_path, change):
    folder, config = saved
    weights = load_file(folder / "model.safetensors")
    if change == "extra":
        weights["rotary_emb.inv_freq"] = torch.ones(8)
    elif change == "missing":
        del weights["layers.1.mlp.up_proj.weight"]
    else:
        weights["fc.weight"] = weights["fc.weight"].to(torch.int8)
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    named = {"extra": "rotary_emb.inv_freq", "missing": "layers.1.mlp.up_proj.weight", "integer": "fc.weight"}
    with pytest.raises(hf_dspark.UserInputError, match=named[change].replace(".", r"\.")):
        zlab_dflash.load(tmp_path, config)


class _Payload:
    """Unpickling this creates `marker`: what a malicious pickle beside a drafter could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("name", ["mask_embedding.pt", "embeddings.pt"])
def test_trainer_pickles_are_refused_never_unpickled(saved, tmp_path, name):
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(probe)))
    assert probe.exists()  # the payload is live: unpickling it would run it

    folder, config = saved
    copy = tmp_path / "drafter"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps(config))
    (copy / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    marker = tmp_path / "unpickled"
    (copy / name).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(DrafterLoadError, match="never unpickles") as error:
        zlab_dflash.load(copy, config)
    assert str(copy / name) in str(error.value)
    assert not marker.exists()
