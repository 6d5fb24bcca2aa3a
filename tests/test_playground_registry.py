"""playground.registry under concurrency: no shared lock around slow loads, one load per model, honest memory.

A slow model is stood in for by a local loader that waits on an event: the tests assert on what has
and has not happened while it waits, never on durations. (`WAIT` only turns a deadlock into a failure.)
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from engine.models import ModelLoadError
from playground import registry
from playground.registry import CUSTOM, MAX_LOADS, Deadlines, ModelRegistry, unreadable_config, weight_bytes

WAIT = 60.0


class SlowLoader:
    """Loads "slow" only once `gate` is set (saying so through `started`); anything else at once."""

    def __init__(self, pair) -> None:
        self.draft, self.target = pair
        self.gate, self.started = threading.Event(), threading.Event()
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def __call__(self, source, role, device):
        with self.lock:
            self.calls.append((source, role))
        if source == "slow":
            self.started.set()
            assert self.gate.wait(WAIT), "the test never opened the gate"
        return self.draft if role == "draft" else self.target


def in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.fixture
def slow(builtin_pair):
    loader = SlowLoader(builtin_pair)
    yield loader
    loader.gate.set()


def test_a_slow_load_does_not_block_a_reset_of_a_loaded_pair(slow):
    registry = ModelRegistry(allow_custom=True, loader=slow, inspect=lambda source, role, device: 1)
    registry.pair("default")
    thread, box = in_thread(lambda: registry.pair(CUSTOM, "slow", "slow"))
    assert slow.started.wait(WAIT)
    other, other_box = in_thread(lambda: registry.pair("default"))
    other.join(WAIT)
    assert not other.is_alive() and other_box["value"].target is slow.target   # done while "slow" still loads
    assert not slow.gate.is_set() and thread.is_alive()
    slow.gate.set()
    thread.join(WAIT)
    assert box["value"].target is box["value"].draft is slow.draft   # "slow" is one model, whichever role


def test_a_slow_inspection_does_not_block_either(slow, builtin_pair):
    """Reading a custom model's config (a Hub request for a Hub id) is as slow as the network: no lock."""
    inspecting, release = threading.Event(), threading.Event()

    def inspect(source, role, device):
        inspecting.set()
        assert release.wait(WAIT)
        return 1

    registry = ModelRegistry(allow_custom=True, loader=slow, inspect=inspect)
    registry.pair("default")
    thread, _ = in_thread(lambda: registry.pair(CUSTOM, "hub/model", "hub/model"))
    assert inspecting.wait(WAIT)
    other, other_box = in_thread(lambda: registry.pair("default"))
    other.join(WAIT)
    assert not other.is_alive() and "value" in other_box and not release.is_set()
    release.set()
    thread.join(WAIT)


def test_two_requests_for_the_same_model_share_one_load(slow):
    registry = ModelRegistry(allow_custom=True, loader=slow, inspect=lambda source, role, device: 1)
    first, first_box = in_thread(lambda: registry.pair(CUSTOM, "slow", "slow"))
    assert slow.started.wait(WAIT)
    second, second_box = in_thread(lambda: registry.pair(CUSTOM, "slow", "slow"))
    slow.gate.set()
    first.join(WAIT)
    second.join(WAIT)
    assert first_box["value"] is second_box["value"]
    assert slow.calls == [("slow", "draft")]   # one model, loaded once, for both roles and both requests


def test_a_failed_load_is_not_remembered(builtin_pair):
    draft, target = builtin_pair
    attempts: list[str] = []

    def flaky(source, role, device):
        attempts.append(role)
        if len(attempts) == 1:
            raise ModelLoadError("the disk hiccuped")
        return draft if role == "draft" else target

    registry = ModelRegistry(loader=flaky)
    with pytest.raises(ModelLoadError, match="hiccuped"):
        registry.pair("default")
    assert registry.loaded() == []
    assert registry.pair("default").target is target and attempts == ["draft", "draft", "target"]


def test_loads_under_way_count_against_free_memory(slow):
    gib = 2**30
    registry = ModelRegistry(allow_custom=True, loader=slow, free=lambda device: 3 * gib,
                             inspect=lambda source, role, device: 2 * gib if source == "slow" else gib)
    thread, _ = in_thread(lambda: registry.pair(CUSTOM, "slow", "slow"))
    assert slow.started.wait(WAIT)
    with pytest.raises(ModelLoadError, match=r"needs about 1\.0 GiB on cpu, but only 1\.0 GiB is free"):
        registry.pair(CUSTOM, "other", "other")      # 2 GiB is claimed by the load under way
    slow.gate.set()
    thread.join(WAIT)


def test_step_never_starts_a_download(slow):
    registry = ModelRegistry(allow_custom=True, loader=slow, inspect=lambda source, role, device: 1)
    with pytest.raises(ModelLoadError, match="is not loaded yet: press Reset to load it"):
        registry.pair(CUSTOM, "slow", "slow", load=False)
    assert slow.calls == []
    assert registry.pair("default", load=False).target is slow.target   # the server's own pair may load


def hanging(started: threading.Event, release: threading.Event):
    """An inspect or loader that blocks like a Hub endpoint that accepts and never answers."""
    def call(source, role, device):
        started.set()
        release.wait(WAIT)
        raise ModelLoadError("released")
    return call


def test_a_config_read_that_never_answers_is_refused_within_its_deadline(slow):
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []
    inspect = hanging(started, release)
    registry = ModelRegistry(allow_custom=True, loader=slow, deadlines=Deadlines(config_s=1, load_s=WAIT),
                             inspect=lambda *a: calls.append(a[0]) or inspect(*a))
    try:
        with pytest.raises(ModelLoadError, match="the draft model 'hub/hung' took too long: reading its config "
                                                 "did not finish within 1 s"):
            registry.pair(CUSTOM, "hub/hung", "hub/hung")
        assert started.is_set() and not release.is_set()
        with pytest.raises(ModelLoadError, match="reading its config did not finish"):   # still hung: no new read
            registry.pair(CUSTOM, "hub/hung", "hub/hung")
        assert calls == ["hub/hung"]
        assert registry.pair("default").target is slow.target     # everyone else's pair loads meanwhile
    finally:
        release.set()


def test_closing_the_registry_wakes_every_request_waiting_for_a_load(slow):
    started, release = threading.Event(), threading.Event()
    registry = ModelRegistry(allow_custom=True, loader=hanging(started, release), inspect=lambda *a: 1)
    try:
        thread, box = in_thread(lambda: registry.pair(CUSTOM, "hub/hung", "hub/hung"))
        assert started.wait(WAIT)
        registry.close()
        thread.join(WAIT)
        assert "shutting down" in str(box["error"]) and not release.is_set()
    finally:
        release.set()


def test_hung_loads_cannot_pile_up(slow):
    started, release = threading.Event(), threading.Event()
    registry = ModelRegistry(allow_custom=True, loader=slow, inspect=hanging(started, release))
    try:
        threads = [in_thread(lambda i=i: registry.pair(CUSTOM, f"hub/m{i}", f"hub/m{i}"))[0]
                   for i in range(MAX_LOADS)]
        deadline = time.monotonic() + WAIT
        while sum(t.name.startswith("load ") for t in threading.enumerate()) < MAX_LOADS:
            assert time.monotonic() < deadline, "the loads never started"
            time.sleep(0.01)
        with pytest.raises(ModelLoadError, match=f"already loading {MAX_LOADS} models"):
            registry.pair(CUSTOM, "hub/one-more", "hub/one-more")
    finally:
        release.set()
    for t in threads:
        t.join(WAIT)


PATHS = ("/etc", "/no/such/folder", "../../../../etc/shadow", "../nope", "~/models", "C:\\models", "a/b/c")


def test_settle_waits_for_the_calibration_under_way_and_only_for_it(builtin_pair):
    """A measurement of the app's own Steps waits here first, so that no calibration takes turns with them."""
    release, started = threading.Event(), threading.Event()
    curve = object()

    def calibrate(target):
        started.set()
        assert release.wait(WAIT), "the test never let the calibration finish"
        return curve

    registry = ModelRegistry(loader=lambda source, role, device: builtin_pair[1], calibrate_fn=calibrate)
    assert registry.settle(timeout=0.0)                    # nothing measured yet: nothing to wait for
    target = registry.pair("default").target
    assert registry.calibration(target) is None and started.wait(WAIT)
    assert not registry.settle(timeout=0.05)               # still measuring: says so when the time is up
    release.set()
    assert registry.settle(timeout=WAIT)
    assert registry.calibration(target) is curve
    registry.close()


def test_registries_over_the_same_weights_share_the_calibration_under_way(builtin_tokenizer, monkeypatch):
    """A second registry asking for r(n) of weights a first one is measuring waits for that calibration rather
    than starting its own beside it; where the first registry closes and stops it, the next request measures
    afresh."""
    from engine.calibration import CalibrationStopped
    from tests.conftest import tiny_model

    target = tiny_model(builtin_tokenizer, layers=1, seed=41)     # weights no calibration in this process measured
    release, started, calls = threading.Event(), threading.Semaphore(0), []
    curve = object()

    def measured(t, stop=None, gate=None):
        calls.append(t)
        started.release()
        while not release.wait(0.01):
            if stop.is_set():
                raise CalibrationStopped("stopped")
        return curve

    monkeypatch.setattr(registry, "app_calibration", measured)
    first, second, third = (ModelRegistry(loader=lambda source, role, device: target) for _ in range(3))
    assert first.calibration(target) is None and started.acquire(timeout=WAIT)
    assert second.calibration(target) is None and second.calibration(target) is None
    assert len(calls) == 1 and not second.settle(timeout=0.05)           # following the first one's, still under way
    first.close()                                                        # stops it: the follower is left unmeasured
    assert second.settle(timeout=WAIT) and second.calibration(target) is None and started.acquire(timeout=WAIT)
    assert len(calls) == 2                                               # so its next request measured afresh
    assert third.calibration(target) is None and len(calls) == 2         # and the third follows that one
    release.set()
    assert second.settle(timeout=WAIT) and third.settle(timeout=WAIT)
    assert second.calibration(target) is curve and third.calibration(target) is curve and len(calls) == 2
    for r in (second, third):
        r.close()


def test_custom_paths_get_one_sentence_whether_or_not_they_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "name").mkdir(parents=True)     # Hub-shaped, and a folder here
    registry = ModelRegistry(allow_custom=True, loader=lambda *a, **k: pytest.fail("nothing may load"))
    said = set()
    for path in PATHS:
        with pytest.raises(ModelLoadError) as refused:
            registry.pair(CUSTOM, "owner/draft", path)
        said.add(str(refused.value).replace(repr(path), "ID"))
    assert len(said) == 1 and "is not a Hub id" in said.pop()
    answers = set()
    for hub_id in ("owner/name", "owner/absent"):          # a local folder answers as an unknown Hub id does
        with pytest.raises(ModelLoadError) as refused:
            registry.check_custom("target", hub_id) if hub_id == "owner/name" else \
                weight_bytes(hub_id, "target", torch.device("cpu"))
        answers.add(str(refused.value).replace(repr(hub_id), "ID"))
    assert answers == {unreadable_config("target", "ID").replace("'ID'", "ID")}


def test_an_operator_may_allow_local_paths():
    registry = ModelRegistry(allow_custom=True, allow_local_paths=True)
    for path in PATHS:
        registry.check_custom("target", path)       # refused later by what is (not) there, not by its form
    assert registry.choices()[-1] == ("Custom ids or paths", CUSTOM)
    assert ModelRegistry(allow_custom=True).choices()[-1] == ("Custom Hub ids", CUSTOM)


@pytest.mark.parametrize("layers, words", [([2, 15, 30], "fuses layers 2, 15 and 30"), ([30], "second EAGLE head"),
                                           (None, "second EAGLE head")])
def test_a_second_smollm2_head_is_offered_beside_the_first_and_named_by_what_it_reads(tmp_path, monkeypatch,
                                                                                      layers, words):
    from engine.sources import SMOLLM2, eagle_folder

    second = tmp_path / "second"
    second.mkdir()
    if layers is not None:   # None: a damaged config; the label still reads, and loading will say what is wrong
        (second / "eagle.json").write_text(json.dumps({"config": {"feature_layers": layers}}))
    monkeypatch.setattr(registry, "eagle_folder",
                        lambda source: second if source == f"{SMOLLM2}-eagle3" else eagle_folder(source))
    presets = {p.key: p for p in registry.local_presets()}
    assert presets[SMOLLM2].eagle == SMOLLM2 and presets[f"{SMOLLM2}-eagle3"].eagle == f"{SMOLLM2}-eagle3"
    assert words in presets[f"{SMOLLM2}-eagle3"].label and words not in presets[SMOLLM2].label
