"""`hf-dspark train --kind dflash2` trains a DFlash 2 drafter with the same trainer and CLI as the other kinds, and
`hf-dspark convert` writes it in both layouts DFlash 2 is published in (z-lab's and speculators'), each loading in
its project's own `from_pretrained` with nothing missing; DeepSpec's layout, which has no DFlash 2, is refused by
name. The exports' parity with those projects' code is tests/layouts/test_interop_zlab_dflash2.py's and
tests/layouts/test_interop_speculators_dflash2.py's."""

import pytest
import torch
from dflash import DFlash2DraftModel as ZlabDFlash2

import hf_dspark
from hf_dspark.cli.main import main
from hf_dspark.training import DSparkTrainer
from factories import tiny_drafter, tiny_target
from saved_chat_models import save_chat_target
from test_interop_speculators import their_load
from training_helpers import target_generated_examples, training_args, write_regenerated_shard

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


def test_the_selector_term_trains_the_selector_and_the_convolutions(tmp_path):
    """The trainer's DFlash 2 loss reaches every parameter: the backbone's logits train fc, the layers and the
    convolutions; the selector's cross-entropy over its candidates trains the codebooks and the projection, which
    the backbone's loss alone leaves untouched."""
    target = tiny_target("llama")
    examples = target_generated_examples(target, count=4, new_tokens=12)
    grads = {}
    for selector_weight in (0.0, 1.0):
        drafter = tiny_drafter(target, "dflash2", block_size=4).train()
        trainer = DSparkTrainer(model=drafter, target=target, args=training_args(tmp_path, 1),
                                train_dataset=examples, num_anchors=8, selector_weight=selector_weight)
        batch = trainer.data_collator(examples)
        trainer.compute_loss(drafter, batch).backward()
        grads[selector_weight] = {name: param.grad for name, param in drafter.named_parameters()}
    without, with_selector = grads[0.0], grads[1.0]
    selector = [name for name in with_selector if name.startswith("candidate_selector.")]
    assert len(selector) == 3 and all(without[name] is None or not without[name].any() for name in selector)
    assert all(with_selector[name] is not None and with_selector[name].any() for name in selector)
    convolutions = [name for name in with_selector if "_conv." in name]
    assert convolutions and all(without[name] is not None and without[name].any() for name in convolutions)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DFlash 2 drafter trained for 4 steps by the CLI, in z-lab's slot convention, beside its target."""
    folder = tmp_path_factory.mktemp("dflash2")
    save_chat_target(folder / "target")
    data = write_regenerated_shard(folder / "data")
    assert main(["train", "--kind", "dflash2", "--no-sample-from-anchor", "--target", str(folder / "target"),
                 "--data", str(data), "--output", str(folder / "drafter"), "--max-steps", "4", "--block-size", "4",
                 "--num-layers", "1", "--batch-size", "2", "--num-anchors", "4", "--max-length", "64",
                 "--save-steps", "4"]) == 0
    return folder


def test_trained_drafter_loads_and_drafts_exactly(trained):
    drafter = hf_dspark.AutoDrafter.from_pretrained(trained / "drafter")
    assert type(drafter) is hf_dspark.DFlash2DraftModel and not drafter.config.sample_from_anchor
    target = hf_dspark.models.loading.load_target_model(trained / "target")
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=12)
    assert torch.equal(target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12), expected)


def test_convert_writes_zlab_and_speculators_layouts_their_code_loads(trained, capsys):
    drafter = trained / "drafter"
    assert main(["convert", str(drafter), str(trained / "zlab"), "--to", "zlab"]) == 0
    theirs, info = ZlabDFlash2.from_pretrained(trained / "zlab", output_loading_info=True)
    assert not any(info.values()), info
    assert main(["convert", str(drafter), str(trained / "speculators"), "--to", "speculators", "--target",
                 str(trained / "target")]) == 0
    theirs, info = their_load(trained / "speculators")
    assert type(theirs).__name__ == "DFlash2DraftModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # Both read back into the same drafter, tensor for tensor.
    saved = hf_dspark.AutoDrafter.from_pretrained(drafter).state_dict()
    for layout in ("zlab", "speculators"):
        again = hf_dspark.AutoDrafter.from_pretrained(trained / layout).state_dict()
        assert saved.keys() == again.keys() and all(torch.equal(saved[n], again[n].to(saved[n].dtype)) for n in saved)
    capsys.readouterr()
    assert main(["convert", str(drafter), str(trained / "deepspec"), "--to", "deepspec"]) == 2
    assert "DeepSpec's layouts have no DFlash 2" in capsys.readouterr().err
