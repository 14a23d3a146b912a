"""transformers' own speculative decoding runs exactly as it does without hf_dspark.

`import hf_dspark` replaces three `GenerationMixin` methods (hf_dspark/generation/routing/integration.py), which act
only when the assistant is one of hf_dspark's drafters. Every speculative path transformers has of its own must stay
stock: prompt lookup, a classic assistant, early exit, assistants with another tokenizer (greedy, and universal
assisted decoding when sampling), MTP layers, the Gemma 4 assistants and DFlash. Each path runs in two fresh
processes that build the same seeded tiny models with plain transformers: one never imports hf_dspark, the other
imports it first. Both wrap `GenerationMixin._get_candidate_generator` the same way to record the class of the
candidate generator transformers picks and how many tokens it proposes each round; the class, those rounds and the
generated tokens must be the same in both runs (the tokens alone could not show a changed drafting: greedy speculative
decoding gives the same tokens whatever is drafted).

Run as a script, this file is one of those processes:
`python tests/coexistence/test_transformers_paths.py OUT_FOLDER [--import-hf-dspark]` writes OUT_FOLDER/results.json.
(hf_dspark's refusal of these options together with one of its own drafters is tests/lossless/test_generate_options.py's.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128
PROMPT_LENGTH = 12
NEW_TOKENS = 10
SAMPLING_SEED = 7

GEMMA4_ASSISTANT_GENERATOR = "SinglePositionMultiTokenCandidateGenerator"
PATHS = {
    # path: (the candidate generator transformers picks for it, the transformers classes the path is built from)
    "prompt_lookup": ("PromptLookupCandidateGenerator", ("LlamaForCausalLM",)),
    "assistant_model": ("AssistedCandidateGenerator", ("LlamaForCausalLM",)),
    "early_exit": ("EarlyExitCandidateGenerator", ("LlamaForCausalLM",)),
    "different_tokenizers": ("AssistedCandidateGeneratorDifferentTokenizers",
                             ("LlamaForCausalLM", "PreTrainedTokenizerFast")),
    "universal_assisted_sampling": ("UniversalSpeculativeDecodingGenerator",
                                    ("LlamaForCausalLM", "PreTrainedTokenizerFast")),
    "mtp": ("MTPCandidateGenerator", ("MellumForCausalLM", "modeling_layers.MtpModel")),
    "gemma4_assistant": (GEMMA4_ASSISTANT_GENERATOR, ("Gemma4ForCausalLM", "Gemma4AssistantForCausalLM")),
    "gemma4_unified_assistant": (GEMMA4_ASSISTANT_GENERATOR,
                                 ("Gemma4UnifiedForCausalLM", "Gemma4UnifiedAssistantForCausalLM")),
    "gemma3n_target_gemma4_assistant": (GEMMA4_ASSISTANT_GENERATOR,
                                        ("Gemma3nForCausalLM", "Gemma4AssistantForCausalLM")),
    "dflash": ("DFlashTokenCandidateGenerator", ("MuseGlimmerForConditionalGeneration", "MuseGlimmerAssistantModel")),
}
UNBUILDABLE = {
    # path: why transformers itself fails it (both runs are still made: the failure must be the same in both, and
    # a release that fixes it gets the path compared like any other)
    "gemma3n_target_gemma4_assistant": (
        "`_get_candidate_generator` accepts a Gemma 3n target for a Gemma 4 assistant, but Gemma3nTextModel keeps "
        "the shared key/value states it computes to itself (its output has no `shared_kv_states`), so "
        "SinglePositionMultiTokenCandidateGenerator raises before its first draft, with or without hf_dspark"),
}


def missing(path: str) -> str | None:
    """What the installed transformers lacks to build `path` (a release before the path existed), else None."""
    import transformers
    from transformers.generation import candidate_generator

    generator, classes = PATHS[path]
    absent = [] if hasattr(candidate_generator, generator) else [f"generation.candidate_generator.{generator}"]
    for name in classes:
        owner = transformers
        for part in name.split(".")[:-1]:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name.split(".")[-1]):
            absent.append(name)
    return f"transformers {transformers.__version__} has no {', '.join(absent)}" if absent else None


# ----------------------------------------------------------------------------------------------------------------
# The tests (the pytest process, which has imported hf_dspark through conftest.py, only starts the two runs)
# ----------------------------------------------------------------------------------------------------------------


def _run(folder: Path, import_hf_dspark: bool) -> dict:
    folder.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, __file__, str(folder)] + (["--import-hf-dspark"] if import_hf_dspark else [])
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "results.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, dict]:
    """{imported hf_dspark: that process's results}; the two processes run one after the other."""
    folder = tmp_path_factory.mktemp("transformers_paths")
    return {imported: _run(folder / ("with" if imported else "without"), imported) for imported in (False, True)}


def test_one_run_never_imports_hf_dspark_and_the_other_runs_under_its_hooks(runs):
    """The comparison proves something only if the second run really went through hf_dspark's wrapped methods and
    the first never loaded hf_dspark at all."""
    assert runs[False]["hf_dspark_imported"] is False and runs[False]["generate_hooks_installed"] is False
    assert runs[True]["hf_dspark_imported"] is True and runs[True]["generate_hooks_installed"] is True


@pytest.mark.parametrize("path", list(PATHS))
def test_transformers_own_path_runs_the_same_generator_rounds_and_tokens_with_hf_dspark_imported(runs, path):
    """hf_dspark's wrappers must hand every call without an hf_dspark drafter to stock transformers untouched: the
    same candidate generator class, proposing as many tokens each round, and the same tokens (greedy, or sampled
    from the same seed for universal assisted decoding)."""
    absent = missing(path)
    if absent is not None:
        pytest.skip(f"{path}: {absent}")
    without, with_hf_dspark = runs[False]["paths"][path], runs[True]["paths"][path]
    if "error" in without:
        assert with_hf_dspark == without, "stock transformers fails this path, and not the same way with hf_dspark"
        import transformers
        why = UNBUILDABLE.get(path, "it fails the same way with and without hf_dspark")
        pytest.skip(f"{path} cannot run on transformers {transformers.__version__}: {why} ({without['error']})")
    assert "error" not in with_hf_dspark, f"{path} fails once hf_dspark is imported: {with_hf_dspark['error']}"
    expected = PATHS[path][0]
    assert without["candidate_generators"] == [expected], f"the run without hf_dspark did not take the {path} path"
    assert with_hf_dspark["candidate_generators"] == without["candidate_generators"]
    assert with_hf_dspark["tokens"] == without["tokens"]
    assert with_hf_dspark["draft_lengths"] == without["draft_lengths"]  # the same rounds, not only the same output
    assert sum(without["draft_lengths"]) > 0, f"the {path} path proposed no token: nothing was compared"
    assert len(without["tokens"]) == len(without["prompt"]) + NEW_TOKENS


def test_auto_drafter_refuses_a_muse_glimmer_dflash_assistant_by_name(tmp_path):
    """A saved MuseGlimmerAssistantModel is transformers' own DFlash drafter. Its layers are z-lab DFlash's under
    other names, but it attends bidirectionally within an inclusive sliding window, embeds the block with the raw
    embedding rows of a target whose embedding is normed, and that target is multimodal: hf_dspark does not read it,
    and says so by name with what runs it, instead of "no drafter layout". The refusal lives outside `layout_of`, so
    generate() (which refuses an assistant whose config is in a layout hf_dspark reads) leaves transformers' own
    DFlash path alone (the `dflash` case above)."""
    import transformers

    import hf_dspark
    from hf_dspark.hub.convert import source_layout
    from hf_dspark.models.errors import UserInputError
    from hf_dspark.models.formats import layout_name
    from hf_dspark.models.loading import load_drafter

    if not hasattr(transformers, "MuseGlimmerAssistantModel"):
        pytest.skip(f"transformers {transformers.__version__} has no MuseGlimmerAssistantModel")
    _muse_glimmer_assistant().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert layout_name(config) is None
    # The Python loader, the command line's (`--drafter`) and `hf-dspark convert`'s.
    for load in (hf_dspark.AutoDrafter.from_pretrained, lambda path: load_drafter(path, None), source_layout):
        with pytest.raises(UserInputError) as refused:
            load(tmp_path)
        message = str(refused.value)
        for part in (str(tmp_path), "muse_glimmer_assistant", "z-lab DFlash", "encoder.fc", "bidirectionally",
                     "raw embedding rows", "MuseGlimmerForConditionalGeneration", 'speculation_type="dflash"'):
            assert part in message, part

    # What the refusal says to do works, here with hf_dspark imported: transformers' own DFlash drafts with it.
    assistant = transformers.AutoModel.from_pretrained(tmp_path).eval()
    target, prompt = _muse_glimmer_target(), _prompt(vocab_size=VOCAB - 3)
    drafted = target.generate(prompt, assistant_model=assistant, speculation_type="dflash", do_sample=False,
                              max_new_tokens=NEW_TOKENS)
    assert drafted.tolist() == target.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS).tolist()


# ----------------------------------------------------------------------------------------------------------------
# One run (this file as a script): tiny seeded models built with plain transformers, every path generated once
# ----------------------------------------------------------------------------------------------------------------


def _prompt(vocab_size: int = VOCAB, length: int = PROMPT_LENGTH):
    """Seeded ids from 3 (0-2: pad, bos, unk) to `vocab_size` (DFlash: below its mask and image / video tokens)."""
    import torch

    return torch.randint(3, vocab_size, (1, length), generator=torch.Generator().manual_seed(3))


def _common(**overrides) -> dict:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=16, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None)
    return {**common, **overrides}


def _seeded(seed: int, build):
    import torch

    torch.manual_seed(seed)
    return build().eval()


def _llama(seed: int, layers: int = 2, vocab_size: int = VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _seeded(seed, lambda: LlamaForCausalLM(LlamaConfig(**_common(num_hidden_layers=layers,
                                                                         vocab_size=vocab_size))))


def _word_tokenizer(words: list[str]):
    """A whitespace word-level tokenizer over `words` (ids in list order), built in memory. Its `get_vocab()` lists
    the words in id order: tokenizers' own comes from a Rust hash map, whose order changes from one process to the
    next, and transformers prunes a sampling assistant's LM head (universal assisted decoding) in that order, so two
    runs of stock transformers alone would sample differently."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    class IdOrderedVocabulary(PreTrainedTokenizerFast):
        def get_vocab(self) -> dict[str, int]:
            return dict(sorted(super().get_vocab().items(), key=lambda item: item[1]))

    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    return IdOrderedVocabulary(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", bos_token="<s>")


def _two_tokenizers():
    """The target's tokenizer and an assistant's with the same words in another order, plus eight of its own."""
    import random

    special, words = ["<pad>", "<s>", "<unk>"], [f"w{i}" for i in range(VOCAB - 3)]
    shuffled = list(words)
    random.Random(0).shuffle(shuffled)
    return _word_tokenizer(special + words), _word_tokenizer(special + shuffled + [f"x{i}" for i in range(8)])


def _mtp_target(folder: Path):
    """A Mellum target saved with one MTP layer in its checkpoint (`mtp.layers.0.*`, Mellum's layout), loaded back:
    MTPCandidateGenerator reads the MTP weights from the checkpoint the target was loaded from."""
    from safetensors.torch import load_file, save_file
    from transformers import MellumConfig, MellumForCausalLM
    from transformers.modeling_layers import MtpModel

    config = MellumConfig(**_common(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                    sliding_window=8, mlp_layer_types=["dense", "dense"], num_mtp_layers=1,
                                    mtp_mlp_layer_types=["dense"]))
    target = _seeded(0, lambda: MellumForCausalLM(config))
    mtp = _seeded(1, lambda: MtpModel(target, 1))
    target.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    weights.update({f"mtp.{name}": tensor.contiguous() for name, tensor in mtp.state_dict().items()
                    if not name.startswith(("embed_tokens.", "shared_head.", "rotary_emb."))})
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return MellumForCausalLM.from_pretrained(folder).eval()


GEMMA_TARGET_FAMILIES = {"gemma4_assistant": "gemma4", "gemma4_unified_assistant": "gemma4_unified",
                         "gemma3n_target_gemma4_assistant": "gemma3n"}


def _gemma4_pair(family: str):
    """A Gemma 4 (`gemma4` / `gemma4_unified`) target and a Gemma 4 assistant reading its shared keys/values, or a
    Gemma 3n target with a Gemma 4 assistant (`gemma3n`)."""
    import transformers

    unified = family == "gemma4_unified"
    prefix = "Gemma4Unified" if unified else "Gemma4"
    text_config = getattr(transformers, f"{prefix}TextConfig")
    # A smaller initialisation than the other families': at 0.2 the tiny Gemma 4 repeats one token.
    shape = _common(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                    global_head_dim=16, initializer_range=0.05,
                    **({} if unified else dict(vocab_size_per_layer_input=0, hidden_size_per_layer_input=0)))
    if family == "gemma3n":
        config = transformers.Gemma3nTextConfig(**_common(
            num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, num_kv_shared_layers=2, laurel_rank=4,
            altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4))
        target = _seeded(0, lambda: transformers.Gemma3nForCausalLM(config))
    else:
        target = _seeded(0, lambda: getattr(transformers, f"{prefix}ForCausalLM")(text_config(**shape)))
    assistant_config = getattr(transformers, f"{prefix}AssistantConfig")(text_config=text_config(**shape),
                                                                          backbone_hidden_size=32)
    assistant = _seeded(1, lambda: getattr(transformers, f"{prefix}AssistantForCausalLM")(assistant_config))
    assistant.generation_config.num_assistant_tokens = 4  # what the published assistants' generation_config sets
    return target, assistant


def _muse_glimmer_assistant():
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    config = MuseGlimmerAssistantConfig(**{k: v for k, v in _common().items() if k != "vocab_size"},
                                        num_hidden_layers=1, sliding_window=8, block_size=4, mask_token_id=VOCAB - 3,
                                        target_layer_ids=[0, 2])
    return _seeded(1, lambda: MuseGlimmerAssistantModel(config))


def _muse_glimmer_target():
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    config = MuseGlimmerConfig(
        text_config=_common(num_hidden_layers=4, sliding_window=8),
        vision_config=dict(patch_size=2, pos_emb_height=2, pos_emb_width=2, num_attention_heads=2, num_hidden_layers=1,
                           hidden_size=16, intermediate_size=32, max_position_embeddings=4),
        image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, out_hidden_size=64, projector_hidden_size=32)
    return _seeded(0, lambda: MuseGlimmerForConditionalGeneration(config))


def _build(path: str, folder: Path):
    """(target, generate() keyword arguments) for `path`."""
    greedy = dict(input_ids=_prompt(), do_sample=False)
    if path == "prompt_lookup":  # a prompt that repeats itself, so that lookup finds n-grams to propose
        repeated = _prompt(length=PROMPT_LENGTH // 2).repeat(1, 2)
        return _llama(0), dict(greedy, input_ids=repeated, prompt_lookup_num_tokens=3)
    if path == "assistant_model":
        return _llama(0), dict(greedy, assistant_model=_llama(1, layers=1))
    if path == "early_exit":
        return _llama(0), dict(greedy, assistant_early_exit=1)
    if path in ("different_tokenizers", "universal_assisted_sampling"):
        sampled = path == "universal_assisted_sampling"
        tokenizer, assistant_tokenizer = _two_tokenizers()
        return _llama(0), dict(greedy, do_sample=sampled, assistant_model=_llama(1, layers=1, vocab_size=VOCAB + 8),
                               tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer)
    if path == "mtp":
        return _mtp_target(folder / "mellum_with_mtp"), dict(greedy, use_mtp=True)
    if path in GEMMA_TARGET_FAMILIES:
        target, assistant = _gemma4_pair(GEMMA_TARGET_FAMILIES[path])
        return target, dict(greedy, assistant_model=assistant)
    if path == "dflash":
        return _muse_glimmer_target(), dict(greedy, input_ids=_prompt(vocab_size=VOCAB - 3),
                                            assistant_model=_muse_glimmer_assistant(), speculation_type="dflash")
    raise ValueError(path)


def _record_candidate_generators() -> tuple[list[str], list[int]]:
    """(the class name of every candidate generator transformers builds from now on, how many tokens each of their
    rounds proposed), in order: the same wrapper in both runs (hf_dspark does not replace this method)."""
    from transformers.generation.utils import GenerationMixin

    used, draft_lengths, stock = [], [], GenerationMixin._get_candidate_generator

    def recording(self, *args, **kwargs):
        generator = stock(self, *args, **kwargs)
        used.append(type(generator).__name__)
        propose = generator.get_candidates

        def get_candidates(input_ids, *args, **kwargs):
            candidates = propose(input_ids, *args, **kwargs)
            draft_lengths.append(candidates[0].shape[1] - input_ids.shape[1])
            return candidates

        generator.get_candidates = get_candidates
        return generator

    GenerationMixin._get_candidate_generator = recording
    return used, draft_lengths


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    if "--import-hf-dspark" in argv:
        import hf_dspark  # noqa: F401  (first, before transformers, as a user's program would)
    import torch
    import transformers
    from transformers.generation.utils import GenerationMixin

    transformers.logging.set_verbosity_error()
    used, draft_lengths = _record_candidate_generators()
    results = {}
    for path in PATHS:
        if missing(path) is not None:
            continue
        try:
            target, kwargs = _build(path, folder)
            used.clear(), draft_lengths.clear()
            torch.manual_seed(SAMPLING_SEED)
            with torch.no_grad():
                tokens = target.generate(**kwargs, max_new_tokens=NEW_TOKENS)
            results[path] = {"prompt": kwargs["input_ids"][0].tolist(), "tokens": tokens[0].tolist(),
                             "candidate_generators": list(used), "draft_lengths": list(draft_lengths)}
        except Exception as error:  # recorded: the test compares it with the other run's
            results[path] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
    report = {"hf_dspark_imported": "hf_dspark" in sys.modules,
              "generate_hooks_installed": hasattr(GenerationMixin._assisted_decoding, "_hf_dspark_stock"),
              "paths": results}
    (folder / "results.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
