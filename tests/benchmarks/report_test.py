"""report.py on sample JSON (merging, table, goals, plot) and on a real host
step_bench run; pytorch_peer.py's config table and FLOP count (no torch
needed) against the numbers step_bench uses."""

import copy
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.join(os.environ.get("TEST_SRCDIR", ""), os.environ.get("TEST_WORKSPACE", ""))
sys.path.insert(0, os.path.join(HERE, "benchmarks"))

import pytorch_peer  # noqa: E402
import report  # noqa: E402


def system(name, median_ms, tflops=100.0, peak=1000, delta=2000, **extra):
    out = {
        "system": name,
        "status": "ok",
        "step_us": {"median_us": 1000 * median_ms, "min_us": 900 * median_ms, "max_us": 1200 * median_ms},
        "pipelined_step_us": 800 * median_ms,
        "tokens_per_s": 256 / (median_ms / 1000),
        "tflops": tflops,
        "mfu": tflops / 989.0,
        "peak_bytes": peak,
        "device_used_delta_bytes": delta,
    }
    out.update(extra)
    return out


def config(name, systems, status="ok", reason=None, **shape):
    header = pytorch_peer.config_header(name)
    header.update(shape)
    header.update({"status": status, "reason": reason, "systems": systems})
    return header


def ours(graph_ms=0.4, pool_ratio=1.02, graph_delta=1500):
    return {
        "benchmark": "training_step",
        "source": "stepgraph",
        "device": "test",
        "configs": [
            config(
                "small",
                [
                    system("stepgraph_eager", 1.0),
                    system("stepgraph_graph", graph_ms, pool_ratio=pool_ratio, delta=graph_delta),
                ],
            ),
            config(
                "large",
                [
                    system("stepgraph_eager", 50.0, tflops=560),
                    system("stepgraph_graph", 48.0, tflops=600, pool_ratio=1.0, delta=2000),
                ],
            ),
            config("moe", [], status="not_run", reason="[unsupported] Model: MoE blocks are not built yet"),
        ],
    }


def theirs():
    return {
        "benchmark": "training_step",
        "source": "pytorch",
        "device": "test",
        "torch_version": "x",
        "configs": [
            config(
                "small",
                [
                    system("pytorch_eager", 1.5),
                    system("pytorch_cuda_graph", 0.6),
                    {"system": "pytorch_compile", "status": "failed", "reason": "RuntimeError: boom"},
                    system("pytorch_compile_graph", 0.55, tflops=80.0),
                ],
            ),
            config("large", [system("pytorch_eager", 55.0), system("pytorch_cuda_graph", 47.0)]),
            config("moe", [system("pytorch_eager", 30.0)]),
        ],
    }


def verdicts(configs):
    return {f"{config}: {goal}": verdict for verdict, config, goal, _ in report.goals(configs)}


def test_merge_keeps_every_system_of_both_files():
    configs, warnings = report.merge(ours(), theirs())
    assert warnings == []
    assert [c["name"] for c in configs] == ["small", "large", "moe"]
    assert set(configs[0]["systems"]) == {
        "stepgraph_eager",
        "stepgraph_graph",
        "pytorch_eager",
        "pytorch_cuda_graph",
        "pytorch_compile",
        "pytorch_compile_graph",
    }
    assert configs[2]["notes"] == ["stepgraph: not_run: [unsupported] Model: MoE blocks are not built yet"]


def test_merge_reports_configs_that_differ():
    other = theirs()
    other["configs"][0]["hidden"] = 1024
    _, warnings = report.merge(ours(), other)
    assert warnings == ["small: hidden differs between the files (512 vs 1024)"]


def test_table_speedups_are_against_our_eager():
    configs, _ = report.merge(ours(), theirs())
    rows = {(r[0], r[1]): r for r in report.table_rows(configs)}
    assert rows[("small", "stepgraph_graph")][4] == "2.50x"
    assert rows[("small", "pytorch_eager")][4] == "0.67x"
    assert rows[("small", "stepgraph_graph")][2] == "0.400 [0.360-0.480]"
    assert rows[("small", "stepgraph_graph")][8] == "1.020x"
    assert rows[("small", "stepgraph_graph")][9] == "0.320"
    assert rows[("small", "pytorch_compile")][2].startswith("failed: RuntimeError: boom")
    assert rows[("moe", "pytorch_eager")][4] == "-"  # no eager of ours to compare with
    table = report.markdown_table(configs)
    assert table.count("\n") == 2 + len(rows)
    assert table.startswith("| config | system | step ms median [min-max] |")


def test_goals_pass_fail_and_not_measured():
    configs, _ = report.merge(ours(), theirs())
    v = verdicts(configs)
    assert v["small: graphed >= 2x our eager"] == "PASS"  # 1.0 / 0.4 = 2.5
    assert v["small: graphed >= 3x PyTorch eager"] == "PASS"  # 1.5 / 0.4 = 3.75
    # Against the best PyTorch system of the job: small's compile_graph (0.55 ms beats cuda_graph's 0.6).
    assert v["small: graphed step time <= 0.8x best PyTorch"] == "PASS"  # 0.4 / 0.55 = 0.73
    assert v["large: graphed step time <= 1.0x best PyTorch"] == "FAIL"  # 48 / 47 (cuda_graph beats eager)
    assert v["large: MFU >= 60%"] == "PASS"
    assert v["moe: graphed step time <= 1.0x best PyTorch"] == "NOT MEASURED"  # our moe did not run
    assert v["small: pool <= 1.10x lower bound"] == "PASS"
    assert v["small: graphed peak memory <= eager"] == "PASS"  # device delta 1500 <= 2000
    assert v["large: graphed peak memory <= eager"] == "PASS"  # 2000 <= 2000
    assert v["moe: pool <= 1.10x lower bound"] == "NOT MEASURED"
    assert v["moe: graphed peak memory <= eager"] == "NOT MEASURED"
    assert len(report.goals(configs)) == 3 + 2 + 1 + 3 * 2


def test_goals_fail_when_the_numbers_do():
    configs, _ = report.merge(ours(graph_ms=0.7, pool_ratio=1.2, graph_delta=2500), theirs())
    v = verdicts(configs)
    assert v["small: graphed >= 2x our eager"] == "FAIL"  # 1.43x
    assert v["small: graphed >= 3x PyTorch eager"] == "FAIL"
    assert v["small: graphed step time <= 0.8x best PyTorch"] == "FAIL"  # 0.7 / 0.55
    assert v["small: pool <= 1.10x lower bound"] == "FAIL"
    assert v["small: graphed peak memory <= eager"] == "FAIL"


def test_goals_without_pytorch_are_not_measured():
    configs, _ = report.merge(ours())
    v = verdicts(configs)
    assert v["small: graphed >= 2x our eager"] == "PASS"
    assert v["small: graphed >= 3x PyTorch eager"] == "NOT MEASURED"
    assert v["small: graphed step time <= 0.8x best PyTorch"] == "NOT MEASURED"


def test_best_pytorch_is_the_fastest_system_that_ran():
    configs, _ = report.merge(ours(), theirs())
    details = {f"{config}: {goal}": detail for _, config, goal, detail in report.goals(configs)}
    assert details["small: graphed step time <= 0.8x best PyTorch"] == "0.73x pytorch_compile_graph (0.400 ms vs 0.550 ms)"
    assert details["large: graphed step time <= 1.0x best PyTorch"].startswith("1.02x pytorch_cuda_graph")
    assert report.best_pytorch(configs[0]["systems"])[0] == "pytorch_compile_graph"  # compile failed: not a candidate
    assert report.best_pytorch({"stepgraph_graph": system("stepgraph_graph", 0.1)}) == (None, None)
    lines = report.mfu_lines(configs)
    assert lines[0].startswith("small: stepgraph_graph 10.1%, best PyTorch pytorch_compile_graph 8.1%, ")
    assert lines[2].startswith("moe: stepgraph_graph -, best PyTorch pytorch_eager 10.1%")


def test_main_writes_markdown_and_plot(tmp_path):
    a, b = tmp_path / "ours.json", tmp_path / "theirs.json"
    a.write_text(json.dumps(ours()))
    b.write_text(json.dumps(theirs()))
    md, png = tmp_path / "r.md", tmp_path / "r.png"
    assert report.main([str(a), str(b), "--markdown", str(md), "--plot", str(png)]) == 0
    text = md.read_text()
    assert "| small | stepgraph_graph |" in text and "- PASS: large: MFU >= 60%: 60.7%" in text
    assert "MFU (model FLOPs / 989 TFLOP/s" in text and "large: stepgraph_graph 60.7%" in text
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_refuses_the_wrong_file(tmp_path):
    a = tmp_path / "ours.json"
    a.write_text(json.dumps(ours()))
    assert report.main([str(a), str(a)]) == 2
    assert report.main([str(tmp_path / "missing.json")]) == 2


def test_a_real_host_step_bench_run_merges(tmp_path):
    out = tmp_path / "host.json"
    binary = os.path.join(HERE, "benchmarks", "step_bench")
    subprocess.run(
        [binary, "--device", "host", "--configs", "tiny", "--steps", "2", "--warmup", "2", "--out", str(out)],
        check=True,
    )
    configs, warnings = report.merge(report.load(str(out), "stepgraph"))
    assert warnings == []
    assert configs[0]["name"] == "tiny" and set(configs[0]["systems"]) == {"stepgraph_eager", "stepgraph_graph"}
    v = verdicts(configs)
    assert v["tiny: pool <= 1.10x lower bound"] == "PASS"
    assert v["tiny: graphed peak memory <= eager"] in ("PASS", "FAIL")  # judged on tensor bytes on the host
    assert any("identical" in line for line in report.first_losses(configs))


def test_peer_configs_match_step_bench():
    # The same numbers as tests/benchmarks/step_configs_test.cc and model_flops_test.cc.
    shapes = {  # hidden, heads, ffn, layers, seq_len, sequences, tokens, experts
        "small": (512, 8, 2048, 8, 256, 1, 256, 0),
        "medium": (2048, 16, 8192, 8, 2048, 2, 4096, 0),
        "large": (4096, 32, 16384, 4, 4096, 2, 8192, 0),
        "moe": (2048, 16, 8192, 4, 4096, 2, 8192, 8),
    }
    for name, shape in shapes.items():
        c = pytorch_peer.CONFIGS[name]
        assert tuple(c[k] for k in ("hidden", "heads", "ffn", "layers", "seq_len", "sequences", "tokens",
                                    "experts")) == shape
        assert pytorch_peer.head_dim(c) == (64 if name == "small" else 128)
    expected = {
        "small": 8 * (512 * 1536 + 512 * 512 + 2 * 512 * 2048) + 512 * 8192,
        "medium": 8 * (4 * 2048 * 2048 + 2 * 2048 * 8192) + 2048 * 8192,
        "large": 4 * (4 * 4096 * 4096 + 2 * 4096 * 16384) + 4096 * 8192,
        "moe": 4 * (4 * 2048 * 2048 + 2048 * 8 + 2 * 2 * 2048 * 8192) + 2048 * 8192,
    }
    # Attention core (causal, FlashAttention's convention): layers * sequences * 3.5 * 2*2*(L^2/2)*H*D.
    core = {
        "small": 8 * 1 * 3.5 * 4 * (256 * 256 / 2) * 8 * 64,
        "medium": 8 * 2 * 3.5 * 4 * (2048 * 2048 / 2) * 16 * 128,
        "large": 4 * 2 * 3.5 * 4 * (4096 * 4096 / 2) * 32 * 128,
        "moe": 4 * 2 * 3.5 * 4 * (4096 * 4096 / 2) * 16 * 128,
    }
    for name, params in expected.items():
        c = pytorch_peer.CONFIGS[name]
        assert pytorch_peer.matmul_params_per_token(c) == params
        assert pytorch_peer.attention_core_flops(c) == core[name]
        header = pytorch_peer.config_header(name)
        assert header["flops_per_step"] == 6.0 * c["tokens"] * params + core[name]
        assert header["attention_core_flops_per_step"] == core[name]
        assert (header["heads"], header["kv_heads"], header["head_dim"]) == (c["heads"], c["heads"], c["hidden"] // c["heads"])
        # Without attention (heads 0): the MLPs and the head alone, no attention core.
        mlp_blocks = dict(c, heads=0)
        assert pytorch_peer.attention_core_flops(mlp_blocks) == 0
        assert pytorch_peer.step_flops(mlp_blocks) == 6.0 * c["tokens"] * (params - c["layers"] * 4 * c["hidden"] ** 2)
    assert pytorch_peer.VOCAB == 8192
    assert pytorch_peer.SYSTEMS == ("eager", "cuda_graph", "compile", "compile_graph")


def test_peer_refuses_bad_lists():
    with pytest.raises(SystemExit):
        pytorch_peer.parse_list("small,huge", list(pytorch_peer.CONFIGS), "config")
    with pytest.raises(SystemExit):
        pytorch_peer.parse_list("small,small", list(pytorch_peer.CONFIGS), "config")
    assert pytorch_peer.parse_list("large,small", list(pytorch_peer.CONFIGS), "config") == ["large", "small"]


def test_peer_starts_no_system_after_its_budget():
    out = pytorch_peer.run_config("small", ["eager", "compile"], steps=1, warmup=1, deadline=0.0)
    assert [s["status"] for s in out["systems"]] == ["not_run", "not_run"]
    assert out["status"] == "failed" and out["reason"] == "no system ran"
    assert "budget" in out["systems"][0]["reason"]
    configs, _ = report.merge(ours(), {"benchmark": "training_step", "source": "pytorch", "configs": [out]})
    rows = {(r[0], r[1]): r for r in report.table_rows(configs)}
    assert rows[("small", "pytorch_eager")][2].startswith("not_run: the --budget-s time was spent")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--device", "host", "--configs", "small"], "runs only the smoke config 'tiny'"),
        (["--device", "tpu", "--configs", "tiny"], "--device: tpu not in {cuda,host}"),
        (["--device", "host", "--configs", "tiny,,small"], "empty name"),
        (["--device", "host", "--configs", "tiny", "--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_step_bench_refuses_bad_flags_clearly(flags, message):
    binary = os.path.join(HERE, "benchmarks", "step_bench")
    done = subprocess.run([binary, *flags], capture_output=True, text=True)
    assert done.returncode != 0
    assert message in done.stderr
