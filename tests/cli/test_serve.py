"""`hf-dspark serve` through the official `openai` client, on loopback: a tiny random target and drafter served
in-process for most tests (one engine thread, one torch thread), the command line in a subprocess for SIGTERM, and
the embedded SmolLM2 default in the slow lane. Every greedy answer is checked against plain `generate` of the same
prompt on an identical copy of the target."""

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from factories import tiny_drafter, tiny_target  # noqa: E402

from hf_dspark.cli.serve import DEFAULT_MODEL_NAME  # noqa: E402
from hf_dspark.serve import bind_socket, build_state, uvicorn_server  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
MODEL = DEFAULT_MODEL_NAME  # the tiny server answers to the default's name, so the README's client runs against it
KEY = "sk-serve-test"  # the small server's --api-key (the shared one has none, as the README's client expects)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer():
    """One token per printable ASCII character (and newline), ChatML-like specials, a chat template: text in, text
    out, so stop strings land inside and across tokens at will."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_models(tokenizer):
    target = tiny_target("llama", vocab_size=len(tokenizer))
    drafter = tiny_drafter(target)
    # Draft and verify every slot every round (no planner or scheduler learning that a random drafter never pays, and
    # switching to plain steps): every answer goes through speculative verification.
    drafter.generation_config.dspark_round_planning = False
    drafter.generation_config.dspark_verification_policy = "all"
    return target, drafter


@dataclass
class Served:
    url: str
    state: object
    tokenizer: object
    reference: object  # an identical target for plain generate() in the test's own thread

    def client(self):
        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def async_client(self):
        return openai.AsyncOpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def chat_ids(self, content: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
        return list(ids)

    def greedy_ids(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = self.reference.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                          pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    def greedy_text(self, prompt_ids: list[int], max_new_tokens: int) -> str:
        return self.tokenizer.decode(self.greedy_ids(prompt_ids, max_new_tokens), skip_special_tokens=True)

    def wait_idle(self, timeout: float = 30) -> None:
        worker, deadline = self.state.worker, time.monotonic() + timeout
        while worker.num_running or worker.num_waiting:
            assert time.monotonic() < deadline, "the engine did not drain"
            time.sleep(0.01)

    def metrics(self) -> dict:
        text = urllib.request.urlopen(self.url.rsplit("/v1", 1)[0] + "/metrics", timeout=30).read().decode()
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in prometheus_parser.text_string_to_metric_families(text) for sample in family.samples}


def start_in_process(state) -> tuple:
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn_server(state, shutdown_timeout=5, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


def stop_in_process(server, thread) -> None:
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def served():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    target, drafter = tiny_models(tokenizer)
    state = build_state(target, tokenizer, drafter, model_name=MODEL, max_running=64, max_queued=64)
    server, thread, url = start_in_process(state)
    try:
        yield Served(url, state, tokenizer, tiny_target("llama", vocab_size=len(tokenizer)))
    finally:
        stop_in_process(server, thread)
        torch.set_num_threads(threads)


def prompt_text(seed: int, length: int) -> str:
    generator = random.Random(seed)
    return "".join(generator.choice("abcdefghijklmnopqrstuvwxyz .,!?ABC0123") for _ in range(length))


# -- the API ----------------------------------------------------------------------------------------------------------


def test_chat_and_completions_streamed_and_not_equal_plain_greedy(served):
    client, content = served.client(), prompt_text(1, 12)
    expected = served.greedy_text(served.chat_ids(content), 24)
    messages = [{"role": "user", "content": content}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert answer.choices[0].message.content == expected and answer.choices[0].finish_reason == "length"
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(served.chat_ids(content)), 24)
    assert usage.model_extra["drafted_tokens"] >= usage.model_extra["accepted_tokens"] >= 0
    assert usage.completion_tokens_details.accepted_prediction_tokens == usage.model_extra["accepted_tokens"]

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24

    prompt = prompt_text(2, 9)
    expected = served.greedy_text(served.tokenizer(prompt).input_ids, 20)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert completion.choices[0].text == expected and completion.usage.completion_tokens == 20
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "length"
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + expected
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_responses_streamed_and_not_equal_plain_greedy_with_instructions_and_limits(served):
    client, content = served.client(), prompt_text(11, 10)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    ids = list(served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
    expected = served.greedy_text(ids, 20)
    answer = client.responses.create(model=MODEL, input=content, instructions="be brief", max_output_tokens=20,
                                     temperature=0)
    assert answer.output_text == expected and answer.status == "incomplete"
    assert answer.incomplete_details.reason == "max_output_tokens"
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (len(ids), 20)
    assert answer.usage.model_extra["drafted_tokens"] >= answer.usage.model_extra["accepted_tokens"] >= 0
    # The same conversation as input items (text parts, `developer` read as `system`).
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": content}]}]
    assert client.responses.create(model=MODEL, input=items, max_output_tokens=20, temperature=0).output_text == \
        expected

    events = list(client.responses.create(model=MODEL, input=content, instructions="be brief",
                                          max_output_tokens=20, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected and events[-1].response.usage.output_tokens == 20
    # An answer that ends at the end token is completed: the served target given the tokenizer's end token (the tiny
    # one has none) and a prompt whose plain greedy answer reaches it within 24 tokens.
    eos, config = served.tokenizer.eos_token_id, served.state.worker.engine.target.generation_config
    ending, greedy = next((text, ids) for text, ids in ((t, served.greedy_ids(served.chat_ids(t), 24))
                                                        for t in (prompt_text(100 + seed, 6) for seed in range(300)))
                          if eos in ids)
    config.eos_token_id = eos
    try:
        ended = client.responses.create(model=MODEL, input=ending, max_output_tokens=24, temperature=0)
    finally:
        config.eos_token_id = None
    assert ended.status == "completed" and ended.incomplete_details is None
    assert ended.output_text == served.tokenizer.decode(greedy[: greedy.index(eos)], skip_special_tokens=True)

    for body, field in (({"store": True}, "store"), ({"tools": [{"type": "web_search"}]}, "tools"),
                        ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"n": 2}, "n")):
        status, error = raw_post(served.url + "/responses", json.dumps(
            {"model": MODEL, "input": content, **body}).encode())
        assert status == 400 and field in error["error"]["message"], (field, error)
    status, error = raw_post(served.url + "/responses", json.dumps(
        {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}
    ).encode())
    assert status == 400 and "input_image" in error["error"]["message"]
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0).output_text


def test_stop_strings_are_cut_exactly_and_never_leak_across_chunks(served):
    client, prompt = served.client(), prompt_text(3, 10)
    ids = served.greedy_ids(served.tokenizer(prompt).input_ids, 40)
    text = served.tokenizer.decode(ids, skip_special_tokens=True)
    positions = [k for k in range(2, len(text) - 4) if text.find(text[k:k + 3]) == k][:3]
    assert positions, text
    for k in positions:
        stop = text[k:k + 3]
        tokens = next(c for c in range(1, len(ids) + 1)
                      if len(served.tokenizer.decode(ids[:c], skip_special_tokens=True)) >= k + 3)
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                           stop=["\x01never", stop])
        assert answer.choices[0].text == text[:k] and answer.choices[0].finish_reason == "stop"
        assert answer.usage.completion_tokens == tokens
        pieces = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True) if c.choices]
        assert "".join(pieces) == text[:k]  # nothing of the stop string was ever sent, in any chunk
    # A stop string the text only starts at its very end: held back while it might complete, then sent.
    tail_stop = text[-2:] + "\x7f\x7f"
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[tail_stop], stream=True) if c.choices]
    assert "".join(pieces) == text


def test_n_choices_and_seeds_alone_and_under_load(served):
    client, content = served.client(), prompt_text(4, 8)
    messages = [{"role": "user", "content": content}]
    expected = served.greedy_text(served.chat_ids(content), 16)
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.message.content for c in greedy.choices] == [expected] * 3 and greedy.usage.completion_tokens == 48

    def seeded(seed, n=2):
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9,
                                                top_p=0.95, extra_body={"top_k": 50}, seed=seed, n=n)
        return [c.message.content for c in answer.choices]

    alone = seeded(7)
    assert alone == seeded(7) and alone[0] != alone[1] and seeded(8) != alone
    assert seeded(7, n=1) == alone[:1]

    async def under_load():
        async with served.async_client() as aclient:
            noise = [aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt_text(50 + i, 5 + i)}], max_tokens=24,
                temperature=0 if i % 2 else 1.0) for i in range(8)]
            mine = aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9,
                                                   top_p=0.95, extra_body={"top_k": 50}, seed=7, n=2)
            results = await asyncio.gather(mine, *noise)
        return [c.message.content for c in results[0].choices]

    assert asyncio.run(under_load()) == alone
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9,
                                                   top_p=0.95, extra_body={"top_k": 50}, seed=7, n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == alone[index] and mine[-1].finish_reason == "length"


def raw_post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_every_error_path_is_a_4xx_naming_its_cause_and_costs_no_one_else_tokens(served):
    client, content = served.client(), prompt_text(5, 10)
    expected = served.greedy_text(served.chat_ids(content), 60)
    bystander = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                               max_tokens=60, temperature=0, stream=True)
    pieces = [next(bystander).choices[0].delta.content]  # running while the bad requests arrive

    def refused(status: int, named: str, **fields):
        fields.setdefault("messages", [{"role": "user", "content": "hi"}])
        with pytest.raises(openai.APIStatusError) as caught:
            served.client().chat.completions.create(**{"model": MODEL, **fields})
        error = caught.value.body
        assert caught.value.status_code == status, error
        assert named in error["message"] and set(error) == {"message", "type", "param", "code"}, error

    refused(404, "nope", model="nope")
    refused(400, "max_tokens", max_tokens=-1)
    refused(400, "max_tokens", max_tokens=10**9)
    refused(400, "max_completion_tokens", max_completion_tokens=600)
    refused(400, "context length", messages=[{"role": "user", "content": "x" * 600}])
    refused(400, "logprobs", logprobs=True)
    refused(400, "tools", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    refused(400, "response_format", response_format={"type": "json_object"})
    refused(400, "frobnicate", extra_body={"frobnicate": 1})
    refused(400, "top_p", top_p=0)
    refused(400, "'n'", n=0)
    refused(400, "image_url", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    refused(400, "messages", messages=[])
    status, body = raw_post(served.url + "/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = raw_post(served.url + "/completions", json.dumps({"model": MODEL, "prompt": [5, 10**6]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt" and "vocabulary" in body["error"]["message"]
    status, body = raw_post(served.url + "/completions", json.dumps({"model": MODEL, "prompt": "x" * 600}).encode())
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"

    pieces += [c.choices[0].delta.content or "" for c in bystander if c.choices]
    assert "".join(p or "" for p in pieces) == expected
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=60, temperature=0).choices[0].message.content == expected


# -- load, disconnects, metrics ---------------------------------------------------------------------------------------


async def one_client(served, aclient, index: int, leave_after: int | None):
    """A streaming greedy client; with `leave_after`, it disconnects after that many chunks."""
    content, max_tokens = prompt_text(100 + index, 4 + index % 9), 20 + index % 13
    stream = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                   max_tokens=max_tokens, temperature=0, stream=True)
    text, chunks = [], 0
    async for chunk in stream:
        chunks += 1
        if leave_after is not None and chunks >= leave_after:
            await stream.close()
            return None
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
    return content, max_tokens, "".join(text)


def test_32_streams_with_a_third_leaving_match_plain_greedy_and_leave_the_engine_within_a_step(served):
    draw = random.Random(0)

    async def wave(offset: int):
        async with served.async_client() as aclient:
            return await asyncio.gather(*[
                one_client(served, aclient, offset + i, draw.randint(1, 12) if i % 3 == 0 else None)
                for i in range(32)])

    engine, worker = served.state.worker.engine, served.state.worker
    aborts = ("vllm:request_success_total", (("engine", "0"), ("finished_reason", "abort"), ("model_name", MODEL)))
    memory = []
    for offset in (0, 32):  # two waves: nothing of the first stays behind
        left_before = served.metrics()[aborts]
        completed = [r for r in asyncio.run(wave(offset)) if r is not None]
        assert len(completed) >= 21
        for content, max_tokens, text in completed:
            assert text == served.greedy_text(served.chat_ids(content), max_tokens)
        served.wait_idle()
        assert served.metrics()[aborts] > left_before  # clients did leave mid-answer, and their requests were cut
        assert worker.max_cancel_lag_steps <= 1
        assert (engine.num_running, engine.num_waiting, len(engine.stats)) == (0, 0, 0)
        memory.append(resident_bytes())
    assert memory[1] - memory[0] < 64 * 2**20


def test_a_client_leaving_a_non_streamed_request_cancels_it(served):
    served.wait_idle()
    aborts = ("vllm:request_success_total", (("engine", "0"), ("finished_reason", "abort"), ("model_name", MODEL)))
    left_before = served.metrics()[aborts]
    host, port = served.url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 480, "temperature": 0}).encode()
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while not served.state.worker.num_running:  # it runs; then the client leaves
            assert time.monotonic() < deadline
            time.sleep(0.005)
    served.wait_idle()
    assert served.metrics()[aborts] == left_before + 1 and served.state.worker.max_cancel_lag_steps <= 1


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_metrics_parse_and_match_the_responses(served):
    served.wait_idle()
    before, client = served.metrics(), served.client()
    answers = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt_text(200 + i,
                                              6 + i)}], max_tokens=12 + i, temperature=0) for i in range(4)]
    served.wait_idle()
    after = served.metrics()
    labels = (("engine", "0"), ("model_name", MODEL))

    def grew(name: str, extra: tuple = ()) -> float:
        key = (name, tuple(sorted(labels + extra)))
        return after[key] - before.get(key, 0.0)

    drafted = sum(a.usage.model_extra["drafted_tokens"] for a in answers)
    accepted = sum(a.usage.model_extra["accepted_tokens"] for a in answers)
    assert grew("vllm:spec_decode_num_draft_tokens_total") == drafted > 0
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == accepted
    positions = [grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))
                 for p in range(4)]
    assert sum(positions) == accepted and positions == sorted(positions, reverse=True)
    assert 0 < grew("vllm:spec_decode_num_drafts_total") <= drafted
    assert grew("vllm:generation_tokens_total") == sum(a.usage.completion_tokens for a in answers)
    assert grew("vllm:prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert grew("vllm:request_success_total", (("finished_reason", "length"),)) == 4
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert grew(f"vllm:{histogram}_count") == 4
    assert grew("vllm:inter_token_latency_seconds_count") > 0
    assert after[("vllm:num_requests_running", labels)] == 0


def byte_tokenizer():
    """Byte-level BPE without merges: every UTF-8 byte a token, so one character may take up to four tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("stop, text, tokens", [
    (["\U0001F600"], "a\u00e9", 7), (["\u00e9\U0001F600"], "a", 7), (["b c"], "a\u00e9\U0001F600", 10),
    (["zz"], "a\u00e9\U0001F600b c", 10), (["c", "\U0001F600b"], "a\u00e9", 8)])
def test_stop_strings_inside_multibyte_characters_are_cut_at_the_token_that_completes_them(stop, text, tokens):
    from hf_dspark.serve.text import ChoiceText

    tokenizer = byte_tokenizer()
    ids = tokenizer("a\u00e9\U0001F600b c").input_ids
    assert len(ids) == 10
    choice = ChoiceText(tokenizer, stop)
    pieces = [choice.feed([token]) for token in ids] + [choice.finish()]
    assert "".join(pieces) == choice.full_text() == text and choice.completion_tokens == tokens
    assert all(REPLACEMENT not in piece for piece in pieces)  # no half character is ever sent
    assert choice.stopped == (stop != ["zz"])


REPLACEMENT = "\ufffd"


def test_speculative_metrics_count_as_vllm_does():
    from hf_dspark.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m", draft_positions=4)
    metrics.rounds([4, 3, 0, 2], [2, 3, 0, 0])  # a plain round (no drafts) is no draft
    values = {(s.name, s.labels.get("position")): s.value for family in metrics.registry.collect()
              for s in family.samples}
    assert values[("vllm:spec_decode_num_drafts_total", None)] == 3
    assert values[("vllm:spec_decode_num_draft_tokens_total", None)] == 9
    assert values[("vllm:spec_decode_num_accepted_tokens_total", None)] == 5
    assert [values[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(4)] == [2, 2, 1, 0]


def test_a_wrong_api_key_is_401_and_past_max_queued_is_429_with_retry_after():
    tokenizer = char_tokenizer()
    target, drafter = tiny_models(tokenizer)
    state = build_state(target, tokenizer, drafter, model_name=MODEL, max_running=1, max_queued=1, api_key=KEY)
    server, thread, url = start_in_process(state)
    try:
        with pytest.raises(openai.AuthenticationError) as caught:
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert "API key" in caught.value.body["message"] and caught.value.body["code"] == "invalid_api_key"
        with pytest.raises(urllib.error.HTTPError) as no_key:
            urllib.request.urlopen(url + "/models", timeout=30)
        assert no_key.value.code == 401
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        assert client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0).usage.total_tokens == 6
        streams = []
        for _ in range(2):  # one running, one queued behind it
            streams.append(client.completions.create(model=MODEL, prompt="abc", max_tokens=400, temperature=0,
                                                     stream=True))
        next(streams[0])
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0)
        assert caught.value.response.headers["retry-after"] == "1" and "--max-queued" in caught.value.body["message"]
        for stream in streams:
            stream.close()
    finally:
        stop_in_process(server, thread)


def test_the_readme_client_snippet_runs_as_written(served):
    section = README.read_text().split("## OpenAI-compatible server", 1)[1].split("\n## ", 1)[0]
    assert "hf-dspark serve" in re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    port = served.url.split(":")[-1].split("/")[0]
    assert "localhost:8000" in snippet or "127.0.0.1:8000" in snippet
    done = subprocess.run([sys.executable, "-c", snippet.replace(":8000", f":{port}")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()


# -- the command line: SIGTERM -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_cli(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(README.parent)}
    return subprocess.Popen([sys.executable, "-m", "hf_dspark", "serve", "--port", str(port), "--threads", "1",
                             "--log-level", "warning", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def wait_healthy(process: subprocess.Popen, port: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


def test_sigterm_with_requests_in_flight_finishes_them_and_exits_0(tmp_path):
    tokenizer = char_tokenizer()
    target, drafter = tiny_models(tokenizer)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    port = free_port()
    process = start_cli(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                         "--no-schedule", "--served-model-name", MODEL, "--shutdown-timeout", "60"], port)
    try:
        wait_healthy(process, port)
        busy = start_cli(["--target", str(tmp_path / "target"), "--drafter", "none"], port)  # the same port
        assert busy.wait(120) == 2 and "cannot listen" in busy.communicate()[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        streams = [client.completions.create(model=MODEL, prompt=prompt_text(i, 6), max_tokens=120, temperature=0,
                                             stream=True) for i in range(3)]
        first = [next(stream) for stream in streams]  # all three are running
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(OSError):  # no longer accepting: the listening socket is closed (or 503 while it closes)
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        for stream, chunk in zip(streams, first):
            chunks = [chunk, *stream]
            assert chunks[-1].choices[0].finish_reason == "length"
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()


# -- the embedded default -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_default_serve_command_serves_smollm2_losslessly(tmp_path):
    from hf_dspark.targets.default_target import load_default_target

    port = free_port()
    process = start_cli([], port)
    try:
        wait_healthy(process, port, timeout=900)
        target, tokenizer = load_default_target(dtype=torch.float32)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "Name three primary colours."}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="pt")["input_ids"]
        with torch.no_grad():
            plain = target.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert answer.choices[0].message.content == tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()
