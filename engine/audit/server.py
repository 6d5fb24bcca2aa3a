"""This project's engine behind an OpenAI-compatible completions API (`python -m engine serve`), so that an
audit, the watch page or any client can talk to it as to vLLM: `POST /v1/completions` (prompt as text or
token ids, max_tokens, temperature, top_k, top_p, n, seed, return_token_ids), `GET /v1/models` and `GET
/metrics` (speculative counters under vLLM's names, which `engine.watch` reads).

Each completion is one SpeculativeEngine run with seed + i for the i-th of n (vLLM's rule), one at a time
(the two cores are the engine's). `fault` serves a known-wrong verify (engine.faults) for sampled requests:
an audit must catch it. Loopback only unless the operator binds another address.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from engine.config import SpecConfig
from engine.faults import Fault
from engine.pair import ModelPair
from engine.prompts import PromptError, encode_prompt
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeEngine

MAX_BODY_BYTES = 2**20
MAX_N = 512
MAX_TOKENS = 256


class RequestError(ValueError):
    """A request the server refuses (HTTP 400); the message says why."""


class EngineService:
    """Completions from one pair with one speculative configuration (drafter, K, mode); each request brings
    its own sampling settings, length and seed."""

    def __init__(self, pair: ModelPair, config: SpecConfig, name: str, fault: Fault | None = None) -> None:
        self.pair, self.config, self.name, self.fault = pair, config, name, fault
        self._lock = threading.Lock()
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "generated": 0}
        self.per_position: list[int] = []
        self.started = int(time.time())

    def complete(self, body: object) -> dict:
        request = _checked(body, self.name, self.pair.target.vocab_size)
        prompt = request["prompt"]
        if isinstance(prompt, str):
            try:
                prompt = encode_prompt(self.pair.target.tokenizer, prompt)
            except PromptError as exc:
                raise RequestError(str(exc)) from None
        params, n = request["sampling"], request["n"]
        seed = request["seed"] if request["seed"] is not None else int.from_bytes(os.urandom(7), "little")
        choices = []
        with self._lock:
            for i in range(n):
                config = replace(self.config, sampling=params, seed=(seed + i) % 2**63,
                                 max_new_tokens=request["max_tokens"], record=False)
                try:
                    engine = SpeculativeEngine(self.pair, prompt, config,
                                               fault=None if params.greedy else self.fault)
                except (PromptError, ValueError) as exc:
                    raise RequestError(str(exc)) from None
                try:
                    rounds = engine.run()
                finally:
                    engine.close()
                self._count(rounds)
                ids = engine.generated
                finish = "stop" if ids and ids[-1] == engine.sequence.eos_id else "length"
                choice = {"index": i, "text": self.pair.target.tokenizer.decode(ids, skip_special_tokens=True),
                          "finish_reason": finish, "logprobs": None}
                if request["return_token_ids"]:
                    choice["token_ids"] = list(ids)
                choices.append(choice)
        generated = sum(len(c.get("token_ids", ())) for c in choices)
        return {"id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated,
                          "total_tokens": len(prompt) + generated}}

    def _count(self, rounds) -> None:
        for r in rounds:
            drafted = r.k
            self.counters["generated"] += len(r.emitted)
            if not drafted or r.tree is not None:
                continue
            accepted = r.accepted
            self.counters["drafts"] += 1
            self.counters["draft_tokens"] += drafted
            self.counters["accepted"] += accepted
            self.per_position += [0] * max(0, drafted - len(self.per_position))
            for i in range(accepted):
                self.per_position[i] += 1

    def metrics(self) -> str:
        label = f'model_name="{self.name}"'
        c = self.counters
        lines = [f"vllm:spec_decode_num_drafts_total{{{label}}} {c['drafts']}",
                 f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {c['draft_tokens']}",
                 f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {c['accepted']}",
                 f"vllm:generation_tokens_total{{{label}}} {c['generated']}"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}} {v}'
                  for i, v in enumerate(self.per_position)]
        return "\n".join(lines) + "\n"


def _checked(body: object, name: str, vocab: int) -> dict:
    """The request's fields, checked, with one sentence for the first that is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    if body.get("stream"):
        raise RequestError("streaming is not served: send stream=false")
    if body.get("model") not in (None, name):
        raise RequestError(f"this server serves {name!r}, not {body.get('model')!r}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # OpenAI's batch form with one prompt
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise RequestError(f"a token-id prompt must be a non-empty list of ids in [0, {vocab})")
    elif not isinstance(prompt, str):
        raise RequestError("prompt must be a string or a list of token ids")

    def integer(key: str, default: int | None, low: int, high: int) -> int | None:
        value = body.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise RequestError(f"{key} must be an integer from {low} to {high}, got {value!r}")
        return value

    top_k = integer("top_k", 0, -1, vocab)
    try:
        params = SamplingParams(float(body.get("temperature", 1.0)), max(top_k or 0, 0), float(body.get("top_p", 1.0)))
    except (TypeError, ValueError) as exc:
        raise RequestError(str(exc)) from None
    return {"prompt": prompt, "sampling": params, "n": integer("n", 1, 1, MAX_N),
            "max_tokens": integer("max_tokens", 16, 1, MAX_TOKENS), "seed": integer("seed", None, 0, 2**63 - 1),
            "return_token_ids": bool(body.get("return_token_ids", False))}


def make_server(service: EngineService, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A server bound to host:port (port 0: any free one); `serve_forever` it on a thread, `shutdown` to stop."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:   # quiet: the audit makes thousands of requests
            pass

        def _send(self, status: int, payload: dict | str) -> None:
            text = payload if isinstance(payload, str) else json.dumps(payload)
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4" if isinstance(payload, str)
                             else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": service.name, "object": "model",
                                                             "created": service.started, "owned_by": "specplay"}]})
            elif self.path.rstrip("/") == "/metrics":
                self._send(200, service.metrics())
            else:
                self._send(404, {"error": {"message": f"no such path: {self.path}"}})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/v1/completions":
                self._send(404, {"error": {"message": f"no such path: {self.path}"}})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self._send(413, {"error": {"message": f"the body is over {MAX_BODY_BYTES} bytes"}})
                return
            try:
                body = json.loads(self.rfile.read(length) or b"null")
                self._send(200, service.complete(body))
            except json.JSONDecodeError as exc:
                self._send(400, {"error": {"message": f"the body is not JSON: {exc}"}})
            except RequestError as exc:
                self._send(400, {"error": {"message": str(exc)}})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
