"""Model cards for drafters, rendered from the template in `hf_dspark/hub/templates/` (YAML metadata
+ the facts a user needs: config, exact training commands, data, time, measured acceptance and speed)."""

from __future__ import annotations

import json
from pathlib import Path

from ..models.identity import drafter_kind
from .convert import served_by_vllm

TEMPLATE = Path(__file__).parent / "templates" / "drafter_card.md"  # package data
KIND_NAMES = {"dspark": "DSpark", "dflash": "DFlash", "dflash2": "DFlash 2", "eagle3": "Eagle3"}
NOT_RECORDED = "Not recorded for this checkpoint."


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
    if getattr(config, "selector_top_k", None):
        parts.append(f"{config.conv_kernel_size}-tap grouped dynamic causal convolutions (groups of "
                     f"{config.conv_group_size} channels) around each layer's attention and MLP, and a candidate "
                     f"selector re-scoring the top {config.selector_top_k} tokens of each slot (rank "
                     f"{config.selector_rank})")
    if config.draft_vocab_size:
        parts.append(f"draft vocabulary of the {config.draft_vocab_size} most frequent answer tokens (verification "
                     f"stays exact over all {config.vocab_size} target tokens)")
    return ", ".join(parts) + "."


def eval_results_table(results: dict | str | Path, method: str) -> str:
    """Markdown results of `method` from an `hf-dspark eval` results.json: tau, speed-up and tokens/s per benchmark
    and overall, the hardware and decoding settings, and the command that measured them."""
    if not isinstance(results, dict):
        results = json.loads(Path(results).read_text())
    if method not in results["results"]:
        raise ValueError(f"{method!r} is not in the evaluation results (methods: {results['methods']})")
    measured = results["results"][method]
    rows = ["| benchmark | prompts | tau | speed-up vs plain | tokens/s | slot-1 acceptance | identical to plain greedy |",
            "|---|---|---|---|---|---|---|"]
    for name, numbers in [*measured["by_benchmark"].items(), ("overall", measured["overall"])]:
        slots = numbers.get("acceptance_by_slot") or [None]
        identical = numbers.get("identical_to_plain")
        identical = "-" if identical is None else f"{identical['count']}/{identical['total']}"
        rows.append(
            f"| {name} | {numbers['prompts']} | {numbers.get('tau', '-')} | {numbers.get('speedup', '-')}x | "
            f"{numbers['tokens_per_s']} | {'-' if slots[0] is None else slots[0]} | "
            f"{identical} |"
        )
    settings = results["settings"]
    decoding = "greedy" if settings.get("greedy") else f"T={settings['temperature']}"
    lines = ["\n".join(rows), "",
             f"Hardware: {settings.get('hardware', 'not recorded')}; {settings['dtype']}, {decoding}, at most "
             f"{settings['max_new_tokens']} new tokens, batch 1. tau counts the bonus token."]
    if results.get("command"):
        lines.append(f"Command: `{results['command']}`")
    return "\n".join(lines)


def describe_serving(config) -> str:
    """How the drafter reaches vLLM / SGLang / llama.cpp: DeepSpec's layout, when its layers can be written there
    exactly and those engines implement its heads (the vanilla Markov head, or none: DFlash)."""
    if not getattr(config, "qk_norm", False):
        return ("Serving at scale: DeepSpec's layout, which vLLM, SGLang and llama.cpp load, has Qwen3 layers with "
                "per-head q/k norms; this drafter (for a " + str(config.target_model_type) + " target) has none, so "
                "`hf-dspark convert` refuses to export it rather than change its outputs (a drafter built with "
                "`qk_norm=True` exports). Serve it with transformers (batched: "
                "`hf_dspark.generation.SpeculativeEngine`).")
    if getattr(config, "selector_top_k", None):  # DFlash 2: DeepSpec's layout has none
        return ("Serving at scale: `hf-dspark convert <this folder> <out> --to speculators` writes "
                "vllm-project/speculators' `dflash2` layout (full vocabulary only), and `--to zlab` z-lab's "
                "`DFlash2DraftModel` (for a drafter whose slot j predicts anchor + j, `sample_from_anchor: false`); "
                "DeepSpec's layout has no DFlash 2. With transformers: batched, "
                "`hf_dspark.generation.SpeculativeEngine`.")
    if served_by_vllm(config) and getattr(config, "layer_style", "llama") == "gemma4":
        return ("Serving at scale: `hf-dspark convert <this folder> <out> --target <target>` writes DeepSpec's Gemma 4 "
                "layout (`Gemma4DSparkModel`), which vLLM loads with `--speculative-config '{\"method\": \"dspark\", "
                f"\"model\": \"<out>\", \"num_speculative_tokens\": {config.block_size}}}'`; llama.cpp's converter "
                "has no Gemma 4 DSpark (an open request, llama.cpp#25549) and speculators' layout has no Gemma 4 "
                "layers. With transformers: batched, `hf_dspark.generation.SpeculativeEngine`.")
    if served_by_vllm(config):
        # SGLang's markov_w2 is full-vocabulary: it cannot load a draft vocabulary (see export_warnings).
        sglang = ("SGLang cannot load its draft vocabulary, " if config.draft_vocab_size else
                  "SGLang with `--speculative-algorithm DSPARK --speculative-draft-model-path <out> "
                  f"--speculative-num-draft-tokens {config.block_size + 1}`, ")
        # llama.cpp drafts 3 tokens a round unless told the block size (its --spec-draft-n-max defaults to 3).
        return ("Serving at scale: `hf-dspark convert <this folder> <out> --target <target>` writes DeepSpec's layout, "
                "which vLLM loads with `--speculative-config '{\"method\": \"dspark\", \"model\": \"<out>\", "
                f"\"num_speculative_tokens\": {config.block_size}, \"enable_adaptive_verification\": true}}'`, "
                f"{sglang}and llama.cpp after `convert_hf_to_gguf.py <out> --target-model-dir <target>` "
                f"(`--spec-type draft-dspark --spec-draft-n-max {config.block_size}`).")
    return ("Serving at scale: `hf-dspark convert <this folder> <out> --target <target>` writes DeepSpec's layout "
            "exactly, but vLLM, SGLang and llama.cpp implement only DSpark's vanilla Markov head and DFlash from it, so "
            "this drafter is served with transformers (batched: `hf_dspark.generation.SpeculativeEngine`).")


def render_model_card(*, kind: str, base_model: str, title: str, summary: str, config, commands: list[str],
                      training: str, measured: str, datasets: list[str]) -> str:
    return TEMPLATE.read_text().format(
        base_model=base_model, kind=kind, title=title, summary=summary, config=describe_config(config),
        serving=describe_serving(config),
        commands="\n".join(commands) or "# not recorded", training=training, measured=measured,
        datasets="\n".join(f"  - {d}" for d in datasets) or "  []",
    )


def default_model_card(config, *, base_model: str | None = None, eval_results: dict | str | Path | None = None,
                       eval_method: str | None = None) -> str:
    """A card for a drafter that has none: metadata, config, and the evaluation results when given."""
    if not base_model:
        raise ValueError("a model card needs the target's Hub id as base_model (e.g. base_model='Qwen/Qwen3-8B')")
    kind = drafter_kind(config)
    measured = NOT_RECORDED
    if eval_results is not None:
        measured = eval_results_table(eval_results, eval_method or kind)
    return render_model_card(
        kind=kind, base_model=base_model, title=f"{KIND_NAMES[kind]} drafter for {base_model}",
        summary=f"A {KIND_NAMES[kind]} speculative-decoding drafter for `{base_model}`, made with hf_dspark.",
        config=config, commands=[], training=NOT_RECORDED, measured=measured, datasets=[],
    )


def replace_measured(card: str, table: str) -> str:
    """Swap the `## Measured` section of an existing card for `table` (the section is added if missing)."""
    head, marker, _ = card.partition("\n## Measured\n")
    return f"{head}\n## Measured\n\n{table}\n"
