"""Samples from an OpenAI-compatible completions endpoint (vLLM, SGLang, llama.cpp's server, `python -m engine
serve`): `POST {base}/v1/completions` with the prompt's token ids, `max_tokens` = m, temperature, top-k and
top-p, `n` completions per request and a seed (vLLM gives the i-th of n the seed + i; so does this project's
server). Each completion's token ids come back where the server returns them (`return_token_ids`), else its
text. The same allow rules as the watch page (loopback unless the operator names the host), a timeout and a
size bound per reply, a bound on requests, and a stop flag checked between requests."""
from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from engine.sampling import SamplingParams
from engine.watch import WatchError, check_allowed

MAX_REPLY_BYTES = 8 * 2**20
REQUEST_TIMEOUT_S = 60.0


class AuditError(RuntimeError):
    """The audit cannot go on; the message says why, for a person."""


@dataclass(frozen=True, slots=True)
class Completion:
    ids: tuple[int, ...] | None   # None when the server returned text only
    text: str


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A server's completions API: `base` is http(s)://host:port (a /v1/... path given is cut off)."""

    base: str
    model: str | None = None
    allowed: tuple[str, ...] = ()

    @staticmethod
    def of(url: str, model: str | None = None, allowed: tuple[str, ...] = (), flag: str = "--allow-host") -> "Endpoint":
        try:
            check_allowed(url, allowed, flag, verb="audited")
        except WatchError as exc:
            raise AuditError(str(exc)) from None
        parts = urlsplit(url)
        path = parts.path.split("/v1")[0].rstrip("/")
        return Endpoint(urlunsplit((parts.scheme, parts.netloc, path, "", "")), model, allowed)


def post(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S, max_bytes: int = MAX_REPLY_BYTES) -> dict:
    """The JSON answer to `body` posted at `url`; AuditError with a sentence for every way it can fail."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    return _read_json(request, url, timeout, max_bytes)


def get(url: str, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    return _read_json(urllib.request.Request(url), url, timeout, MAX_REPLY_BYTES)


def _read_json(request, url: str, timeout: float, max_bytes: int) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as answer:
            raw = answer.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(2000).decode("utf-8", "replace").strip().replace("\n", " ")
        raise AuditError(f"{url} answered HTTP {exc.code}: {detail[:300] or exc.reason}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            raise AuditError(f"nothing is listening at {url} (connection refused): is the server running?") from None
        if isinstance(exc.reason, (socket.timeout, TimeoutError)):
            raise AuditError(f"{url} did not answer within {timeout:g} s") from None
        raise AuditError(f"could not reach {url}: {exc.reason}") from None
    except (socket.timeout, TimeoutError):
        raise AuditError(f"{url} did not answer within {timeout:g} s") from None
    except (ConnectionError, OSError) as exc:
        raise AuditError(f"the connection to {url} broke: {exc}") from None
    if len(raw) > max_bytes:
        raise AuditError(f"{url} sent more than {max_bytes // 2**20} MiB for one request")
    try:
        answer = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AuditError(f"{url} did not answer JSON ({exc}; the reply began {raw[:80]!r}): is this an "
                         "OpenAI-compatible server?") from None
    if not isinstance(answer, dict):
        raise AuditError(f"{url} answered {type(answer).__name__} where a JSON object was expected")
    return answer


def served_model(endpoint: Endpoint) -> str:
    """The endpoint's model: the one named, else the first `/v1/models` lists."""
    if endpoint.model:
        return endpoint.model
    listed = get(endpoint.base + "/v1/models", timeout=10.0)
    data = listed.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise AuditError(f"{endpoint.base}/v1/models lists no model; name the served model")
    return str(data[0]["id"])


def sample(endpoint: Endpoint, model: str, prompt: list[int] | str, m: int, params: SamplingParams, n: int,
           seed: int | None, timeout: float = REQUEST_TIMEOUT_S) -> list[Completion]:
    """`n` completions of at most `m` tokens each, in one request."""
    body = {"model": model, "prompt": prompt, "max_tokens": m, "temperature": params.temperature,
            "top_p": params.top_p, "n": n, "return_token_ids": True, "stream": False}
    if params.top_k:
        body["top_k"] = params.top_k
    if seed is not None:
        body["seed"] = seed
    url = endpoint.base + "/v1/completions"
    answer = post(url, body, timeout)
    return parse_choices(answer, n, m, url)


def parse_choices(answer: dict, n: int, m: int, url: str) -> list[Completion]:
    """The completions in an answer, checked: n choices, each with text, token ids (when given) of at most m."""
    if "error" in answer and "choices" not in answer:
        raise AuditError(f"{url} answered an error: {str(answer['error'])[:300]}")
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise AuditError(f"{url} sent {got} choices for n={n}: the reply is malformed or truncated")
    out = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0):
        if not isinstance(choice, dict) or not isinstance(choice.get("text"), str):
            raise AuditError(f"{url} sent a choice without text: the reply is malformed")
        ids = choice.get("token_ids")
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids) or len(ids) > m:
                raise AuditError(f"{url} sent token ids that are not a list of at most {m} ids: {str(ids)[:80]}")
            ids = tuple(ids)
        out.append(Completion(ids, choice["text"]))
    return out


class Stop:
    """A flag a caller sets to end an audit between requests (a page's Stop, Ctrl-C)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()
