"""`hf-dspark convert --to deepspec|speculators|hf_dspark` on the layouts published since DeepSpec: SpecForge's
`DSparkDraftModel` (every head kind) and LiquidAI's `Lfm2DSparkDraftModel` (interleaved rotary, written as split-half
weights) are written in each destination and read back with the same per-slot logits and confidences; Kimi K3's MLA
drafter is refused by every destination (`test_interop_k3_dspark.py`)."""

from pathlib import Path

import pytest
import torch

import hf_dspark
from hf_dspark.cli.main import main
from hf_dspark.hub.convert import convert_drafter
from layout_fixtures import write_checkpoint
from test_interop_lfm2_dspark import published_config, published_tensors

GOLDEN = Path(__file__).parents[1] / "data" / "specforge_golden"
LAYOUTS = ("hf_dspark", "deepspec", "speculators")


def _outputs(drafter, seed: int = 5):
    generator = torch.Generator().manual_seed(seed)
    config = drafter.config
    if drafter._target_heads is None:
        drafter.attach_stored_heads(torch.randn(config.vocab_size, config.hidden_size, generator=generator),
                                    torch.randn(config.vocab_size, config.hidden_size, generator=generator))
    features = torch.randn(1, 7, len(config.target_layer_ids) * config.hidden_size, generator=generator)
    block = torch.tensor([[17] + [config.mask_token_id] * (config.block_size - 1)])
    previous = torch.randint(6, config.vocab_size, (1, config.block_size), generator=generator)
    with torch.no_grad():
        out = drafter(input_ids=block, target_hidden_states=features, previous_token_ids=previous)
    return out.logits, out.confidence_logits


def _round_trip(source: Path, tmp_path: Path, layout: str) -> None:
    original = _outputs(hf_dspark.AutoDrafter.from_pretrained(source))
    found, written = convert_drafter(source, tmp_path / layout, layout)
    assert written == layout
    again = _outputs(hf_dspark.AutoDrafter.from_pretrained(tmp_path / layout))
    torch.testing.assert_close(again[0], original[0], atol=1e-5, rtol=0)
    if original[1] is None:
        assert again[1] is None
    else:
        torch.testing.assert_close(again[1], original[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["vanilla", "gated", "rnn", "no_markov"])
def test_specforge_drafters_convert_exactly(tmp_path, variant, layout):
    _round_trip(GOLDEN / variant, tmp_path, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lfm2_drafters_convert_exactly(tmp_path, layout):
    source = write_checkpoint(tmp_path / "lfm2", published_config(), published_tensors())
    _round_trip(source, tmp_path, layout)


def test_the_command_line_converts_a_new_layout(tmp_path, capsys):
    assert main(["convert", str(GOLDEN / "vanilla"), str(tmp_path / "out"), "--to", "deepspec"]) == 0
    assert hf_dspark.AutoDrafter.from_pretrained(tmp_path / "out").config.markov_head == "markov"
