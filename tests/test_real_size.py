"""The real-size benchmark (lantern.tools.bench.real_size) at its smallest: GPT-XL shapes (the
full width, vocabulary and heads) with one target layer, written in the llamagen-pt layout,
exported in fp16, hashed and run for two steps on ONNX Runtime, each stage a child process.
The 7B shapes and the TensorRT builds run only as the benchmark (see its docstring)."""
import json

import pytest

from lantern.tools.bench import real_size as bench


def _rows(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_smallest_configuration_runs_every_cpu_stage(tmp_path, capsys):
    code = bench.main(["--config", "gpt-xl-c2i", "--layers", "1", "--no-vq", "--stages", "write,export,hash,tokens",
                       "--steps", "2", "--workdir", str(tmp_path)])
    rows = _rows(capsys)
    row = next(r for r in rows if "target_parameters" in r)
    assert code == 0, row
    # GPT-XL: width 1280, 20 heads, vocabulary 16384; one layer of 36
    assert row["layers"] == 1 and row["full_layers"] == 36
    assert 770e6 < row["full_target_parameters"] < 780e6  # the paper's 775M
    export = row["export"]
    assert export["graphs"] == ["condition", "drafter", "target"]
    # fp16 weights: the 1-layer target holds two 16384 x 1280 tables and ~20M layer weights
    assert 2 * row["target_parameters"] * 0.9 < export["files"]["target.onnx.data"] < 2 * row["target_parameters"] * 1.1
    assert export["peak_rss_mib"] > 0 and export["seconds"] > 0
    assert row["hash"]["hash_first_open_s"] >= 0
    tokens = row["tokens"]
    assert tokens["tokens_mode"] == "exact" and tokens["tokens_steps"] == 2
    assert tokens["tokens_generated"] >= 2  # every step emits at least its next token
    assert not list(tmp_path.iterdir())  # removed after


def test_a_stage_over_the_memory_limit_is_refused_up_front(tmp_path, capsys):
    code = bench.main(["--config", "anole-7b", "--stages", "write,export", "--memory-limit-gib", "1",
                       "--workdir", str(tmp_path)])
    row = next(r for r in _rows(capsys) if "target_parameters" in r)
    assert code == 0 and row["layers"] == 32
    assert "needs about" in row["write"]["refused"] and "limit is 1 GiB" in row["write"]["refused"]
    assert "export" not in row  # nothing after a refusal
    assert not list(tmp_path.iterdir())


def test_extrapolation_is_linear_in_layers():
    rows = [{"config": "anole-7b", "dtype": "fp16", "layers": 2, "full_layers": 32,
             "export": {"seconds": 10.0, "peak_rss_mib": 3000.0, "engine_bytes": 1000},
             "trt": {"seconds": 20.0, "plan_bytes": {"target": 100, "drafter": 50}}},
            {"config": "anole-7b", "dtype": "fp16", "layers": 4, "full_layers": 32,
             "export": {"seconds": 14.0, "peak_rss_mib": 3400.0, "engine_bytes": 1600},
             "trt": {"seconds": 26.0, "plan_bytes": {"target": 160, "drafter": 50}}}]
    out = bench.extrapolate(rows)["anole-7b/fp16"]
    assert out["label"].startswith("EXTRAPOLATED from 2 and 4 layers to 32")
    assert out["export_seconds_per_layer"] == 2.0 and out["export_seconds_at_32_layers"] == 14.0 + 28 * 2.0
    assert out["export_peak_rss_mib_at_32_layers"] == 3400.0 + 28 * 200.0
    assert out["trt_seconds_at_32_layers"] == 26.0 + 28 * 3.0
    assert out["trt_plan_bytes_per_layer"] == 30 and out["trt_plan_bytes_at_32_layers"] == 210 + 28 * 30


@pytest.mark.parametrize("config", bench.CONFIGS)
def test_shapes_are_the_papers_models(config):
    s = bench.shapes(config, 2)
    full = s["full_parameters"]
    assert s["layers"] == 2 and s["parameters"] < full
    assert (0.77e9 < full < 0.78e9) if config.startswith("gpt-xl") else (6.9e9 < full < 7.1e9)


def test_the_7b_shapes_stream_write_and_export_and_refuse_what_loads_the_whole_model():
    """Writer and export stream a 7B target (measured: 2.4 GB peak writing Anole-7b); check, tokens
    and the TensorRT build still hold it, so under the default 12 GiB they are refused up front."""
    for config, family in (("anole-7b", "anole"), ("lumina-mgpt-7b", "lumina_mgpt")):
        parameters = bench.shapes(config)["parameters"]
        for stage in ("write", "export"):
            assert bench.estimate(stage, parameters, "bf16", family)[0] < 6 * bench.GIB
        for stage in ("check", "tokens", "trt"):
            assert bench.estimate(stage, parameters, "fp16", family)[0] > 24 * bench.GIB
    gpt_xl = bench.shapes("gpt-xl-c2i")["parameters"]
    assert bench.estimate("export", gpt_xl, "fp16", "llamagen")[0] == bench.RSS_PER_PARAM["export"] * gpt_xl
