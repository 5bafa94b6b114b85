"""`flexmarl serve` against the real `openai` client on loopback: models, chat, completions,
streaming, logprobs, stop, sampling options, limits and clear 4xx errors."""

from __future__ import annotations

import openai
import pytest

from flexmarl.rollout.engine import generate
from flexmarl.types import GenerationRequest
from tests.serving.conftest import post

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]


def test_models_list_names_every_agent(server):
    models = server.client().models.list().data
    assert {m.id for m in models} == {"speaker", "listener"}
    cards = {m.id: m.model_extra for m in models}
    assert cards["listener"]["chat"] is True and cards["speaker"]["tokenizer"] is False
    assert server.client().models.retrieve("speaker").id == "speaker"


def test_chat_completion_through_the_chat_template(server):
    out = server.client().chat.completions.create(model="listener", messages=HELLO,
                                                  max_tokens=10, seed=1)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    tok = server.service.run.agents["listener"].tokenizer
    prompt = tok.encode(tok.apply_chat_template(HELLO, add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)
    assert out.usage.prompt_tokens == len(prompt)
    assert 1 <= out.usage.completion_tokens <= 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.system_fingerprint == "listener-v1"
    assert out.model_extra["flexmarl"]["version"] == 1


def test_text_completion_and_token_id_completion(server):
    client = server.client()
    text = client.completions.create(model="listener", prompt="The speaker sees", max_tokens=6,
                                     seed=2)
    assert isinstance(text.choices[0].text, str) and text.usage.prompt_tokens > 0
    ids = client.completions.create(model="speaker", prompt=[1, 3, 2, 8], max_tokens=1,
                                    seed=2, logprobs=0)
    (tok,) = ids.choices[0].model_extra["token_ids"]
    assert ids.choices[0].text == str(tok)
    assert ids.choices[0].logprobs.tokens == [f"token_id:{tok}"]
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 1


def test_token_ids_and_logprobs_match_the_engine(server):
    """Served tokens and log-probs are the engine's: the same request decoded by the model
    directly (same seed) gives the same tokens and log-probs."""
    out = server.client().completions.create(
        model="listener", prompt=[5, 9, 40, 41], max_tokens=8, seed=11, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True})
    served = out.choices[0].model_extra["token_ids"]
    model = server.service.run.agents["listener"].model
    (ref,) = generate(model, [GenerationRequest("r", "listener", 0, [5, 9, 40, 41], 8,
                                                noise_seed=11)])
    assert served == ref.tokens
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert all(lp <= 0 for lp in out.choices[0].logprobs.token_logprobs)


def test_chat_logprobs_one_per_token(server):
    out = server.client().chat.completions.create(model="listener", messages=HELLO,
                                                  max_tokens=8, seed=4, logprobs=True)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(c.logprob <= 0 for c in content)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_streaming_chunks_join_to_the_full_text(server, api):
    client = server.client()
    kw = dict(model="listener", max_tokens=16, seed=5)
    if api == "chat":
        full = client.chat.completions.create(messages=HELLO, **kw)
        stream = client.chat.completions.create(messages=HELLO, stream=True,
                                                stream_options={"include_usage": True}, **kw)
        expected = full.choices[0].message.content
    else:
        full = client.completions.create(prompt="The listener reads", **kw)
        stream = client.completions.create(prompt="The listener reads", stream=True,
                                           stream_options={"include_usage": True}, **kw)
        expected = full.choices[0].text
    parts, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        chunks += 1
        c = chunk.choices[0]
        parts.append((c.delta.content or "") if api == "chat" else c.text)
        finish = c.finish_reason or finish
    assert chunks >= 2
    assert "".join(parts) == expected
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_stop_string_cuts_the_text(server):
    client = server.client()
    base = client.completions.create(model="listener", prompt="One two", max_tokens=24,
                                     seed=6, temperature=0.7)
    text = base.choices[0].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2)
                 if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i), None)
    assert stop is not None, text
    cut = client.completions.create(model="listener", prompt="One two", max_tokens=24, seed=6,
                                    temperature=0.7, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < base.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="listener", prompt="One two", max_tokens=24, seed=6, temperature=0.7,
        stop=stop, stream=True) if c.choices)
    assert streamed == cut.choices[0].text


def test_greedy_and_top_p(server):
    client = server.client()
    greedy = [client.completions.create(model="listener", prompt="Hello", max_tokens=8,
                                        temperature=0, seed=s).choices[0].text for s in (1, 2)]
    assert greedy[0] == greedy[1]  # temperature 0: the seed does not matter
    nucleus = client.completions.create(model="listener", prompt="Hello", max_tokens=8,
                                        top_p=1e-6, seed=3).choices[0].text
    assert nucleus == greedy[0]  # a tiny nucleus keeps only the most likely token


def _error(fn):
    with pytest.raises(openai.APIStatusError) as info:
        fn()
    return info.value


def test_invalid_requests_get_clear_4xx(server):
    client = server.client()
    e = _error(lambda: client.chat.completions.create(model="speaker", messages=HELLO))
    assert e.status_code == 400 and "speaker" in e.message and "token ids" in e.message
    e = _error(lambda: client.completions.create(model="speaker", prompt="hi"))
    assert e.status_code == 400 and "no tokenizer" in e.message
    e = _error(lambda: client.completions.create(model="nobody", prompt="hi"))
    assert e.status_code == 404 and "speaker" in e.message
    e = _error(lambda: client.completions.create(model="listener", prompt="hi",
                                                 max_tokens=100000))
    assert e.status_code == 400 and "--max-tokens" in e.message
    e = _error(lambda: client.completions.create(model="listener", prompt="hi", max_tokens=300))
    assert e.status_code == 400 and "context" in e.message
    e = _error(lambda: client.completions.create(model="listener", prompt="hi", n=2))
    assert e.status_code == 400 and e.body["param"] == "n"
    e = _error(lambda: client.completions.create(model="listener", prompt="hi", temperature=5))
    assert e.status_code == 400 and "temperature" in e.message
    e = _error(lambda: client.completions.create(model="speaker", prompt=[1, 999]))
    assert e.status_code == 400 and "token ids" in e.message
    e = _error(lambda: client.chat.completions.create(model="listener", messages=[]))
    assert e.status_code == 400 and "messages" in e.message


def test_body_size_and_json_errors(server, toy_run):
    from flexmarl.serving.protocol import Limits
    from tests.serving.conftest import start

    # a small limit, so the whole body is in the socket before the early 413 comes back
    small = start(toy_run, limits=Limits(max_body_bytes=1024))
    try:
        status, body = post(f"{small.url}/completions", data=b"x" * 4096)
        assert status == 413 and "--max-body-bytes" in body["error"]["message"]
    finally:
        small.close()
    status, body = post(f"{server.url}/completions", data=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]


def test_episode_endpoint_runs_the_graph(server):
    status, ep = post(f"{server.url}/episodes", {"seed": 3})
    assert status == 200
    assert list(ep["nodes"]) == ["speak", "listen"]
    speak, listen = ep["nodes"]["speak"], ep["nodes"]["listen"]
    assert len(speak["output"]) == 1 and listen["prompt"][-1] == speak["output"][0]
    assert listen["output"][0] in ep["input"]["candidates"]  # the node's action mask held
    assert ep["reward"] in (0.0, 1.0) and ep["success"] == (ep["reward"] == 1.0)
    assert speak["version"] == 1 and listen["version"] == 1
    given = {"target": 8, "candidates": [6, 7, 8, 9]}
    _, ep = post(f"{server.url}/episodes", {"input": given})
    assert ep["input"] == given and ep["success"] == (ep["nodes"]["listen"]["output"] == [8])
    status, bad = post(f"{server.url}/episodes", {"input": {"oops": 1}})
    assert status == 400 and "speak" in bad["error"]["message"]


def test_the_projects_openai_backend_samples_what_a_local_replica_samples(server):
    """`flexmarl serve` is a drop-in endpoint for `backend.kind: openai` (token ids, the
    vLLM extensions allowed_token_ids / stop_token_ids, the noise seed)."""
    import asyncio

    from flexmarl.config.schema import BackendConfig
    from flexmarl.rollout.backends.openai import OpenAIBackend

    backend = OpenAIBackend("speaker", BackendConfig(kind="openai",
                                                     url=server.url.removesuffix("/v1")))
    reqs = [GenerationRequest(f"0-{i}_0_0", "speaker", 0, [1, 3, 2, 6 + i], 3,
                              allowed_tokens=list(range(14, 22)), seed=0) for i in range(4)]

    async def go():
        return await asyncio.gather(*(backend.generate(r) for r in reqs))

    try:
        remote = asyncio.run(go())
    finally:
        backend.close()
    model = server.service.run.agents["speaker"].model
    for req, res in zip(reqs, remote, strict=True):
        local = generate(model, [req])[0]
        assert res.tokens == local.tokens and set(res.tokens) <= set(req.allowed_tokens)
        assert res.logprobs == pytest.approx(local.logprobs, abs=1e-4)


def test_a_client_leaving_mid_stream_frees_its_slot(server, monkeypatch):
    import time

    worker = server.service.workers["listener"]
    cancelled = []
    cancel = worker.cancel
    monkeypatch.setattr(worker, "cancel", lambda sid: (cancelled.append(sid), cancel(sid)))
    stream = server.client().completions.create(
        model="listener", prompt=[5, 9], stream=True, max_tokens=250, seed=9,
        extra_body={"return_tokens_as_token_ids": True})  # no EOS: only the client ends it
    next(iter(stream))
    stream.close()
    deadline = time.time() + 20
    while worker.pending:
        assert time.time() < deadline, "the abandoned request kept decoding"
        time.sleep(0.05)
    assert len(cancelled) == 1  # the server told the engine, rather than decoding to the end
