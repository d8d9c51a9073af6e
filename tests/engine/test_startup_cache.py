"""Start-up measurements kept between starts (specserve.startup_cache): the kernels' tunings and
the speculation policy's step costs are measured once per machine, model and settings."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.runner import ModelRunner
from specserve.startup_cache import StartupCache


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    """The cache in a fresh directory, switched on (the suite runs with it off)."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECSERVE_PROFILE_CACHE", "1")
    return tmp_path


def test_saved_data_comes_back_only_for_the_same_identity(cache_on, monkeypatch):
    a = StartupCache("demo", {"model": "m", "n": 1})
    assert a.load() is None
    a.save({"x": [1, 2.5], "y": {"3": 4}})
    assert StartupCache("demo", {"model": "m", "n": 1}).load() == {"x": [1, 2.5], "y": {"3": 4}}
    assert StartupCache("demo", {"model": "m", "n": 2}).load() is None  # other settings
    assert StartupCache("other", {"model": "m", "n": 1}).load() is None  # other kind
    assert [p.name for p in (cache_on / "profiles").iterdir()] == [a.path.name]  # no temporary file left

    monkeypatch.setenv("SPECSERVE_PROFILE_CACHE", "0")  # off: neither read nor written
    assert a.load() is None
    b = StartupCache("demo", {"model": "m", "n": 3})
    b.save({"x": 1})
    assert not b.path.exists()


@pytest.mark.parametrize("text", ["", "{not json", '{"identity": 1, "data": 2}', '{"data": {}}', "[]"])
def test_an_unreadable_file_is_ignored_and_replaced(cache_on, text):
    c = StartupCache("demo", {"model": "m"})
    c.path.parent.mkdir(parents=True, exist_ok=True)
    c.path.write_text(text)
    assert c.load() is None
    c.save({"ok": True})
    assert c.load() == {"ok": True}


class _FakeKernels:
    """Stands in for the kernel module: records the settings it is given."""

    def __init__(self) -> None:
        self.distance, self.multi_distance, self.rows = 2048, 8192, 4

    def has_avx2(self) -> bool:
        return True

    def has_avx512(self) -> bool:
        return True

    def set_prefetch_distance(self, bytes_ahead: int, multi_row: bool = False) -> int:
        old = self.multi_distance if multi_row else self.distance
        if multi_row:
            self.multi_distance = bytes_ahead
        else:
            self.distance = bytes_ahead
        return old

    def set_wide_min_rows(self, rows: int) -> int:
        old, self.rows = self.rows, rows
        return old


def test_kernel_tunings_are_measured_once_then_restored(cache_on, monkeypatch):
    """tune_or_restore times the candidates on a first start and saves the choices; a later
    process (the per-process choices forgotten) sets the saved ones without timing a step; a
    saved file that does not fit this build is measured again."""
    import specserve.kernels as kmod

    fake = _FakeKernels()
    monkeypatch.setattr(kmod, "kernels", lambda: fake)
    monkeypatch.delenv("SPECSERVE_PREFETCH", raising=False)
    big = kmod.PREFETCH_TUNE_MIN_BYTES
    calls: list[int] = []

    def step(tokens: int) -> float:
        """Fastest at a 6144-byte distance (one row), 12288 (several), 512 bits wide from 5 rows."""
        calls.append(tokens)
        if tokens == 1:
            return 0.01 + abs(fake.distance - 6144) / 1e6
        wide = fake.rows <= tokens
        return 0.01 * tokens * (0.8 if wide == (tokens >= 5) else 1.0) + abs(fake.multi_distance - 12288) / 1e6

    cache = StartupCache("kernels", {"model": "demo"})
    for tuned in ("_prefetch_tuned", "_wide_tuned"):
        monkeypatch.setattr(kmod, tuned, {})
    assert kmod.tune_or_restore(step, big, cache) is False and calls
    chosen = (fake.distance, fake.multi_distance, fake.rows)
    assert chosen == (6144, 12288, 5)
    assert kmod.tune_or_restore(step, big, cache) is False  # chosen already in this process: nothing to do

    # a new process: the module's settings back at their defaults, nothing chosen yet
    fake.__init__()
    for tuned in ("_prefetch_tuned", "_wide_tuned"):
        monkeypatch.setattr(kmod, tuned, {})
    calls.clear()
    assert kmod.tune_or_restore(step, big, cache) is True
    assert calls == [] and (fake.distance, fake.multi_distance, fake.rows) == chosen
    assert kmod.prefetch_tuning()["cached"] is True and kmod.wide_tuning()["min_rows"] == 5

    # a saved file whose distance is out of range: measured again, and the file fixed
    saved = json.loads(cache.path.read_text())
    saved["data"]["prefetch"]["distance"] = -1
    cache.path.write_text(json.dumps(saved))
    fake.__init__()
    for tuned in ("_prefetch_tuned", "_wide_tuned"):
        monkeypatch.setattr(kmod, tuned, {})
    assert kmod.tune_or_restore(step, big, cache) is False and calls
    assert (fake.distance, fake.multi_distance, fake.rows) == chosen
    assert cache.load()["prefetch"]["distance"] == 6144


def _count_steps(monkeypatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    timed = ModelRunner.time_decode_step

    def counting(self, batch, tokens_per_req=1, *args, **kwargs):
        calls.append((batch, tokens_per_req))
        return timed(self, batch, tokens_per_req, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "time_decode_step", counting)
    return calls


def test_step_costs_are_profiled_once_and_read_at_todays_speed(cache_on, monkeypatch, smollm_checkpoint):
    """The first adaptive engine profiles its step costs and saves them; the next one with the
    same model and settings times only a few one-token steps, takes the saved curve, and reads
    it through the machine's speed now (the timer's phase); other settings, a saved curve from a
    machine twice as fast or slow, or the cache switched off, profile afresh."""
    import specserve.engine.engine as engine_mod

    # (a busy machine, the rest of the suite beside it, moves the speed 2x: that would profile afresh)
    monkeypatch.setattr(engine_mod, "RESTORE_SPEED", (0.2, 5.0))
    calls = _count_steps(monkeypatch)
    kw = dict(dtype="float32", checkpoint=smollm_checkpoint, kv_cache_gib=0.05, spec_method="ngram",
              spec_policy="adaptive", spec_tree="chain", num_spec_tokens=2, max_num_seqs=2)
    first_llm = LLM("smollm2-135m-instruct", **kw)
    first = first_llm.engine
    profiled = len(calls)
    assert profiled > 6 and any(n > 1 for _, n in calls)
    saved = list((cache_on / "profiles").glob("step-costs-*.json"))
    assert len(saved) == 1
    points = dict(first.policy.target_time.points)

    calls.clear()
    second_llm = LLM("smollm2-135m-instruct", **kw)
    second = second_llm.engine
    assert calls and len(calls) <= 1 + engine_mod.RESTORE_ROUNDS and all(c == (1, 1) for c in calls)  # a warm-up and the speed now
    assert second.policy.target_time.points == points
    phase = second.policy.target_time.phase
    assert 0.2 <= phase <= 5.0 and phase != 1.0
    assert second.policy.target_time(1) >= phase * points[1] * (1 - 1e-9)  # the read at today's speed (or the arithmetic)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
    assert second_llm.generate(prompt, greedy)[0].token_ids == first_llm.generate(prompt, greedy)[0].token_ids
    assert second.check_integrity()

    calls.clear()
    LLM("smollm2-135m-instruct", **{**kw, "num_spec_tokens": 3})  # other settings: another profile
    assert len(calls) > 6
    assert len(list((cache_on / "profiles").glob("step-costs-*.json"))) == 2

    # A curve saved on a machine ten times slower: another machine, profile afresh (and save).
    text = json.loads(saved[0].read_text())
    text["data"]["target"]["1"] *= 10
    saved[0].write_text(json.dumps(text))
    calls.clear()
    LLM("smollm2-135m-instruct", **kw)
    assert len(calls) > 6
    assert json.loads(saved[0].read_text())["data"]["target"]["1"] < text["data"]["target"]["1"] / 2

    monkeypatch.setenv("SPECSERVE_PROFILE_CACHE", "0")
    calls.clear()
    LLM("smollm2-135m-instruct", **kw)
    assert len(calls) > 6


def test_saved_draft_costs_scale_with_the_speed_now(tiny_llama, monkeypatch):
    """A saved profile is read at the speed the one-token steps show now: the target's curve
    through its phase, the draft's points (learned in seconds, no phase) and its catch-up cost
    scaled; a saved file missing a field, or with a non-positive time, is refused."""
    _, ckpt = tiny_llama
    llm = LLM("tiny", dtype="float32", checkpoint=ckpt, spec_method="draft", draft_checkpoint=ckpt,
              spec_policy="adaptive", profile_spec_costs=False)
    eng = llm.engine
    monkeypatch.setattr(eng.runner, "time_decode_step", lambda *a, **k: 0.015)  # 1.5x the saved 10 ms
    saved = {"target": {"1": 0.010, "2": 0.011, "40": 0.05}, "draft": {"1": 0.002, "4": 0.003},
             "catchup_s_per_token": 0.0004}
    assert eng._restore_costs(saved)
    pol = eng.policy
    assert pol.target_time.points == {1: 0.010, 2: 0.011, 40: 0.05}
    assert pol.target_time.phase == pytest.approx(1.5) and pol.target_time(1) == pytest.approx(0.015)
    assert pol.draft_time.phase == 1.0
    assert pol.draft_time.points == pytest.approx({1: 0.003, 4: 0.0045})
    assert pol.catchup_s_per_token == pytest.approx(0.0006)
    for broken in ({**saved, "target": {"2": 0.011}}, {**saved, "draft": {"1": -1.0}}, {"target": saved["target"]},
                   {**saved, "catchup_s_per_token": "x"}):
        assert not eng._restore_costs(broken)


def test_int4_blocks_of_a_model_file_are_requantized_once(cache_on, smollm_path, monkeypatch):
    """`int4` on a GGUF requantizes its wider blocks (SmolLM2's tied Q8_0 head -> Q4_0) on the
    first start and keeps them; the next start of the same file reads them back byte for byte
    without requantizing; a torn file is ignored and written again."""
    import specserve.engine.runner as runner_mod
    from specserve.models.block_linear import BlockQuantLinear

    calls: list[int] = []
    requantize = runner_mod.requantize_4bit

    def counting(pw):
        calls.append(pw.qtype)
        return requantize(pw)

    monkeypatch.setattr(runner_mod, "requantize_4bit", counting)
    kw = dict(quantization="int4", kv_cache_gib=0.05, profile_spec_costs=False)
    first = LLM(smollm_path, **kw).engine.runner.model.lm_head
    assert isinstance(first, BlockQuantLinear) and first.qtype == 2 and calls == [8]
    saved = list((cache_on / "profiles").glob("int4-*.safetensors"))
    assert len(saved) == 1
    second = LLM(smollm_path, **kw).engine.runner.model.lm_head
    assert calls == [8] and second.qtype == 2 and torch.equal(second.qweight, first.qweight)
    saved[0].write_bytes(saved[0].read_bytes()[:100])
    third = LLM(smollm_path, **kw).engine.runner.model.lm_head
    assert calls == [8, 8] and torch.equal(third.qweight, first.qweight)
    assert saved[0].stat().st_size > 1000


def test_only_the_newest_tensor_files_of_a_kind_are_kept(cache_on):
    from specserve import startup_cache as sc

    caches = [StartupCache("blobs", {"n": i}) for i in range(sc.TENSOR_FILES_KEPT + 2)]
    for i, c in enumerate(caches):
        c.save_tensors({"x": torch.full((4,), i)})
        os.utime(c.tensor_path, (1000 + i, 1000 + i))
    caches[0].save_tensors({"x": torch.zeros(4)})  # saved again: now the newest
    kept = {p.name for p in (cache_on / "profiles").glob("blobs-*.safetensors")}
    assert kept == {c.tensor_path.name for c in [caches[0], *caches[-sc.TENSOR_FILES_KEPT + 1:]]}
    assert torch.equal(caches[-1].load_tensors()["x"], torch.full((4,), sc.TENSOR_FILES_KEPT + 1))


def test_a_tensor_file_that_fails_to_write_leaves_nothing(cache_on, monkeypatch):
    import safetensors.torch

    cache = StartupCache("blobs", {"n": 1})
    cache.save_tensors({"x": torch.ones(4)})

    def full_disk(tensors, name):  # noqa: ANN001, ANN202
        with open(name, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    cache.save_tensors({"x": torch.zeros(4)})  # logs, keeps the old file whole
    assert [p.name for p in (cache_on / "profiles").iterdir()] == [cache.tensor_path.name]
    assert torch.equal(cache.load_tensors()["x"], torch.ones(4))


def test_a_model_file_rewritten_or_copied_with_its_old_times_is_another_identity(tmp_path):
    """The identity was path, size and modification time: a file rewritten in place with the same
    size and its old mtime restored (or a `cp -p` / rsync copy over it) reused the int4 blocks
    requantized from the old content, and generated from them."""
    import shutil

    from specserve.startup_cache import file_identity

    model = tmp_path / "model.gguf"
    model.write_bytes(b"a" * 64)
    before = file_identity(model)
    st = os.stat(model)
    model.write_bytes(b"b" * 64)  # same size, the old times put back
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_identity(model) != before
    copy = tmp_path / "copy.gguf"
    shutil.copy2(model, copy)  # keeps the modification time
    replaced = file_identity(model)
    os.replace(copy, model)
    assert file_identity(model) != replaced
