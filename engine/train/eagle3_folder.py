"""An EAGLE-3-style head's data folder on disk: its plan, its lock, its frozen prompt list and its shards.

`python -m engine draft-data` (engine.train.eagle3_data) writes a folder; the trainer (engine.train.eagle3), the
pack (engine.train.data_pack) and the evaluation (engine.train.eagle3_eval) read it through this module only.
Every file is written under a temporary name and renamed when whole; a shard's small sidecar (its counts and the
plan's fingerprint) is renamed after it; `load_shard` refuses, with its path, a shard that is not whole or not of
the plan, so training never reads half-written data.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.train.draft_data import SamplingPass

Log = Callable[[str], None]
FORMAT = 1


class DataError(RuntimeError):
    """A data folder or shard cannot be used as it is; the message says which file and what to do."""


@dataclass(frozen=True, slots=True)
class Eagle3DataPlan:
    magpie_prompts: int = 8000        # self-written prompts to keep, after cleaning
    prompt_batch: int = 128
    prompt_max_tokens: int = 96       # a sampled user turn that has not ended by then is dropped
    answer_batch: int = 64
    max_new_tokens: int = 256
    passes: tuple[SamplingPass, ...] = field(default_factory=lambda: (SamplingPass(), SamplingPass(0.7, 0.95)))
    top_k: int = 20                   # soft labels kept per answer position
    layers: tuple[int, ...] = ()      # residual stream entering these layers (L: the post-norm output); () = (2, L // 2, L - 3)
    heldout_every: int = 25           # 4% of the Magpie prompts are held out
    max_per_opening: int = 40         # at most this many kept prompts share their first four words
    written_prompts: int = -1         # the project's written training prompts mixed in (-1: all of them)
    seed: int = 0
    openers: tuple[str, ...] = ()     # sampled user turns begin with these, in turn (steered Magpie); () = free

    def __post_init__(self) -> None:
        if min(self.prompt_batch, self.answer_batch, self.max_new_tokens, self.prompt_max_tokens, self.top_k) < 1:
            raise ValueError("batch sizes, token caps and top_k must be >= 1")
        if self.magpie_prompts < 0 or self.heldout_every < 2 or not self.passes:
            raise ValueError("need magpie_prompts >= 0, heldout_every >= 2 and at least one sampling pass")

    def for_model(self, layers: int) -> "Eagle3DataPlan":
        """This plan with its feature layers chosen for a target of `layers` decoder layers."""
        if self.layers:
            if any(not 0 <= i <= layers for i in self.layers):
                raise ValueError(f"feature layers {self.layers} are not all in 0..{layers} ({layers}: the target's "
                                 "post-norm output)")
            return self
        chosen = (min(2, layers - 1), layers // 2, max(layers - 3, 0))
        return plan_from_dict({**asdict_plan(self), "layers": list(chosen)})

    def fingerprint(self) -> str:
        """What a shard must have been made with to be read under this plan (the prompt count may grow)."""
        d = asdict_plan(self)
        d.pop("magpie_prompts")
        if not d["openers"]:   # a free plan's fingerprint is what it was before openers existed
            d.pop("openers")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def asdict_plan(plan: Eagle3DataPlan) -> dict:
    d = asdict(plan)
    d["passes"] = [dict(p) for p in d["passes"]]
    d["layers"] = list(plan.layers)
    d["openers"] = list(plan.openers)
    return d


def plan_from_dict(d: dict) -> Eagle3DataPlan:
    return Eagle3DataPlan(**{**d, "passes": tuple(SamplingPass(**p) for p in d["passes"]), "layers": tuple(d["layers"]),
                             "openers": tuple(d.get("openers", ()))})


class DataFolder:
    """One target's data folder, held by this process while open (a lock beside the files)."""

    def __init__(self, root: Path, plan: Eagle3DataPlan, target_name: str) -> None:
        self.root, self.plan, self.target = root, plan, target_name
        root.mkdir(parents=True, exist_ok=True)
        (root / "prompts").mkdir(exist_ok=True)
        (root / "answers").mkdir(exist_ok=True)
        self._lock = open(root / "lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DataError(f"another data run is writing {root}: wait for it to finish or stop it first") from None
        self._check_plan()

    def close(self) -> None:
        self._lock.close()

    def __enter__(self) -> "DataFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_plan(self) -> None:
        path = self.root / "plan.json"
        mine = {"format": FORMAT, "target": self.target, "fingerprint": self.plan.fingerprint(),
                "plan": asdict_plan(self.plan)}
        if path.exists():
            try:
                theirs = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise DataError(f"{path} cannot be read ({exc}); delete it to start this folder again") from None
            if (theirs.get("target"), theirs.get("fingerprint")) != (self.target, mine["fingerprint"]):
                raise DataError(f"{self.root} holds data made for {theirs.get('target')!r} with another plan "
                                f"({theirs.get('plan')}); use another folder (--work) or delete this one")
        write_atomic(path, json.dumps(mine, indent=1))


def write_atomic(path: Path, text: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_prompts(root: Path) -> dict:
    path = root / "prompts.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} cannot be read ({exc}); delete it and rerun to select the prompts again") from None


@dataclass(slots=True)
class Example:
    """One training sequence: ids [n], features [n - 1, layers, d] (the residual stream entering each
    feature layer after ids[: t + 1]) and, for each answer position, the target's top-k log-probabilities
    of the next token (rows t = prompt_len - 1 .. n - 2)."""

    ids: torch.Tensor          # int32 [n]
    prompt_len: int
    features: torch.Tensor     # float16 [n - 1, layers, d]
    top_ids: torch.Tensor      # int32 [n - prompt_len, k]
    top_logp: torch.Tensor     # float16 [n - prompt_len, k]

    def check(self) -> str | None:
        n, p = self.ids.numel(), self.prompt_len
        if not 1 <= p < n:
            return f"prompt length {p} of a {n}-token sequence"
        if self.features.shape[0] != n - 1 or self.features.dim() != 3:
            return f"features of shape {tuple(self.features.shape)} for {n} tokens"
        if self.top_ids.shape != self.top_logp.shape or self.top_ids.shape[0] != n - p:
            return f"soft labels of shape {tuple(self.top_ids.shape)} for {n - p} answer tokens"
        if not torch.isfinite(self.features.float()).all():
            return "features that are not finite"
        return None


def shard_path(root: Path, pass_index: int, chunk: int) -> Path:
    return root / "answers" / f"shard-p{pass_index}-{chunk:05d}.pt"


def save_shard(path: Path, examples: list[Example], meta: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"meta": meta, "examples": [asdict(e) for e in examples]}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    side = {**meta, "sequences": len(examples), "tokens": sum(e.ids.numel() for e in examples),
            "answer_tokens": sum(e.ids.numel() - e.prompt_len for e in examples), "bytes": path.stat().st_size}
    write_atomic(path.with_suffix(".json"), json.dumps(side))


def load_shard(path: Path, fingerprint: str) -> list[Example]:
    """The shard's examples, or DataError naming the file when it is unreadable, from another plan, or
    inconsistent (a shard is never partly read)."""
    try:
        data = torch.load(path, weights_only=True)
        meta, raw = data["meta"], data["examples"]
        examples = [Example(**e) for e in raw]
    except Exception as exc:  # truncated zip, wrong pickle, missing keys: all mean the file is not whole
        raise DataError(f"{path} cannot be read ({type(exc).__name__}); delete it and rerun "
                        "`python -m engine draft-data` to generate it again") from None
    if meta.get("fingerprint") != fingerprint:
        raise DataError(f"{path} was made with another data plan; delete it or use that plan's folder")
    for i, e in enumerate(examples):
        problem = e.check()
        if problem:
            raise DataError(f"{path}: sequence {i} has {problem}; delete the file and rerun to generate it again")
    return examples


def shard_info(path: Path, fingerprint: str) -> dict | None:
    """The shard's sidecar when the shard is whole and of this plan; the shard is checked (and the sidecar
    rewritten) when the sidecar is missing; None when the shard must be generated again."""
    side = path.with_suffix(".json")
    if not path.exists():
        return None
    try:
        info = json.loads(side.read_text())
        if info.get("fingerprint") == fingerprint and info.get("bytes") == path.stat().st_size:
            return info
    except (OSError, ValueError):
        pass
    try:
        examples = load_shard(path, fingerprint)
    except DataError:
        return None
    meta = torch.load(path, weights_only=True)["meta"]
    info = {**meta, "sequences": len(examples), "tokens": sum(e.ids.numel() for e in examples),
            "answer_tokens": sum(e.ids.numel() - e.prompt_len for e in examples), "bytes": path.stat().st_size}
    write_atomic(side, json.dumps(info))
    return info


PACKED_ONLY = "packed-only.json"   # the shards an --answers-only run counted from the pack without rebuilding


def mark_packed_only(root: Path, names: list[str]) -> None:
    """Write down which shards of `root` exist only as token ids in its pack (none: the note is removed)."""
    if names:
        write_atomic(root / PACKED_ONLY, json.dumps(sorted(names)) + "\n")
    else:
        (root / PACKED_ONLY).unlink(missing_ok=True)


def packed_only(root: Path) -> list[str]:
    """The shards an --answers-only run left in the pack only and no rebuild has brought into `root` since."""
    try:
        names = json.loads((root / PACKED_ONLY).read_text())
        fingerprint = json.loads((root / "plan.json").read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        return []
    return [n for n in names if shard_info(root / "answers" / f"{n}.pt", fingerprint) is None]


def iter_shards(root: Path) -> Iterator[Path]:
    yield from sorted((root / "answers").glob("shard-p*-*.pt"))


def default_folder(target_name: str) -> Path:
    """Where a target's data lives unless told otherwise: .cache/draft-data/<target> in the checkout."""
    from engine.sources import REPO_ROOT

    return REPO_ROOT / ".cache" / "draft-data" / re.sub(r"[^A-Za-z0-9_.-]+", "_", target_name)


def data_command(root: Path) -> str:
    """The command that made (or continues) the data in `root`: the one its last run wrote down, else what its
    plan implies."""
    try:
        return (root / "command.txt").read_text().strip()
    except OSError:
        pass
    try:
        d = json.loads((root / "plan.json").read_text())
        plan, target = d["plan"], d["target"]
    except (OSError, ValueError, KeyError):
        return f"python -m engine draft-data --work {root}"
    words = ["python -m engine draft-data --target", str(target), "--magpie", str(plan["magpie_prompts"])]
    if plan.get("seed", 0):
        words += ["--seed", str(plan["seed"])]
    if plan.get("written_prompts", -1) != -1:
        words += ["--written", str(plan["written_prompts"])]
    if plan.get("openers"):
        words += ["--steered"]
    return " ".join(words)
