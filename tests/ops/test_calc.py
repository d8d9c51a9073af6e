"""`specserve calc`: the seed exercises' numbers, the formulas' edge cases, the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from specserve.cli import main
from specserve.ops import calc
from specserve.ops.hardware import HARDWARE, UnknownHardwareError, get_hardware

LLAMA3_70B = calc.KVDims(layers=80, kv_heads=8, head_dim=128)


# ---------------------------------------------------------------------- the seed exercises
@pytest.mark.parametrize(
    ("alpha", "k", "c", "expected"), [(3.5, 8, 0.1, 1.94), (3.5, 8, 0.2, 1.35), (2.0, 8, 0.1, 1.11)]
)
def test_seed_speedups(alpha, k, c, expected):
    assert round(calc.speedup(alpha, k, c), 2) == expected


def test_seed_high_batch_speedup():
    # alpha 2.0 at K 4, draft cost ignored: the verify of 5 tokens costs 5 plain steps.
    assert calc.speedup_high_batch(2.0, 4, 0.0) == pytest.approx(0.40)


def test_seed_llama3_70b_kv_and_transfer():
    per_token = calc.kv_bytes_per_token(LLAMA3_70B, "fp16")
    assert per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    total = per_token * 32_768
    assert round(total / 1e9, 1) == 10.7
    assert total / (1 << 30) == pytest.approx(10.0)
    t = calc.transfer_time(total, 50.0, layers=80)
    assert int(t.total_s * 1e3) == 214  # 214.7 ms
    assert round(t.per_layer_s * 1e3, 1) == 2.7


def test_seed_numbers_in_reports():
    kv = calc.kv_report(LLAMA3_70B, "fp16", 32_768)
    assert "10.7 GB" in kv.to_text() and "10 GiB" in kv.to_text()
    tr = calc.transfer_report(kv["bytes_per_request"], 50.0, 80)
    assert tr["total_ms"] == pytest.approx(214.7, abs=0.05)
    assert "214.7 ms" in tr.to_text() and "2.68 ms" in tr.to_text()


# ---------------------------------------------------------------------- formulas
def test_expected_tokens_closed_form_and_limits():
    for b in (0.0, 0.3, 0.8, 0.999):
        for k in (0, 1, 4, 8):
            closed = (1 - b ** (k + 1)) / (1 - b)
            assert calc.expected_tokens(b, k) == pytest.approx(closed)
    assert calc.expected_tokens(1.0, 4) == 5
    assert calc.expected_tokens(0.0, 4) == 1
    # a huge K answers at once from the closed form (the series took minutes at K = 1e11), and
    # the two forms meet where one hands over to the other
    for b in (0.3, 0.999, 0.999999):
        assert calc.expected_tokens(b, 10**11) == pytest.approx(1 / (1 - b), rel=1e-6)
        k = calc.EXACT_SUM_K
        assert calc.expected_tokens(b, k + 1) - calc.expected_tokens(b, k) == pytest.approx(b ** (k + 1), rel=1e-6, abs=1e-12)
    assert calc.acceptance_for(3.5, 10**11) == pytest.approx(1 - 1 / 3.5)


@pytest.mark.parametrize(("b", "k"), [(0.2, 3), (0.73, 8), (0.95, 16), (0.0, 2), (1.0, 5)])
def test_acceptance_inverts_expected_tokens(b, k):
    assert calc.acceptance_for(calc.expected_tokens(b, k), k) == pytest.approx(b, abs=1e-9)


def test_best_k_is_the_argmax_of_the_table():
    for b, c in [(0.8, 0.1), (0.6, 0.05), (0.9, 0.33), (0.5, 0.6)]:
        table = calc.k_table(b, c, 16)
        best = calc.best_k(b, c, 16)
        assert best.speedup == max(r.speedup for r in table)
        assert best.speedup == pytest.approx(
            calc.speedup(calc.expected_tokens(b, best.k), best.k, c)
        )
    assert calc.best_k(0.8, 0.1, 16).k == 6
    assert calc.best_k(0.3, 1.0, 16).k == 0  # drafting as dear as the target: never pays
    # At high batch S <= 1 for every K: speculation only loses there.
    assert all(r.speedup_high_batch <= 1.0 + 1e-12 for r in calc.k_table(0.95, 0.0, 16))


def test_int8_kv_counts_scales_like_the_runner():
    import torch

    from specserve.config import CacheConfig
    from specserve.engine.runner import kv_bytes_per_token
    from specserve.models.arch import ArchConfig

    arch = ArchConfig("llama", 100, 64, 128, 3, 4, 2, 16, 1e4, 1e-5, 256, True)
    dims = calc.KVDims.from_arch(arch)
    for dtype, cache_dtype, torch_dtype in [
        ("int8", "int8", torch.float32),
        ("fp32", "auto", torch.float32),
        ("bf16", "auto", torch.bfloat16),
    ]:
        runner_bytes = kv_bytes_per_token(
            arch, CacheConfig(kv_cache_dtype=cache_dtype), torch_dtype
        )
        assert calc.kv_bytes_per_token(dims, dtype) == runner_bytes
    # 1 byte per element plus a float32 scale per (token, head) for K and for V.
    assert calc.kv_bytes_per_token(LLAMA3_70B, "int8") == 2 * 80 * 8 * (128 + 4)


def _simulated_exposure(total: float, layers: int, compute: float) -> float:
    """Event simulation of layer streaming: send i starts when layer i is computed and the link is free."""
    t, link_free = total / layers, 0.0
    for i in range(layers):
        link_free = max((i + 1) * compute, link_free) + t
    return link_free - layers * compute


@pytest.mark.parametrize("compute_ms", [0.0, 1.0, 2.68, 5.0])
def test_transfer_pipelining_model(compute_ms):
    total = calc.kv_bytes_per_token(LLAMA3_70B, "fp16") * 32_768
    r = calc.transfer_time(total, 50.0, 80, compute_ms / 1e3)
    assert r.exposed_s == pytest.approx(_simulated_exposure(r.total_s, 80, compute_ms / 1e3))
    assert 0.0 <= r.hidden_fraction <= 1.0
    if compute_ms == 0.0:
        assert r.exposed_s == pytest.approx(r.total_s)  # nothing to overlap with
    if compute_ms >= r.per_layer_s * 1e3:
        assert r.exposed_s == pytest.approx(r.per_layer_s)  # only the last layer's transfer shows


def test_latency():
    assert calc.request_latency(0.2, 0.03, 100) == pytest.approx(0.2 + 99 * 0.03)
    assert calc.request_latency(0.2, 0.03, 1) == pytest.approx(0.2)
    # `calc latency` takes milliseconds: a bad value is reported as given, under its flag's name
    with pytest.raises(calc.CalcInputError, match=r"--ttft-ms and --tpot-ms must be >= 0 and finite, got inf and 0.02"):
        calc.latency_report(math.inf, 0.02, 10)


def test_roofline_ridge_balances_memory_and_compute():
    h100 = get_hardware("h100")
    low = calc.roofline(70e9, 16, 1, h100.memory_gb_s, h100.tflops)
    assert low.bound == "memory"
    assert low.bytes_per_step == pytest.approx(140e9)
    assert low.tokens_per_s == pytest.approx(3350e9 / 140e9)
    assert low.ridge_intensity == pytest.approx(h100.ridge_flops_per_byte)
    # Weights only: compute catches up at batch = ridge intensity * bytes per weight / 2.
    assert low.ridge_batch == pytest.approx(h100.ridge_flops_per_byte * 2 / 2)
    # With a KV context the ridge is where the two times meet; it does not depend on the batch asked.
    kv = calc.kv_bytes_per_token(LLAMA3_70B, "fp16")
    b = calc.roofline(70e9, 4, 8, 3350, 989, context_tokens=512, kv_bytes_token=kv).ridge_batch
    assert (
        calc.roofline(70e9, 4, 1, 3350, 989, context_tokens=512, kv_bytes_token=kv).ridge_batch == b
    )
    assert (70e9 * 4 / 8 + b * 512 * kv) / 3350e9 == pytest.approx(b * 2 * 70e9 / 989e12)
    # Long contexts: KV reads grow with the batch as fast as FLOPs, so there is no ridge.
    assert math.isinf(
        calc.roofline(70e9, 16, 1, 3350, 989, context_tokens=32_768, kv_bytes_token=kv).ridge_batch
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda: calc.speedup(3.5, -1, 0.1),
        lambda: calc.speedup(10.0, 8, 0.1),  # alpha > K + 1
        lambda: calc.speedup(0.5, 8, 0.1),  # alpha < 1
        lambda: calc.speedup(2.0, 8, -0.1),
        lambda: calc.expected_tokens(1.5, 4),
        lambda: calc.acceptance_for(2.0, 0),
        lambda: calc.KVDims(0, 8, 128),
        lambda: calc.kv_bytes_per_token(LLAMA3_70B, "fp4"),
        lambda: calc.transfer_time(1e9, 0.0),
        lambda: calc.request_latency(0.1, 0.01, 0),
        lambda: calc.roofline(70e9, 16, 0, 3350, 989),
    ],
)
def test_out_of_range_inputs_raise_calc_errors(call):
    with pytest.raises(calc.CalcInputError):
        call()


def test_hardware_registry():
    assert get_hardware("H100").memory_gb_s == 3350.0
    assert get_hardware("a100").tflops == 312.0
    assert get_hardware("cpu-2core").link_gb_s is None
    assert {"h100", "a100", "cpu-2core"} <= set(HARDWARE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        HARDWARE["h100"].memory_gb_s = 1.0  # type: ignore[misc]
    with pytest.raises(UnknownHardwareError, match="h100"):
        get_hardware("tpu-v9")


# ---------------------------------------------------------------------- command line
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["calc", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_speedup_text_and_json(capsys):
    code, out, _ = run_cli(capsys, "speedup", "--alpha", "3.5", "--k", "8", "--cost-ratio", "0.1")
    assert code == 0 and "1.94" in out and "high batch" in out
    code, out, _ = run_cli(capsys, "speedup", "--alpha", "2.0", "--k", "4", "--json")
    d = json.loads(out)
    assert code == 0 and d["speedup_high_batch"] == pytest.approx(0.40) and d["inputs"]["k"] == 4


def test_cli_every_subcommand_json(capsys):
    runs = {
        "alpha": ["--k", "8", "--acceptance", "0.8"],
        "best-k": ["--acceptance", "0.8", "--cost-ratio", "0.1", "--max-k", "8"],
        "kv": [
            "--layers",
            "80",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--tokens",
            "32768",
            "--dtype",
            "fp16",
        ],
        "transfer": [
            "--layers",
            "80",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--tokens",
            "32768",
            "--bandwidth-gbs",
            "50",
            "--compute-ms-per-layer",
            "2",
        ],
        "latency": ["--ttft-ms", "200", "--tpot-ms", "30", "--tokens", "100"],
        "roofline": ["--params-b", "70", "--hardware", "h100", "--batch", "8"],
    }
    results = {}
    for name, argv in runs.items():
        code, out, err = run_cli(capsys, name, *argv, "--json")
        assert code == 0, err
        results[name] = json.loads(out)
    assert results["alpha"]["alpha"] == pytest.approx(calc.expected_tokens(0.8, 8))
    assert results["best-k"]["best_k"] == 6 and len(results["best-k"]["table"]) == 9
    assert round(results["kv"]["gb_per_request"], 1) == 10.7
    assert int(results["transfer"]["total_ms"]) == 214
    assert results["latency"]["latency_ms"] == pytest.approx(3170.0)
    assert (
        results["roofline"]["bound"] == "memory"
        and results["roofline"]["inputs"]["hardware"] == "h100"
    )


def test_cli_kv_from_a_bundled_model(capsys, smollm_path):
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, read from the GGUF's metadata only.
    code, out, err = run_cli(
        capsys, "kv", "--model", "smollm2-135m-instruct", "--tokens", "1000", "--json"
    )
    assert code == 0, err
    d = json.loads(out)
    assert d["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert (d["inputs"]["layers"], d["inputs"]["kv_heads"], d["inputs"]["head_dim"]) == (30, 3, 64)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["speedup", "--alpha", "3.5", "--k", "-2"], "K (draft tokens per step)"),
        (["speedup", "--alpha", "12", "--k", "8"], "between 1 and K + 1"),
        (["alpha", "--k", "4", "--acceptance", "1.5"], "acceptance must lie in [0, 1]"),
        (["kv", "--layers", "80", "--tokens", "10"], "--kv-heads"),
        (["kv", "--model", "no-such-model-anywhere", "--tokens", "10"], "neither a bundled model"),
        (["transfer", "--bytes", "1e9"], "--bandwidth-gbs or --hardware"),
        (["transfer", "--bytes", "1e9", "--hardware", "cpu-2core"], "publishes no figure"),
        (["roofline", "--params-b", "70", "--hardware", "tpu-v9"], "Unknown hardware"),
        (["roofline", "--hardware", "h100"], "--params-b"),
        (["latency", "--ttft-ms", "100", "--tpot-ms", "-5", "--tokens", "10"], "must be >= 0"),
        (["best-k", "--acceptance", "0.8", "--cost-ratio", "0.1", "--max-k", "100000000"], "--max-k is at most"),
        (["roofline", "--params-b", "1e300", "--hardware", "h100", "--json"], "weight count must be in"),
        (["roofline", "--params-b", "70", "--hardware", "h100", "--context-tokens", "-5"], "--context-tokens must be >= 0"),
        (["roofline", "--params-b", "8", "--bandwidth-gbs", "1e308", "--tflops", "1e308"], "must be in (0, 1e+09]"),
        (["transfer", "--bytes", "1e9", "--bandwidth-gbs", "25", "--layers", "0"], "layers must be a whole number >= 1"),
        (["transfer", "--bytes", "1e9", "--bandwidth-gbs", "1e308"], "bandwidth must be in (0, 1e+09]"),
        (["transfer", "--bytes", "1e300", "--bandwidth-gbs", "1e-300"], "transfer time overflows"),  # as text, not "never"
    ],
)
def test_cli_bad_input_exits_2_with_a_message(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and not out
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_cli_unparsable_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["calc", "speedup", "--alpha", "many", "--k", "8"])
    assert exc.value.code == 2
    assert "invalid float value" in capsys.readouterr().err


def test_cli_entry_point_subprocess():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.cli",
            "calc",
            "speedup",
            "--alpha",
            "3.5",
            "--k",
            "8",
            "--k",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "error: K" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.cli",
            "calc",
            "latency",
            "--ttft-ms",
            "200",
            "--tpot-ms",
            "30",
            "--tokens",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "3170.0 ms" in proc.stdout


def test_cut_largest_first_levels_the_largest_sizes_down_to_the_total():
    """What the policy and the simulator keep of a step's drafts beside a prompt: the largest cut
    first, down to one level, the last of those above it keeping one more; unchanged when they fit."""
    assert calc.cut_largest_first([8, 3], 5) == [2, 3]
    assert calc.cut_largest_first([12], 1) == [1]
    assert calc.cut_largest_first([16, 2, 9, 0], 12) == [5, 2, 5, 0]
    assert calc.cut_largest_first([16, 2, 9, 0], 13) == [5, 2, 6, 0]
    assert calc.cut_largest_first([4, 4], 8) == [4, 4] and calc.cut_largest_first([4, 4], 20) == [4, 4]
    assert calc.cut_largest_first([4, 4], 0) == [0, 0] and calc.cut_largest_first([], 3) == []
    for sizes in ([7, 1, 7, 3], [1] * 9, [30, 29, 1]):
        for total in range(sum(sizes) + 1):
            out = calc.cut_largest_first(sizes, total)
            assert sum(out) == total and all(0 <= o <= s for o, s in zip(out, sizes))
            cut = [o for o, s in zip(out, sizes) if o < s]
            assert not cut or max(out) - min(cut) <= 1  # no size kept above one that was cut
