"""Devices and dtypes: `--device` / `device_map` in loading and every command that loads a model, the drafter
following its target in `attach_target(follow=True)` (and not under training), cost tables profiled with R rows.
Tests that need an accelerator run on CUDA when there is one and are skipped otherwise; the rest run anywhere."""

import math

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModel, PreTrainedTokenizerFast, TrainingArguments

from hf_dspark.cli.generate import load_drafters
from hf_dspark.cli.main import build_parser, main
from hf_dspark.models.errors import DrafterTargetMismatchError, UserInputError
from hf_dspark.models.layers import DraftContextCache
from hf_dspark.models.loading import load_drafter, resolve_device
from hf_dspark.targets.loading import load_target
from hf_dspark.evaluation.profiling import profile_verification_costs
from hf_dspark.policy import VerificationCostTable
from hf_dspark.evaluation.profiling import verification_shape
from factories import VOCAB, prompts, tiny_drafter, tiny_target

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MISSING_DEVICE = "cuda:7"  # no machine these tests run on has eight GPUs (checked where it matters)


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    """A tiny Llama target with a word-level tokenizer, saved as `load_target` reads it."""
    folder = tmp_path_factory.mktemp("devices") / "target"
    target = tiny_target("llama")
    target.save_pretrained(folder)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved_drafter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("devices") / "drafter"
    tiny_drafter(tiny_target("llama"), "markov", block_size=4).save_pretrained(folder)
    return folder


def skip_if_missing_device_exists():
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip(f"{MISSING_DEVICE} exists on this machine")


# ---------------------------------------------------------------------------------------------------------
# Device names and loading
# ---------------------------------------------------------------------------------------------------------


def test_device_names_resolve_to_devices_that_exist():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" cpu:0 ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    auto = resolve_device("auto")
    if torch.accelerator.is_available():
        assert auto.type == torch.accelerator.current_accelerator().type and auto.index is not None
    else:
        assert auto == torch.device("cpu")


@pytest.mark.parametrize("device, needles", [
    (MISSING_DEVICE, ["'cuda:7'", "cpu, or auto"]),
    ("gpu", ["unknown device 'gpu'", "cuda:N"]),
    ("meta", ["meta device holds no weights", "cpu, or auto"]),
    (True, ["device must be a name"]),
])
def test_a_device_that_is_not_here_is_one_clear_error(device, needles):
    skip_if_missing_device_exists()
    with pytest.raises(UserInputError) as error:
        resolve_device(device)
    message = str(error.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_load_target_places_the_model_and_refuses_what_cannot_work(saved_target, saved_drafter):
    skip_if_missing_device_exists()
    target, tokenizer = load_target(str(saved_target), "float32", device="cpu")
    assert target.device == torch.device("cpu") and not target.training and tokenizer("w3").input_ids == [3]
    mapped, _ = load_target(str(saved_target), "bfloat16", device_map={"": "cpu"})
    assert mapped.dtype == torch.bfloat16 and mapped.device == torch.device("cpu")
    with pytest.raises(UserInputError, match=r"no device 'cuda:7' here"):
        load_target(str(saved_target), "float32", device=MISSING_DEVICE)
    with pytest.raises(UserInputError, match=r"no device 'cuda:7' here"):
        load_target(str(saved_target), "float32", device_map={"model": "cpu", "lm_head": MISSING_DEVICE})
    with pytest.raises(UserInputError, match="not both"):
        load_target(str(saved_target), "float32", device="cpu", device_map="auto")
    with pytest.raises(UserInputError, match="unknown dtype 'int8'"):
        load_target(str(saved_target), "int8")
    with pytest.raises(UserInputError, match=r"no device 'cuda:7' here"):
        load_target(None, "float32", device=MISSING_DEVICE)  # the embedded default: refused before it loads
    assert load_drafter(saved_drafter, torch.float32, device="cpu").device == torch.device("cpu")
    with pytest.raises(UserInputError, match=r"no device 'cuda:7' here"):
        load_drafter(saved_drafter, torch.float32, device=MISSING_DEVICE)


# ---------------------------------------------------------------------------------------------------------
# --device on the command line
# ---------------------------------------------------------------------------------------------------------

MODEL_COMMANDS = [
    ["generate", "hi"],
    ["bench"],
    ["eval", "--output", "unused"],
    ["regenerate", "--output", "unused"],
    ["cache", "--output", "unused"],
    ["train", "--output", "unused"],
    ["profile", "--output", "unused"],
]


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda argv: argv[0])
def test_every_model_command_takes_device_and_refuses_a_missing_one_before_loading(command, capsys, monkeypatch):
    skip_if_missing_device_exists()
    assert build_parser().parse_args(command).device == "auto"
    assert build_parser().parse_args(command + ["--device", "cuda:1"]).device == "cuda:1"
    import hf_dspark.cli.main as cli
    import hf_dspark.targets.loading as loading

    for module in (cli, loading):
        monkeypatch.setattr(module, "load_target", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(command + ["--device", MISSING_DEVICE]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith(f"hf-dspark {command[0]}: no device 'cuda:7' here")


def test_profile_passes_device_and_rows_through_to_a_real_load(saved_target, saved_drafter, tmp_path, capsys,
                                                               monkeypatch):
    import hf_dspark.cli.main as cli

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("device"))
        return load_target(*args, **kwargs)

    monkeypatch.setattr(cli, "load_target", recording)
    output = tmp_path / "costs.json"
    assert main(["profile", "--target", str(saved_target), "--drafter", str(saved_drafter), "--device", "cpu",
                 "--rows", "3", "--max-tokens", "5", "--context-length", "8", "--repeats", "1",
                 "--output", str(output)]) == 0
    assert seen == ["cpu"]
    table = VerificationCostTable.load(output)
    assert table.description["rows"] == 3 and table.description["device"] == "cpu" and table.max_tokens == 5
    assert "B =   5 tokens over 3 rows" in capsys.readouterr().out
    assert main(["profile", "--target", str(saved_target), "--rows", "0", "--output", str(output)]) == 2
    assert "--rows must be at least 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# The drafter follows its target for generation, not under training
# ---------------------------------------------------------------------------------------------------------


def draft_logits(drafter, seed: int = 5):
    generator = torch.Generator().manual_seed(seed)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    features = torch.randn(1, 6, width, generator=generator).to(drafter.device)
    block = torch.full((1, drafter.config.block_size), drafter.config.mask_token_id, device=drafter.device)
    block[0, 0] = 7
    return drafter(input_ids=block, target_hidden_states=features, cache=DraftContextCache()).logits


def test_following_casts_the_drafter_as_loading_it_in_the_target_dtype_would(saved_drafter):
    target = tiny_target("llama").to(torch.bfloat16)
    follower = load_drafter(saved_drafter, torch.float32)
    follower.attach_target(target, follow=True)
    loaded = AutoModel.from_pretrained(saved_drafter, dtype=torch.bfloat16).eval()
    loaded.attach_target(target)
    assert {p.dtype for p in follower.parameters()} == {torch.bfloat16}
    assert follower.rotary_emb.inv_freq.dtype == torch.float32  # rotary frequencies keep their precision
    assert follower.state_dict().keys() == loaded.state_dict().keys()
    for name, value in loaded.state_dict().items():
        assert torch.equal(follower.state_dict()[name], value), name
    for (name, mine), (_, theirs) in zip(follower.named_buffers(), loaded.named_buffers()):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
    assert torch.equal(draft_logits(follower), draft_logits(loaded))


def test_generation_loaders_follow_and_training_keeps_float32(saved_drafter, tmp_path):
    from hf_dspark.training import DSparkTrainer

    target = tiny_target("llama").to(torch.bfloat16)
    (drafter,) = load_drafters({"tiny": str(saved_drafter)}, target, schedule=False, target_name="tiny").values()
    assert drafter.dtype == torch.bfloat16  # what hf-dspark generate / bench / eval run

    trained = tiny_drafter(target, "markov").train()
    assert trained.dtype == torch.float32
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to=[], max_steps=1)
    trainer = DSparkTrainer(model=trained, target=target, args=args, train_dataset=[])
    assert trainer.target is target and {p.dtype for p in trained.parameters()} == {torch.float32}
    trained.attach_target(target)  # the default is training's: nothing changes on the drafter
    assert trained.dtype == torch.float32 and trained.target_heads.lm_head is target.lm_head
    ids = torch.tensor([[3, 4, 5]])
    assert trained.embed(ids).dtype == torch.bfloat16  # the shared heads keep the target's dtype


def test_continued_training_starts_in_float32_beside_a_bfloat16_target(tmp_path):
    from hf_dspark.training.recipes import continue_drafter

    target = tiny_target("llama").to(torch.bfloat16)
    tiny_drafter(target, "markov").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    drafter = continue_drafter("dspark", str(tmp_path / "bf16"), target)
    assert drafter.dtype == torch.float32 and drafter.training and drafter.target_heads.lm_head is target.lm_head


def test_a_target_in_a_dtype_drafters_cannot_run_leaves_the_drafter_dtype():
    target = tiny_target("llama").to(torch.float8_e4m3fn)
    drafter = tiny_drafter(tiny_target("llama"), "markov")
    drafter.attach_target(target, follow=True)
    assert drafter.dtype == torch.float32


def test_what_cannot_follow_is_refused_with_the_reason():
    target = tiny_target("llama")
    unloaded = tiny_drafter(target, "markov").to("meta")
    with pytest.raises(DrafterTargetMismatchError, match=r"weights .* are on the meta device, not loaded"):
        unloaded.attach_target(target, follow=True)
    with pytest.raises(DrafterTargetMismatchError, match=r"drafter is on meta .* follow=True"):
        unloaded.attach_target(target)  # the training default names both fixes

    spread = tiny_drafter(target, "markov")
    spread.hf_device_map = {"layers.0": 0, "layers.1": 1}
    with pytest.raises(DrafterTargetMismatchError, match="spread over 0, 1 by a device_map"):
        spread.attach_target(target, follow=True)

    offloaded = tiny_target("llama")
    offloaded.lm_head.to("meta")
    with pytest.raises(DrafterTargetMismatchError, match="LM head is offloaded"):
        tiny_drafter(target, "markov").attach_target(offloaded, follow=True)


def test_training_refuses_a_target_away_from_the_trainer_device():
    from hf_dspark.training.recipes import _check_training_device

    _check_training_device(torch.device("cpu"), torch.device("cpu"))
    _check_training_device(torch.device("mps"), torch.device("mps", 0))
    with pytest.raises(UserInputError, match=r"target is on cpu but training runs on cuda:0.*--device cuda:0"):
        _check_training_device(torch.device("cuda", 0), torch.device("cpu"))


@needs_cuda
def test_a_drafter_follows_a_gpu_target_and_generates_there(saved_target, saved_drafter):
    target, _ = load_target(str(saved_target), "bfloat16", device="cuda")
    assert target.device == torch.device("cuda", 0) and target.dtype == torch.bfloat16
    drafter = load_drafter(saved_drafter, torch.float32)  # on the CPU, in float32
    drafter.attach_target(target, follow=True)
    assert drafter.device == torch.device("cuda", 0) and drafter.dtype == torch.bfloat16
    assert draft_logits(drafter).device == torch.device("cuda", 0)
    table = profile_verification_costs(target, max_tokens=4, context_length=8, repeats=2, drafter=drafter, rows=2)
    assert table.description["device"] == "cuda:0" and table.draft_seconds > 0


@needs_cuda
def test_a_target_split_over_devices_takes_the_drafter_to_its_lm_head():
    target = tiny_target("llama")
    target.lm_head.to("cuda")  # the embedding stays on the CPU, as a device_map may leave it
    drafter = tiny_drafter(tiny_target("llama"), "markov")
    drafter.attach_target(target, follow=True)
    assert drafter.device == torch.device("cuda", 0)
    ids = prompts(1)[0].cuda()
    embedded = drafter.embed(ids)
    assert embedded.device == torch.device("cuda", 0)
    assert torch.equal(embedded.cpu(), target.get_input_embeddings()(ids.cpu()))
    assert draft_logits(drafter).device == torch.device("cuda", 0)


# ---------------------------------------------------------------------------------------------------------
# Cost tables profiled with R rows
# ---------------------------------------------------------------------------------------------------------


def recorded_shapes(model) -> tuple[list, object]:
    shapes = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return shapes, handle


@pytest.mark.parametrize("rows", [1, 4])
def test_a_table_for_r_rows_times_forwards_of_r_rows(rows):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "markov", block_size=4)
    context, max_tokens, repeats, warmup = 12, 9, 2, 1  # a context longer than any timed forward
    shapes, handle = recorded_shapes(target)
    draft_shapes, draft_handle = recorded_shapes(drafter)
    try:
        table = profile_verification_costs(target, max_tokens=max_tokens, context_length=context, repeats=repeats,
                                           warmup=warmup, drafter=drafter, rows=rows)
    finally:
        handle.remove()
        draft_handle.remove()
    assert table.max_tokens == max_tokens and all(s > 0 for s in table.seconds) and table.draft_seconds > 0
    assert table.description["rows"] == rows
    timed = [shape for shape in shapes if shape[1] != context]  # the rest are the prefills of the caches
    sizes = [(min(n, rows), math.ceil(n / min(n, rows))) for n in range(1, max_tokens + 1)]
    # Warm-ups size by size, then the timed repeats round-robin over the sizes.
    expected = [shape for shape in sizes for _ in range(warmup)] + sizes * repeats
    assert timed == expected
    assert sorted({shape for shape in shapes if shape[1] == context}) == [(b, context) for b in range(1, rows + 1)]
    assert set(draft_shapes) == {(rows, drafter.config.block_size)}  # the drafter's round over R rows too
    assert verification_shape(9, 4) == (4, 3) and verification_shape(8, 4) == (4, 2) and verification_shape(2, 4) == (2, 1)


def test_a_burst_of_other_load_does_not_bend_the_table(monkeypatch):
    """Other work on the machine (a burst slowing a few consecutive forwards) must not inflate the sizes it meets:
    the planner reads the table's shape. Timed round-robin, each size meets at most one slow repeat of five."""
    from hf_dspark.evaluation import profiling as cost_table

    target = tiny_target("llama")
    clock = {"now": 0.0, "timed_calls": 0}
    slow = range(20, 23)  # three consecutive timed forwards run 100x slower

    def forward_cost(module, args, kwargs):
        width = kwargs["input_ids"].shape[1]
        if width == 16:  # the cache prefill
            return
        clock["timed_calls"] += 1
        clock["now"] += (1.0 + width) * (100.0 if clock["timed_calls"] in slow else 1.0)

    handle = target.register_forward_pre_hook(forward_cost, with_kwargs=True)
    monkeypatch.setattr(cost_table, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: clock["now"])}))
    try:
        table = profile_verification_costs(target, max_tokens=6, context_length=16, repeats=5, warmup=1)
    finally:
        handle.remove()
    assert clock["timed_calls"] == 6 * (1 + 5)
    assert table.seconds == [1.0 + n for n in range(1, 7)]


def test_rows_must_be_a_positive_count():
    with pytest.raises(ValueError, match="rows must be an int >= 1"):
        profile_verification_costs(tiny_target("llama"), max_tokens=2, context_length=4, rows=0)


def test_a_drafter_keeps_its_own_precision_after_drafting_for_a_bfloat16_target(saved_drafter):
    """Following a bfloat16 target casts for the call only: afterwards, and beside a float32 target, the drafter's
    weights are its own float32 ones bit for bit, and it drafts exactly as a freshly loaded one."""
    from hf_dspark.generation.engine.speculative_engine import SpeculativeEngine

    fresh = load_drafter(saved_drafter, torch.float32)
    original = {name: value.clone() for name, value in fresh.state_dict().items()}
    drafter = load_drafter(saved_drafter, torch.float32)
    target = tiny_target("llama")
    low = tiny_target("llama").to(torch.bfloat16)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    low.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=6)
    assert drafter.dtype == torch.float32
    for name, value in drafter.state_dict().items():
        assert value.dtype == original[name].dtype and torch.equal(value, original[name]), name
    # A long-lived engine keeps the drafter cast while it runs; the next float32 use starts from the originals.
    SpeculativeEngine(low, drafter)
    assert drafter.dtype == torch.bfloat16
    expected = target.generate(ids, assistant_model=fresh, do_sample=False, max_new_tokens=12)
    assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12), expected)
    fresh.attach_target(target)
    assert torch.equal(draft_logits(drafter), draft_logits(fresh))
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, original[name]), name


def test_weights_changed_after_following_are_kept(saved_drafter):
    """What the user did to the cast weights (training, loading, editing) wins over the kept originals."""
    drafter = load_drafter(saved_drafter, torch.float32)
    drafter.attach_target(tiny_target("llama").to(torch.bfloat16), follow=True)
    weight = next(drafter.parameters())
    with torch.no_grad():
        weight.add_(1.0)
    edited = weight.detach().clone()
    assert not drafter.restore_own_precision()
    assert torch.equal(next(drafter.parameters()), edited) and edited.dtype == torch.bfloat16
