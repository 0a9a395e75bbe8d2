"""The real HTTP server on loopback: concurrent clients, streaming, disconnects, bad input."""

import http.client
import json
import socket
import threading
import time

import pytest

from serving.engine import Engine
from serving.server import ByteTokenizer, HFTokenizer, NoTokenizer, load_tokenizer, serve


@pytest.fixture(scope="module")
def server():
    engine = Engine(max_slots=4, max_len=256, prefill_chunk=32, prefix_cache=True, hash_tokens=64)
    srv, loop = serve(engine, ByteTokenizer(), port=0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], engine, loop
    loop.stop = True
    srv.shutdown()


def post(port, body, raw=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", body=raw if raw is not None else json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data) if data.startswith(b"{") else data


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read().decode()


def test_concurrent_clients_and_streaming(server):
    port, engine, _ = server
    prompts = ["Hello, KDA!", "The state is a matrix", [5, 6, 7, 8, 9], "x" * 100]
    single = [post(port, {"prompt": p, "max_tokens": 6})[1]["choices"][0]["token_ids"] for p in prompts]
    results = [None] * len(prompts)

    def client(i):
        results[i] = post(port, {"prompt": prompts[i], "max_tokens": 6})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (status, body), want in zip(results, single):
        assert status == 200 and body["choices"][0]["token_ids"] == want
        assert body["usage"]["completion_tokens"] == 6
    # Streaming yields the same tokens, one event each, then [DONE].
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompts[0], "max_tokens": 6, "stream": True}))
    events = [line[6:] for line in c.getresponse().read().decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    toks = [t for e in events[:-1] for t in json.loads(e)["choices"][0].get("token_ids", [])]
    assert toks == single[0]


@pytest.mark.parametrize("body,raw", [
    ({"prompt": ""}, None),
    ({"prompt": [1, 2, 300]}, None),
    ({"prompt": "hi", "temperature": -1}, None),
    ({"prompt": "hi", "top_p": 2}, None),
    ({"prompt": "hi", "max_tokens": "many"}, None),
    ({"prompt": "x" * 300}, None),
    ({"prompt": {"a": 1}}, None),
    (None, b"{not json"),
])
def test_bad_input_gets_400_and_the_loop_survives(server, body, raw):
    port, _, loop = server
    status, resp = post(port, body, raw)
    assert status == 400 and resp["error"]["message"]
    assert post(port, {"prompt": "ok", "max_tokens": 2})[0] == 200
    assert get(port, "/health")[0] == 200


def test_disconnect_frees_the_request(server):
    port, engine, _ = server
    s = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"prompt": "stream me", "max_tokens": 150, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    s.recv(200)  # headers and the first event arrived
    s.close()
    deadline = time.time() + 60
    while time.time() < deadline and (engine.running or engine.waiting or len(engine.free_slots) < engine.max_slots):
        time.sleep(0.05)
    assert not engine.running and not engine.waiting
    assert engine.metrics["requests_aborted"] == 1
    assert len(engine.free_slots) == engine.max_slots
    engine.cache.check_invariants()
    assert all(engine.pool.refcount[p] == 0 for p in range(engine.pool.num_pages))


def test_health_and_metrics(server):
    port, _, _ = server
    assert get(port, "/health") == (200, json.dumps({"status": "ok"}))
    status, text = get(port, "/metrics")
    assert status == 200 and "k3jax_requests_total" in text and "k3jax_cache_hit_tokens_total" in text
    assert get(port, "/nope")[0] == 404


def test_checkpoint_tokenizer_path(tmp_path):
    """A checkpoint directory's tokenizer.json is used for text prompts and outputs; without one,
    text prompts get a 400 that says to send token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    corpus = ["the state is a matrix", "hello kda world", "delta rule with a gate", "the matrix state decays"]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    (tmp_path / "ckpt").mkdir()
    tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    hf = load_tokenizer(str(tmp_path / "ckpt"))
    assert isinstance(hf, HFTokenizer) and isinstance(load_tokenizer(str(tmp_path)), NoTokenizer)
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)

    # Same engine shapes as the module fixture, so the compiled functions are reused.
    engine = Engine(max_slots=4, max_len=256, prefill_chunk=32, prefix_cache=True, hash_tokens=64)
    for tokenizer in (hf, NoTokenizer()):
        srv, loop = serve(engine, tokenizer, port=0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        port = srv.server_address[1]
        try:
            status, body = post(port, {"prompt": "the state decays", "max_tokens": 4})
            if tokenizer is hf:
                assert status == 200, body
                choice = body["choices"][0]
                assert body["usage"]["prompt_tokens"] == len(hf.encode("the state decays"))
                assert choice["text"] == hf.decode(choice["token_ids"]) and len(choice["token_ids"]) == 4
            else:
                assert status == 400 and "token ids" in body["error"]["message"]
            status, body = post(port, {"prompt": [5, 6, 7], "max_tokens": 2})
            assert status == 200 and len(body["choices"][0]["token_ids"]) == 2
        finally:
            loop.stop = True
            srv.shutdown()
