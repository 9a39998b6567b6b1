"""coat bench / benchmarks/bench_e2e.py: the sweep (one process per configuration, a setup stops at
its first out-of-memory, the time budget), ratios from the same run, JSON merged by key, the table
with the estimate beside each peak, the PNG; end to end on a CPU (tiny Llama) and under torchrun
with FSDP2 on two gloo ranks; the GPU sweep on a CUDA machine (marker gpu)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from coat import memory as M
from coat.cli import bench, bench_worker
from coat.cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str):
    return build_parser().parse_args(["bench", *argv])


def _cli(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coat.cli.main", "bench", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _fake_launch(results: dict):
    """launch() replaced by a table of (setup, batch) -> result; records what was run."""
    ran = []

    def launch(cfg, world, timeout, fsdp):
        ran.append((cfg["setup"], cfg["batch"]))
        r = results.get((cfg["setup"], cfg["batch"]), {"status": "ok"})
        if r["status"] == "ok":
            tps = 1000.0 * cfg["batch"] * (2 if cfg["setup"] == "coat" else 1)
            r = dict(peak_gib=1.0 * cfg["batch"], resident_gib=0.5, tokens_per_s=tps, step_ms=10.0, spread=0.01,
                     host_ms=2.0, device="cpu", **r)
        return dict(r, device="cpu")

    return launch, ran


def test_sweep_stops_a_setup_at_its_first_oom_and_computes_ratios(monkeypatch):
    launch, ran = _fake_launch({("amp", 2): {"status": "oom", "phase": "steps"}})
    monkeypatch.setattr(bench, "launch", launch)
    args = _args("--setups", "amp", "bf16", "coat", "--batches", "1", "2", "4", "--device", "cpu")
    records = bench.sweep(bench.resolve(args), args, log=lambda m: None)
    assert ran == [("amp", 1), ("bf16", 1), ("coat", 1), ("amp", 2), ("bf16", 2), ("coat", 2), ("bf16", 4),
                   ("coat", 4)]
    by = {(r["setup"], r["batch"]): r for r in records}
    assert by[("coat", 1)]["vs_amp"] == 2.0 and by[("coat", 1)]["vs_bf16"] == 2.0
    assert by[("coat", 4)]["vs_amp"] is None and by[("coat", 4)]["vs_bf16"] == 2.0  # no amp at batch 4
    assert by[("coat", 2)]["estimate_gib"] == pytest.approx(M.plan(M.PRESETS["tiny"], "coat", 2, 128,
                                                                   device="cpu").peak_gib)
    table = bench.markdown(records)
    assert "| tiny | amp | 2 | oom |" in table and "| tiny | coat | 4 | 4.00 |" in table


def test_auto_batches_stop_when_every_setup_stopped_and_setup_batches(monkeypatch):
    launch, ran = _fake_launch({("bf16", 4): {"status": "oom"}, ("coat", 2): {"status": "oom"}})
    monkeypatch.setattr(bench, "launch", launch)
    args = _args("--setups", "bf16", "coat", "--device", "cpu", "--max-batch", "64", "--setup-batches", "coat=1,2,16")
    bench.sweep(bench.resolve(args), args, log=lambda m: None)
    assert ran == [("bf16", 1), ("coat", 1), ("bf16", 2), ("coat", 2), ("bf16", 4)]


def test_time_budget_skips_what_would_not_fit(monkeypatch):
    launch, ran = _fake_launch({})

    def slow(cfg, world, timeout, fsdp):
        bench.time.sleep(0.3)
        return launch(cfg, world, timeout, fsdp)

    monkeypatch.setattr(bench, "launch", slow)
    args = _args("--setups", "bf16", "--batches", "1", "2", "4", "--device", "cpu", "--max-seconds", "0.5")
    records = bench.sweep(bench.resolve(args), args, log=lambda m: None)
    assert ran == [("bf16", 1)]
    assert [r["status"] for r in records] == ["ok", "skipped"] and "time budget" in records[1]["reason"]


def test_fp8_all_gather_records_are_kept_apart_and_labelled(tmp_path):
    path = tmp_path / "r.json"
    rec = dict(device="NVIDIA H200", model="llama2-7b", setup="coat-lean", batch=2, seq=2048, world=2, status="ok",
               peak_gib=30.0, tokens_per_s=14000.0, step_ms=290.0, spread=0.02, host_ms=180.0, fsdp_unit=4,
               fp8_all_gather=False)
    bench.merge_json(path, [rec, dict(rec, fp8_all_gather=True, peak_gib=29.0)])
    bench.merge_json(path, [dict(rec, peak_gib=30.5)])  # the same configuration again replaces its record
    got = json.loads(path.read_text())["records"]
    assert sorted((r["fp8_all_gather"], r["peak_gib"]) for r in got) == [(False, 30.5), (True, 29.0)]
    table = bench.markdown(got)
    assert table.count("FP8 all-gather") == 1 and "FSDP2 x2, 4 layers per unit, FP8 all-gather, per GPU" in table


def test_merge_json_replaces_by_key_and_refuses_bad_files(tmp_path):
    path = tmp_path / "r.json"
    rec = dict(device="NVIDIA H100", model="llama2-7b", setup="bf16", batch=1, seq=2048, world=1, status="ok",
               peak_gib=50.3)
    bench.merge_json(path, [rec, dict(rec, batch=2, peak_gib=62.1), dict(rec, status="skipped", batch=4)])
    bench.merge_json(path, [dict(rec, peak_gib=50.2), dict(rec, device="NVIDIA H200")])
    got = json.loads(path.read_text())["records"]
    assert sorted((r["device"], r["batch"], r["peak_gib"]) for r in got) == [
        ("NVIDIA H100", 1, 50.2), ("NVIDIA H100", 2, 62.1), ("NVIDIA H200", 1, 50.3)]
    path.write_text("{not json")
    with pytest.raises(bench.BenchError, match="--json"):
        bench.merge_json(path, [rec])
    with pytest.raises(bench.BenchError, match="--json"):
        bench.resolve(_args("--json", str(path), "--device", "cpu"))


@pytest.mark.parametrize("argv,flag", [
    (["--setups", "fp16"], "--setups"), (["--model", "gpt-5"], "--model"), (["--batches", "0"], "--batches"),
    (["--batches", "one"], "--batches"), (["--setup-batches", "bf16"], "--setup-batches"),
    (["--setups", "bf16", "--setup-batches", "coat=1"], "--setup-batches"), (["--steps", "0"], "--steps"),
    (["--fsdp-unit", "2"], "--fsdp-unit: applies to --fsdp runs only"),
    (["--fp8-all-gather"], "--fp8-all-gather: applies to --fsdp runs only"),
    (["--fsdp", "2", "--fsdp-unit", "3", "--model", "tiny"], "--fsdp-unit: 3 is more than the decoder layers of tiny"),
    # found by review: 0 was taken for the default, a negative --max-batch crashed, and a negative
    # --skip-predicted-oom recorded every configuration as out of memory
    (["--seq", "0"], "--seq"), (["--max-batch", "0"], "--max-batch"), (["--max-batch", "-4"], "--max-batch"),
    (["--skip-predicted-oom", "-1"], "--skip-predicted-oom"), (["--skip-predicted-oom", "0"], "--skip-predicted-oom"),
    (["--timeout", "0"], "--timeout"),
])
def test_bad_flags_are_named(argv, flag):
    with pytest.raises(bench.BenchError, match=flag):
        bench.resolve(_args(*argv, "--device", "cpu"))


def test_fsdp_unit_takes_auto_or_a_count(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        _args("--fsdp", "2", "--fsdp-unit", "0")
    assert "--fsdp-unit: must be auto or a positive integer" in capsys.readouterr().err
    assert _args("--fsdp", "2").fsdp_unit == "auto" and _args("--fsdp", "2", "--fsdp-unit", "4").fsdp_unit == 4
    # auto per configuration: coat.memory's rule at GPU 0's memory; 1 on a CPU (no GPU host overhead to hide)
    shape = M.PRESETS["llama2-7b"]
    a = _args("--fsdp", "2")
    assert bench.fsdp_unit(a, shape, "coat-lean", 1, 2048, 2, "cpu") == 1
    bench._GPU.update(name="NVIDIA H200", memory_gib=139.8)
    try:
        assert [bench.fsdp_unit(a, shape, "coat-lean", b, 2048, 2, "cuda") for b in (1, 4)] == [8, 2]
        assert bench.fsdp_unit(a, shape, "coat+nonsense", 1, 2048, 2, "cuda") == 8  # not modeled: GEMMs alone
        assert bench.fsdp_unit(_args("--fsdp", "2", "--fsdp-unit", "3"), shape, "coat", 1, 2048, 2, "cuda") == 3
        # COAT_BENCH_GPU_GIB makes the worker act as a smaller card: auto sizes K for that card
        small = M.plan(shape, "coat-lean", 1, 2048, 2, "cuda", 1).required_gib + 0.01
        monkeypatch.setenv("COAT_BENCH_GPU_GIB", str(small))
        assert bench.fsdp_unit(a, shape, "coat-lean", 1, 2048, 2, "cuda") == 1
    finally:
        bench._GPU.clear()


def test_model_flops_and_mfu():
    shape = M.PRESETS["llama2-7b"]
    rec = {"status": "ok", "shape": asdict(shape), "setup": "coat", "batch": 2, "seq": 2048, "tokens_per_s": 10000.0,
           "model": "llama2-7b", "world": 1, "device": "NVIDIA H200"}
    lora = dict(rec, setup="coat+lora")
    side = dict(rec, setup="coat+side", device="cpu")
    bench.add_ratios([rec, lora, side])
    dec, head, attn = M.model_flops(shape, 2, 2048)
    # 6 FLOPs per parameter and token of the linears (7B: ~6.5e9 of them), plus causal attention
    assert dec + head == pytest.approx(6 * 2 * 2048 * (shape.layers * shape.layer_linear_params + shape.head_params))
    assert rec["model_tflops"] == pytest.approx((dec + head + attn) / 4096 * 1e4 / 1e12)
    assert rec["mfu"] == pytest.approx(rec["model_tflops"] / 989.4)
    assert lora["model_tflops"] < rec["model_tflops"] and side["mfu"] is None  # no datasheet peak for a CPU
    d2, _, a2 = M.model_flops(shape, 2, 2048, "forward")
    assert d2 == dec / 3 and a2 == attn / 3.5
    assert "| llama2-7b | coat | 2 |" in bench.markdown([dict(rec, peak_gib=1.0, resident_gib=1.0, step_ms=1.0,
                                                             spread=0.0, host_ms=1.0)])


def test_out_of_memory_is_this_configurations_result(monkeypatch):
    def prepare(model, ctx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setitem(bench_worker.SETUPS, "oomy", bench_worker.Setup("oomy", "raises", torch.bfloat16, prepare))
    res = bench_worker.run_config({"setup": "oomy", "shape": asdict(M.PRESETS["tiny"]), "batch": 1, "seq": 16,
                                   "warmup": 1, "steps": 1, "device": "cpu"})
    assert res["status"] == "oom" and res["phase"] == "build" and "out of memory" in res["error"]
    assert bench_worker.is_oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not bench_worker.is_oom(RuntimeError("shape mismatch"))
    why = bench_worker.unavailable(bench_worker.SETUPS["torchao"], "cpu", False)
    assert why == "torchao needs a CUDA GPU"
    release = bench_worker.SETUPS["coat-lean+release"]
    assert bench_worker.unavailable(release, "cuda", True) is None
    assert bench_worker.unavailable(release, "cpu", True) is None and bench_worker.unavailable(release, "cuda", False) is None


@pytest.mark.parametrize("setup", ["coat4bit-lean+release", "coat"])
def test_a_configuration_records_every_steps_loss(setup):
    # The bench trains on one batch: its loss must be finite and fall (a step that trains), and every
    # step's loss is in the result (warm-up, host-timed and timed steps alike).
    res = bench_worker.run_config({"setup": setup, "shape": asdict(M.PRESETS["tiny"]), "batch": 2, "seq": 32,
                                   "warmup": 2, "steps": 4, "device": "cpu"})
    assert res["status"] == "ok"
    losses = res["losses"]
    assert len(losses) == 2 + 1 + 4  # warm-up, the peak step, timed steps (CPU)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_plot_draws_memory_and_throughput(tmp_path):
    recs = [dict(device="cpu", model="tiny", setup=s, batch=b, status="ok", peak_gib=0.01 * b, estimate_gib=0.011 * b,
                 tokens_per_s=100.0 * b, world=1) for s in ("bf16", "coat") for b in (1, 2, 4)]
    recs.append(dict(device="cpu", model="tiny", setup="bf16", batch=8, status="oom", world=1))
    out = bench.plot(recs, tmp_path / "p.png")
    assert out == [tmp_path / "p.png"] and out[0].stat().st_size > 10_000
    recs.append(dict(recs[0], model="small"))
    assert sorted(p.name for p in bench.plot(recs, tmp_path / "q.png")) == ["q_small.png", "q_tiny.png"]


def test_bench_e2e_report_only(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_e2e
    finally:
        sys.path.pop(0)
    path = tmp_path / "r.json"
    rec = dict(device="NVIDIA H100 80GB HBM3", model="llama2-7b", setup="bf16", batch=1, seq=2048, world=1,
               status="ok", peak_gib=50.3, estimate_gib=50.27, resident_gib=37.7, tokens_per_s=8778.0, step_ms=233.3,
               spread=0.01, host_ms=120.0, vs_amp=None, vs_bf16=1.0)
    bench.merge_json(path, [rec])
    assert bench_e2e.main(["--report-only", "--json", str(path), "--png", str(tmp_path / "e.png")]) == 0
    out = capsys.readouterr().out
    assert "| llama2-7b | bf16 | 1 | 50.30 | 50.3 (-0%) | 37.70 | 8,778 |" in out
    assert (tmp_path / "e.png").exists()


# ---- end to end -------------------------------------------------------------------------------------


def test_coat_bench_on_cpu(tmp_path):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    p = _cli("--setups", "bf16", "coat-lean", "--batches", "1", "--warmup", "1", "--steps", "1", "--device", "cpu",
             "--json", str(js), "--png", str(png))
    assert p.returncode == 0, p.stdout + p.stderr
    recs = json.loads(js.read_text())["records"]
    assert [(r["setup"], r["status"]) for r in recs] == [("bf16", "ok"), ("coat-lean", "ok")]
    for r in recs:
        assert r["device"] == "cpu" and r["model"] == "tiny" and r["seq"] == 128 and r["tokens_per_s"] > 0
        assert abs(r["estimate_gib"] / r["peak_gib"] - 1) <= 0.10, r
        assert r["host_ms"] > 0 and r["cpu_ms"] > 0 and r["spread"] == 0.0  # one timed step
    assert "| tiny | coat-lean | 1 |" in p.stdout and png.exists()


def test_fsdp_on_two_gloo_ranks(tmp_path):
    js = tmp_path / "f.json"
    p = _cli("--fsdp", "2", "--setups", "amp", "coat", "--batches", "1", "--warmup", "1", "--steps", "2", "--device",
             "cpu", "--json", str(js), "--png", str(tmp_path / "f.png"))
    assert p.returncode == 0, p.stdout + p.stderr
    recs = {r["setup"]: r for r in json.loads(js.read_text())["records"]}
    assert set(recs) == {"amp", "coat"}
    for r in recs.values():
        assert r["status"] == "ok" and r["world"] == 2 and r["tokens_per_s"] > 0
        assert r["rank_peak_gib"] == [None, None]  # no memory figures for sharded CPU ranks
        assert r["estimate_gib"] == pytest.approx(M.plan(M.PRESETS["tiny"], r["recipe"], 1, 128, 2, "cpu").peak_gib)
    assert recs["coat"]["vs_amp"] > 0
    assert "FSDP2 x2, per GPU" in p.stdout


_OOM_RANK = """
import os, sys, torch
from coat.cli import bench_worker as W
if os.environ["RANK"] == "1":
    def prepare(model, ctx):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated on rank 1)")
    W.SETUPS["bf16"] = W.Setup("bf16", "", torch.bfloat16, prepare)
sys.exit(W.main())
"""


def test_a_rank_out_of_memory_ends_the_group(tmp_path, monkeypatch):
    # Rank 0 waits for rank 1 in its first all-gather; rank 1 runs out of memory before it: torchrun must
    # stop the group (no hang) and the configuration reads as out of memory.
    script = tmp_path / "oom_rank.py"
    script.write_text(_OOM_RANK)
    real_popen = bench.subprocess.Popen

    def popen(cmd, **kw):
        i = cmd.index("-m", cmd.index("--nproc-per-node=2"))
        return real_popen(cmd[:i] + [str(script)] + cmd[i + 2:], **kw)

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    cfg = {"setup": "bf16", "shape": asdict(M.PRESETS["tiny"]), "batch": 1, "seq": 32, "warmup": 1, "steps": 1,
           "device": "cpu", "fsdp": True}
    t0 = bench.time.time()
    res = bench.launch(cfg, 2, timeout=120, fsdp=True)
    assert res["status"] == "oom" and "rank 1" in res["error"] and res["rank"] == 1
    assert bench.time.time() - t0 < 100


@pytest.mark.gpu
def test_gpu_sweep_estimates_within_10pct(tmp_path):
    # ~1.3 B parameters, so that fixed costs do not dominate: four setups, one batch, ~1 min.
    cfg = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 16,
           "num_key_value_heads": 16, "intermediate_size": 5632, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    js = tmp_path / "g.json"
    p = _cli("--model", str(tmp_path), "--batches", "2", "--seq", "1024", "--json", str(js), "--png",
             str(tmp_path / "g.png"))
    assert p.returncode == 0, p.stdout + p.stderr
    recs = json.loads(js.read_text())["records"]
    assert {r["setup"] for r in recs} == {"amp", "bf16", "coat", "coat-lean"}
    for r in recs:
        assert r["status"] == "ok" and r["device"] == torch.cuda.get_device_name(0)
        assert abs(r["estimate_gib"] / r["peak_gib"] - 1) <= 0.10, r
        assert r["vs_amp"] and r["vs_bf16"] and r["step_ms"] > 0 and r["host_ms"] > 0


def test_help_names_every_setup(capsys) -> None:
    from coat.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also inside names
    assert [s for s in bench_worker.SETUPS if s not in text] == []


def test_a_second_run_keeps_the_first_runs_plot(tmp_path, monkeypatch, capsys):
    # `coat bench` twice in one folder: the second plot goes beside the first (coat_bench-2.png),
    # never over it; a --png given is written where it says.
    launch, _ = _fake_launch({})
    monkeypatch.setattr(bench, "launch", launch)
    monkeypatch.chdir(tmp_path)
    argv = ("--setups", "bf16", "coat", "--batches", "1", "--device", "cpu", "--quiet")
    first = bench.run(_args(*argv))[1]
    assert first == [Path(bench.DEFAULT_PNG)]
    before = first[0].read_bytes()
    second = bench.run(_args(*argv))[1]
    assert second == [Path("coat_bench-2.png")] and first[0].read_bytes() == before
    assert bench.run(_args(*argv))[1] == [Path("coat_bench-3.png")]
    assert bench.run(_args(*argv, "--png", "coat_bench.png"))[1] == [Path("coat_bench.png")]
    # Plots split by model (coat_bench_<model>.png) count as taken too.
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    (tmp_path / "other" / "coat_bench_tiny.png").write_bytes(b"")
    assert bench.fresh_png(Path(bench.DEFAULT_PNG)) == Path("coat_bench-2.png")


def test_lora_rows_carry_the_estimate_where_modeled(monkeypatch):
    # bf16+lora and coat+lora (were lora-bf16, lora-coat) are planned by coat.memory; a peer is not.
    launch, _ = _fake_launch({})
    monkeypatch.setattr(bench, "launch", launch)
    args = _args("--setups", "lora-bf16", "lora-coat", "--batches", "2", "--device", "cpu")
    by = {r["setup"]: r for r in bench.sweep(bench.resolve(args), args, log=lambda m: None)}
    for s in ("bf16+lora", "coat+lora"):
        assert by[s]["recipe"] == s and by[s]["estimate_gib"] == pytest.approx(
            M.plan(M.PRESETS["tiny"], s, 2, 128, device="cpu").peak_gib)
    assert bench_worker.SETUPS["torchao"].recipe is None
