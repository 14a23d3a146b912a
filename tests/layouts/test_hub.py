"""Saved drafter folders work with stock `transformers` alone (auto_map + custom_generate), model cards, push."""

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard

import hf_dspark
from hf_dspark.cli.main import main
from hf_dspark.hub.model_card import default_model_card, eval_results_table
from hf_dspark.hub.push import push_drafter, stage_drafter
from factories import tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = hf_dspark.shipped_drafter_path("dspark")
EVAL_RESULTS = ROOT / "benchmarks" / "eval" / "results.json"  # the latest `hf-dspark eval` (benchmarks/README.md)

# Runs in a fresh interpreter where `import hf_dspark` fails: only transformers' remote-code loading can help.
WITHOUT_HF_DSPARK = textwrap.dedent("""
    import json, sys
    sys.modules["hf_dspark"] = None
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    drafter_dir, target_dir, ids, new_tokens, sample = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True, dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.tensor([ids])
    plain = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    torch.manual_seed(0)
    # Every round drafts (no round planning, which would price rounds by this machine's timings): the drafts
    # accepted are the drafter's, whatever the machine.
    spec = target.generate(ids, assistant_model=drafter, custom_generate=drafter_dir, trust_remote_code=True,
                           max_new_tokens=new_tokens, do_sample=sample, top_k=0, dspark_round_planning=False)
    stats = drafter.last_generation_stats

    class Recorder:  # a streamer: generate() puts the prompt, the decoding loop the new tokens, then end()
        def __init__(self):
            self.tokens, self.ended = [], False
        def put(self, value):
            self.tokens += value.flatten().tolist()
        def end(self):
            self.ended = True

    recorder = Recorder()
    target.generate(ids, assistant_model=drafter, custom_generate=drafter_dir, trust_remote_code=True,
                    max_new_tokens=new_tokens, do_sample=False, streamer=recorder)
    print(json.dumps({"module": type(drafter).__module__, "plain": plain[0].tolist(), "spec": spec[0].tolist(),
                      "rounds": len(stats.draft_lengths), "accepted": sum(stats.accepted),
                      "streamed": recorder.tokens, "stream_ended": recorder.ended}))
""")


def run_without_hf_dspark(tmp_path, drafter_dir, target_dir, ids, new_tokens, sample=False, env=None):
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1", **(env or {}))
    result = subprocess.run([sys.executable, "-c", WITHOUT_HF_DSPARK, str(drafter_dir), str(target_dir),
                             json.dumps(ids), str(new_tokens), "1" if sample else "0"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    target = tiny_target("llama")
    target.save_pretrained(folder / "target")
    for kind in ("markov", "eagle3", "dflash2"):
        tiny_drafter(target, kind, block_size=4).save_pretrained(folder / kind)
    return folder, target


def test_saved_folder_carries_auto_map_modeling_code_and_custom_generate(saved):
    folder, _ = saved
    config = json.loads((folder / "markov" / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_dspark.DSparkDraftConfig",
                                  "AutoModel": "modeling_dspark.DSparkDraftModel"}
    for name in ("modeling_dspark.py", "configuration_dspark.py", "drafter_base.py", "model.safetensors"):
        assert (folder / "markov" / name).is_file()
    custom = folder / "markov" / "custom_generate"
    for name in ("generate.py", "dispatch.py", "loop.py", "verification.py", "requirements.txt"):
        assert (custom / name).is_file()
    # The lossless rule is shipped verbatim, never a hand-written second copy.
    verification = (ROOT / "hf_dspark" / "generation" / "round" / "verification.py").read_text()
    assert (custom / "verification.py").read_text() == verification
    for module in custom.glob("*.py"):
        assert "from .." not in module.read_text()  # flattened: transformers loads remote code as one folder
    eagle = json.loads((folder / "eagle3" / "config.json").read_text())
    assert eagle["auto_map"]["AutoModel"] == "modeling_eagle3.Eagle3DraftModel"


@pytest.mark.parametrize("kind", ["markov", "eagle3", "dflash2"])
def test_stock_transformers_loads_and_generates_without_hf_dspark(saved, tmp_path, kind):
    folder, _ = saved
    result = run_without_hf_dspark(tmp_path, folder / kind, folder / "target", [5, 9, 17, 3, 44, 61], 24)
    assert result["module"].startswith("transformers_modules.")  # our code, loaded as remote code
    assert result["spec"] == result["plain"]
    assert result["rounds"] > 0  # the speculative loop ran (it is not plain decoding under another name)
    assert result["streamed"] == result["plain"] and result["stream_ended"]


def test_a_hub_repo_id_loads_and_generates_without_hf_dspark(saved, tmp_path):
    """The repo-id branch of transformers' remote-code loading (per-file downloads into the Hub cache, relative
    imports resolved file by file), offline: the saved folder is laid out as a cached snapshot of `org/dspark-tiny`."""
    import shutil

    folder, _ = saved
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--dspark-tiny"
    shutil.copytree(folder / "markov", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    result = run_without_hf_dspark(tmp_path, "org/dspark-tiny", folder / "target", [5, 9, 17, 3, 44, 61], 16,
                                   env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert result["module"].startswith("transformers_modules.")
    assert result["spec"] == result["plain"] and result["rounds"] > 0


def test_custom_generate_samples_exactly_like_hf_dspark(saved, tmp_path):
    """Same seed, same code: the remote copy draws the very tokens hf_dspark's own loop draws."""
    folder, target = saved
    drafter = hf_dspark.DSparkDraftModel.from_pretrained(folder / "markov")
    # Flat prices (no table, nothing timed): both processes plan the same rounds, so they draw the same randomness.
    drafter.generation_config.dspark_learn_round_costs = False
    drafter.save_pretrained(tmp_path / "flat")
    ids = [7, 11, 13, 2, 40]
    torch.manual_seed(0)
    ours = target.generate(torch.tensor([ids]), assistant_model=drafter, max_new_tokens=20, do_sample=True, top_k=0,
                           dspark_round_planning=False)  # as the remote run: every round drafts
    remote = run_without_hf_dspark(tmp_path, tmp_path / "flat", folder / "target", ids, 20, sample=True)
    assert remote["spec"] == ours[0].tolist()


def test_shipped_folders_hold_no_code():
    """The shipped drafters are config, weights, card, training log and stages: save_pretrained writes the code."""
    for kind in ("dspark", "dflash", "eagle3"):
        folder = hf_dspark.shipped_drafter_path(kind)
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            ["config.json", "model.safetensors", "README.md", "training_log.jsonl", "training_summary.json",
             "training_stages.json"])
        assert "auto_map" not in json.loads((folder / "config.json").read_text())


@pytest.mark.slow  # the real SmolLM2 target
def test_shipped_drafter_runs_on_stock_transformers(tmp_path):
    """The real default target and the shipped DSpark drafter, saved by hf_dspark and then run with hf_dspark
    absent: accepted drafts, same text."""
    from transformers import AutoTokenizer

    saved = tmp_path / "saved-dspark"
    hf_dspark.DSparkDraftModel.from_pretrained(SHIPPED).save_pretrained(saved)
    assert (saved / "modeling_dspark.py").is_file() and (saved / "custom_generate" / "generate.py").is_file()
    target_dir = hf_dspark.default_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 times 12?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    result = run_without_hf_dspark(tmp_path, saved, target_dir, list(ids), 40)
    assert result["spec"] == result["plain"]
    assert result["accepted"] > 0


def _front_matter(card_text: str) -> dict:
    return ModelCard(card_text).data.to_dict()


def test_model_cards_have_valid_metadata_and_results(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, "markov")
    card = default_model_card(drafter.config, base_model="Qwen/Qwen3-8B", eval_results=EVAL_RESULTS,
                              eval_method="dspark")
    meta = _front_matter(card)
    assert meta["base_model"] == "Qwen/Qwen3-8B" and meta["library_name"] == "transformers"
    assert {"speculative-decoding", "dspark"} <= set(meta["tags"])
    results = json.loads(EVAL_RESULTS.read_text())
    for benchmark, numbers in results["results"]["dspark"]["by_benchmark"].items():
        assert f"| {benchmark} | {numbers['prompts']} | {numbers['tau']} | {numbers['speedup']}x |" in card
    assert results["command"] in card and "Hardware:" in card
    for kind in ("dspark", "dflash", "eagle3"):
        shipped = _front_matter((hf_dspark.shipped_drafter_path(kind) / "README.md").read_text())
        assert shipped["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and kind in shipped["tags"]
    with pytest.raises(ValueError, match="base_model"):
        default_model_card(drafter.config)
    with pytest.raises(ValueError, match="not in the evaluation results"):
        eval_results_table(EVAL_RESULTS, "medusa")


def test_push_uploads_the_staged_folder(monkeypatch, saved):
    """The network is isolated: create_repo/upload_folder record what a Hub server would receive."""
    folder, _ = saved
    received = {}

    def create_repo(self, repo_id, **kwargs):
        received["endpoint"] = self.endpoint
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        received["repo_id"] = repo_id
        received["files"] = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        received["card"] = (Path(folder_path) / "README.md").read_text()
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.invalid")
    drafter = hf_dspark.DSparkDraftModel.from_pretrained(folder / "markov")
    assert drafter.push_to_hub("org/dspark-tiny", base_model="org/tiny-llama") == "commit"
    assert received["endpoint"] == "http://hub.invalid" and received["repo_id"] == "org/dspark-tiny"
    for name in ("README.md", "config.json", "model.safetensors", "modeling_dspark.py", "custom_generate/generate.py"):
        assert name in received["files"]
    assert _front_matter(received["card"])["base_model"] == "org/tiny-llama"


def test_push_cli_dry_run_keeps_the_shipped_card_and_fills_results(tmp_path):
    out = tmp_path / "staged"
    assert main(["push", str(SHIPPED), "org/dspark-smollm2", "--dry-run", str(out), "--eval", str(EVAL_RESULTS)]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith((SHIPPED / "README.md").read_text().split("## Measured")[0])
    overall = json.loads(EVAL_RESULTS.read_text())["results"]["dspark"]["overall"]
    assert f"| overall | {overall['prompts']} |" in card
    reloaded = hf_dspark.DSparkDraftModel.from_pretrained(out)
    assert reloaded.config.to_dict()["draft_vocab_size"] == 8192
    # The shipped folder holds no code; what gets pushed does (written at save time).
    for name in ("modeling_dspark.py", "configuration_dspark.py", "drafter_base.py", "custom_generate/generate.py",
                 "custom_generate/verification.py"):
        assert (out / name).is_file(), name
    assert "auto_map" in json.loads((out / "config.json").read_text())


def _reachable(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(f"{endpoint.rstrip('/')}/api/whoami-v2", timeout=5)
    except urllib.error.HTTPError:
        return True  # a server answered (401 without a token is still an answer)
    except OSError:
        return False
    return True


@pytest.mark.skipif(not os.environ.get("HF_ENDPOINT") or not os.environ.get("HF_TOKEN"),
                    reason="real upload needs HF_ENDPOINT and HF_TOKEN pointing at a Hub server (none configured)")
def test_push_to_a_real_hub_server(saved):
    if not _reachable(os.environ["HF_ENDPOINT"]):
        pytest.skip(f"HF_ENDPOINT={os.environ['HF_ENDPOINT']} is not reachable")
    folder, _ = saved
    drafter = hf_dspark.DSparkDraftModel.from_pretrained(folder / "markov")
    repo_id = f"{HfApi().whoami()['name']}/hf-dspark-test-{os.getpid()}"
    push_drafter(drafter, repo_id, base_model="org/tiny-llama", private=True)
    files = HfApi().list_repo_files(repo_id)
    assert "custom_generate/generate.py" in files and "README.md" in files
    HfApi().delete_repo(repo_id)


def test_stage_drafter_writes_loadable_folder(saved, tmp_path):
    folder, target = saved
    drafter = hf_dspark.DSparkDraftModel.from_pretrained(folder / "markov")
    staged = stage_drafter(drafter, tmp_path / "s", base_model="org/tiny-llama")
    again = hf_dspark.DSparkDraftModel.from_pretrained(staged)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name])
