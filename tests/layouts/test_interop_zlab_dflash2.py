"""z-lab DFlash 2 drafters (`DFlash2DraftModel` of the `dflash` package, run as installed) read through
`hf_dspark.AutoDrafter`: the same backbone logits, the same greedy selector path and the same selector distribution
q at every slot as z-lab's own `propose`, and the same greedy tokens and acceptance as z-lab's own generation loop.
z-lab's slot j (j >= 1) predicts anchor + j; the drafter loads with that convention (`sample_from_anchor` False).
Ours, exported (`hf_dspark.hub.export_zlab`), loads in z-lab's own `from_pretrained` with nothing missing and
proposes the same; round trips are exact."""

import json
import time
from pathlib import Path

import dflash.model as zlab
import pytest
import torch
from dflash import DFlash2DraftModel
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

import hf_dspark
from factories import tiny_drafter, tiny_target
from test_interop_zlab import make_agree
from hf_dspark.hub.export_zlab import export_zlab
from hf_dspark.models.errors import UserInputError

# z-lab's models still pass `past_key_values`, which transformers 5.24+ deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

VOCAB, BLOCK, MASK = 128, 4, 5
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
STICKY = 7  # a token the designed target often goes to and the drafter drafts (see `_agreeing_pair`)


def _zlab_dflash2(seed: int = 1, codebook_std: float = 1.0, **dflash_config) -> DFlash2DraftModel:
    """z-lab's own class, seeded. Its init leaves the convolutions' base kernels as torch.empty gives them, so they
    are drawn here (tap 0 near 1); the norms are drawn too (at 1 a misplaced norm would not show), and the codebooks
    wide enough that the selector's pairwise term reorders candidates."""
    settings = {"mask_token_id": MASK, "target_layer_ids": [0, 2], "block_size": BLOCK, **DFLASH2, **dflash_config}
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.2, num_target_layers=4, dflash_config=settings,
                         architectures=["DFlash2DraftModel"])
    torch.manual_seed(seed)
    drafter = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("base_kernel"):
                param.normal_(0.0, 0.3)
                param[:, 0] += 1.0
            elif "codebook" in name:
                param.normal_(0.0, codebook_std)
    return drafter


def _saved(drafter, folder: Path) -> Path:
    drafter.save_pretrained(folder)  # as z-lab saves: config.json + model.safetensors
    return folder


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", vocab_size=VOCAB)


def _context(target, length: int = 9, seed: int = 5):
    """A prompt's target features at the drafter's layers (HF hidden_states[i + 1]) and the block after it."""
    ids = torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in (0, 2)], dim=-1)
    return features[:, :-1], torch.tensor([[int(ids[0, -1])] + [MASK] * (BLOCK - 1)])


def _zlab_block(theirs, target, features, block):
    """z-lab's final states of slots 1..B-1 (what its loop hands `propose`) and their logits."""
    positions = torch.arange(features.shape[1] + block.shape[1])[None]
    scale = float(zlab._draft_value(theirs.config, "input_embedding_scale", 1.0))
    with torch.no_grad():
        hidden = theirs(position_ids=positions, noise_embedding=zlab._raw_input_embeddings(target, block, scale),
                        target_hidden=features)[:, 1:]
        return hidden, theirs.compute_logits(hidden, target.lm_head)


def _our_path(ours, out, anchor, previous=None):
    """Our selector's logits slot by slot (slot k's predecessor: `previous[:, k]`, else our own greedy path)."""
    first = ours.config.first_draft_slot
    hidden, base = out.last_hidden_state[:, first:], out.base_logits[:, first:]
    tokens, rows, before = [], [], anchor
    for slot in range(hidden.shape[1]):
        logits, _, _ = ours.slot_logits(hidden[:, slot], base[:, slot], before, None)
        rows.append(logits)
        tokens.append(logits.argmax(-1))
        before = tokens[-1] if previous is None else previous[:, slot]
    return torch.stack(tokens, dim=1), torch.stack(rows, dim=1)


def _assert_same_selector(theirs, ours, target):
    """On the same context: the backbone logits, the greedy selector path (which differs from the backbone's own
    argmax: the selector mattered), and along z-lab's sampled paths our softmax at its temperature is its q on its
    candidates and 0 elsewhere (the draft distribution rejection sampling reads)."""
    features, block = _context(target)
    hidden, expected_logits = _zlab_block(theirs, target, features, block)
    anchor = block[:, 0]
    with torch.no_grad():
        out = ours(input_ids=block, target_hidden_states=features)
        torch.testing.assert_close(out.base_logits[:, 1:], expected_logits, atol=1e-5, rtol=0)
        their_path = theirs.propose(hidden, anchor, target.lm_head, 0.0)[0]
        our_path, _ = _our_path(ours, out, anchor)
        assert torch.equal(our_path, their_path)
        assert not torch.equal(their_path, expected_logits.argmax(-1))
        for seed in range(3):
            torch.manual_seed(seed)
            path, candidates, q = theirs.propose(hidden, anchor, target.lm_head, 0.8)
            _, logits = _our_path(ours, out, anchor, previous=path)
            ours_q = torch.softmax(logits / 0.8, dim=-1)
            torch.testing.assert_close(ours_q.gather(-1, candidates), q, atol=1e-5, rtol=0)
            torch.testing.assert_close(ours_q.gather(-1, candidates).sum(-1), torch.ones(1, BLOCK - 1))


@pytest.mark.parametrize("settings", [{}, {"output_multiplier": 0.7}, {"final_logit_softcapping": 2.0}],
                         ids=["plain", "output_multiplier", "softcapping"])
def test_selector_matches_zlab_propose(tmp_path, target, settings):
    theirs = _zlab_dflash2(**settings)
    ours = hf_dspark.AutoDrafter.from_pretrained(_saved(theirs, tmp_path))
    assert type(ours) is hf_dspark.DFlash2DraftModel and not ours.training and ours.dtype == torch.float32
    config = ours.config
    assert {name: getattr(config, name) for name in DFLASH2} == DFLASH2
    assert (config.sample_from_anchor, config.block_size, config.mask_token_id) == (False, BLOCK, MASK)
    ours.attach_target(target)
    _assert_same_selector(theirs, ours, target)


def test_codebooks_stored_without_weight_suffix_load_the_same(tmp_path, target):
    """z-lab's `DFlash2DraftModel.from_pretrained` maps `candidate_selector.<codebook>` to `<codebook>.weight`:
    checkpoints stored either way load to the same drafter."""
    folder = _saved(_zlab_dflash2(), tmp_path / "suffixed")
    state = load_file(folder / "model.safetensors")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    save_file({name.removesuffix(".weight") if "codebook" in name else name: tensor
               for name, tensor in state.items()}, bare / "model.safetensors", metadata={"format": "pt"})
    assert "candidate_selector.successor_codebook" in load_file(bare / "model.safetensors")
    first, second = (hf_dspark.AutoDrafter.from_pretrained(path).state_dict() for path in (folder, bare))
    assert first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize("change,named", [
    ({"architectures": ["DFlashDraftModel"]}, "ignores them"),
    ({"dflash_config": {"selector_top_k": None}}, "selector_top_k"),
    ({"dflash_config": {"conv_group_size": 24}}, "conv_group_size"),
    ({"dflash_config": {"output_multiplier": 0}}, "output_multiplier=0"),
])
def test_inconsistent_dflash2_configs_are_refused_by_name(tmp_path, change, named):
    folder = _saved(_zlab_dflash2(), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update({k: v for k, v in change.items() if k != "dflash_config"})
    config["dflash_config"].update(change.get("dflash_config", {}))
    config["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf_dspark.DrafterLoadError, match="config.json") as error:
        hf_dspark.AutoDrafter.from_pretrained(folder)
    assert named in str(error.value)


def _agreeing_pair():
    """A tiny target and a z-lab DFlash 2 drafter that agree often enough for non-trivial acceptance without
    training: both nearly skip their layers, the target's LM-head row STICKY points at the embeddings of MASK and a few
    other tokens (so the target often goes to STICKY and the drafter's mask slots draft it), and the selector's
    codebooks stay small enough not to overrule that, yet large enough to change the logits."""
    target = tiny_target("qwen3", vocab_size=VOCAB, seed=0)
    drafter = _zlab_dflash2(codebook_std=0.3)
    make_agree(target, drafter)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("base_kernel"):  # the convolutions near identity
                param.normal_(0.0, 0.05)
                param[:, 0] += 1.0
    return target, drafter


def test_greedy_generation_matches_zlab_generate(tmp_path, monkeypatch):
    target, theirs = _agreeing_pair()
    ours = hf_dspark.AutoDrafter.from_pretrained(_saved(theirs, tmp_path))
    ours.generation_config.update(dspark_round_planning=False, dspark_suffix_drafting=False)  # full blocks, as z-lab
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its stats clock synchronises CUDA
    accepting_rounds = 0
    for prompt_seed in range(3):
        prompt = torch.randint(2, VOCAB, (1, 6 + prompt_seed), generator=torch.Generator().manual_seed(prompt_seed))
        run = zlab.dflash_generate(theirs, target, prompt, 24, None, return_stats=True)
        mine = target.generate(prompt, assistant_model=ours, do_sample=False, max_new_tokens=24)
        assert torch.equal(mine, run.output_ids)
        assert torch.equal(mine, target.generate(prompt, do_sample=False, max_new_tokens=24))
        # z-lab records accepted drafts + 1 per round and shrinks its block near max_length (other drafts then):
        # the full-block rounds accept exactly as many drafts, so they proposed the same tokens up to the first miss.
        stats = ours.last_generation_stats
        full = [i for i in range(len(run.acceptance_lengths)) if 24 - sum(run.acceptance_lengths[:i]) >= BLOCK]
        assert len(full) >= 3
        assert [stats.accepted[i] + 1 for i in full] == [run.acceptance_lengths[i] for i in full]
        accepting_rounds += sum(run.acceptance_lengths[i] > 1 for i in full)
    assert accepting_rounds >= 3  # rounds that accepted drafts, not only rejections


def _our_dflash2(target, **overrides):
    """hf_dspark's own DFlash 2 in z-lab's slot convention, norms and convolutions away from 1 / the identity and
    codebooks wide, so that a swapped or dropped one would show."""
    fields = {"sample_from_anchor": False, "mask_token_id": MASK, "target_layer_ids": [0, 2], **DFLASH2, **overrides}
    drafter = tiny_drafter(target, "dflash2", block_size=BLOCK, **fields)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name or "base_kernel" in name:
                param.add_(0.3 * torch.randn_like(param))
            elif "codebook" in name:
                param.normal_(0.0, 1.0)
    return drafter.eval()


@pytest.mark.parametrize("settings", [{}, {"final_logit_softcapping": 2.0}], ids=["plain", "softcapping"])
def test_our_export_loads_in_zlab_with_nothing_missing_and_proposes_the_same(tmp_path, target, settings):
    ours = _our_dflash2(target, **settings)
    export_zlab(ours, tmp_path)
    theirs, info = DFlash2DraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert theirs.block_size == BLOCK and theirs.mask_token_id == MASK and list(theirs.target_layer_ids) == [0, 2]
    ours.attach_target(target)
    _assert_same_selector(theirs.float().eval(), ours, target)


def test_round_trips_through_zlab_layout_are_exact(tmp_path, target):
    ours = _our_dflash2(target)
    back = hf_dspark.AutoDrafter.from_pretrained(export_zlab(ours, tmp_path / "exported"))
    mine, again = ours.state_dict(), back.state_dict()
    assert mine.keys() == again.keys() and all(torch.equal(mine[name], again[name]) for name in mine)
    fields = ["block_size", "sample_from_anchor", "mask_token_id", "target_layer_ids", "target_num_hidden_layers",
              *DFLASH2]
    assert all(getattr(back.config, name) == getattr(ours.config, name) for name in fields)
    # z-lab's -> ours -> z-lab's writes the same tensors (an output multiplier is folded into them: the same drafter).
    theirs = _zlab_dflash2()
    export_zlab(hf_dspark.AutoDrafter.from_pretrained(_saved(theirs, tmp_path / "theirs")), tmp_path / "again")
    original, written = (load_file(tmp_path / name / "model.safetensors") for name in ("theirs", "again"))
    assert original.keys() == written.keys() and all(torch.equal(original[n], written[n]) for n in original)


@pytest.mark.parametrize("change,named", [({"sample_from_anchor": True}, "sample_from_anchor is true"),
                                          ({"draft_vocab_size": 40}, "draft vocabulary")])
def test_export_refuses_what_zlab_cannot_hold(tmp_path, target, change, named):
    with pytest.raises(UserInputError, match=named):
        export_zlab(_our_dflash2(target, **change), tmp_path)


def test_a_dflash_drafter_exports_to_zlab_dflash_too(tmp_path, target):
    """The same export writes hf_dspark's DFlash (no convolutions, no selector) as z-lab's DFlashDraftModel."""
    from dflash import DFlashDraftModel

    ours = tiny_drafter(target, "dflash", block_size=BLOCK, sample_from_anchor=False, mask_token_id=MASK,
                        target_layer_ids=[0, 2], final_logit_softcapping=2.0)
    export_zlab(ours, tmp_path)
    theirs, info = DFlashDraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert type(theirs) is DFlashDraftModel and not any(info.values()), info
    ours.attach_target(target)
    features, block = _context(target)
    _, expected = _zlab_block(theirs.float().eval(), target, features, block)
    with torch.no_grad():
        mine = ours(input_ids=block, target_hidden_states=features).base_logits[:, 1:]
    torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)
    assert hf_dspark.AutoDrafter.from_pretrained(tmp_path).config.final_logit_softcapping == 2.0
