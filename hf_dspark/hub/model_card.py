"""Model cards for drafters, rendered from `templates/drafter_card.md` (YAML metadata + the facts a user
needs: config, exact training commands, data, time, measured acceptance and speed)."""

from __future__ import annotations

from pathlib import Path

TEMPLATE = Path(__file__).parent / "templates" / "drafter_card.md"
KIND_NAMES = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "Eagle3"}


def describe_config(config) -> str:
    """One paragraph of the drafter's architecture from its config."""
    parts = [f"{config.num_hidden_layers} decoder layer{'s' if config.num_hidden_layers != 1 else ''} of width "
             f"{config.hidden_size} ({config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, "
             f"intermediate {config.intermediate_size})",
             f"`block_size` {config.block_size}", f"`target_layer_ids` {list(config.target_layer_ids)}"]
    if getattr(config, "markov_head", None):
        parts.append(f"{config.markov_head} sequential head of rank {config.markov_rank}")
    if getattr(config, "confidence_head", False):
        parts.append("confidence head")
    if config.draft_vocab_size:
        parts.append(f"draft vocabulary of the {config.draft_vocab_size} most frequent answer tokens (verification "
                     f"stays exact over all {config.vocab_size} target tokens)")
    return ", ".join(parts) + "."


def render_model_card(*, kind: str, base_model: str, title: str, summary: str, config, commands: list[str],
                      training: str, measured: str, datasets: list[str]) -> str:
    return TEMPLATE.read_text().format(
        base_model=base_model, kind=kind, title=title, summary=summary, config=describe_config(config),
        commands="\n".join(commands), training=training, measured=measured,
        datasets="\n".join(f"  - {d}" for d in datasets) or "  []",
    )
