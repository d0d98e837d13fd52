"""The command surface the other tests reach only through the Python API: `lantern-run generate`'s
sampling and acceptance options, `lantern-export inspect --json` and `lantern-export check
--atol/--rtol/--json`. Each option must change what it claims to and give what the Python API
gives for the same values, so an option parsed but dropped, or forwarded to the wrong field, fails."""
import json
import math
import os
import re

import numpy as np
import pytest
import torch

from engines import captions, manifest
from lantern.export import cli as export_cli
from lantern.export.check_compare import IMAGE_ATOL
from lantern.runtime.generator import Engine
from lantern.runtime.settings import GenerationSettings
from lantern.tools import run_cli

CLASSES, SEED = [1, 4, 7], 3


@pytest.fixture(scope="module")
def engines(c2i_engine, t2i_engine):
    return {"c2i": Engine(c2i_engine, threads=1), "t2i": Engine(t2i_engine, threads=1)}


@pytest.fixture(scope="module")
def caption_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("captions")
    caption, mask = captions(3)
    assert not mask.all()  # left padding in some rows: the mask matters
    np.save(root / "caption.npy", caption)
    np.save(root / "mask.npy", mask)
    return {"caption": str(root / "caption.npy"), "mask": str(root / "mask.npy"), "arrays": (caption, mask)}


# (engine, CLI options, the same as GenerationSettings fields, the settings without the option:
# the CLI's defaults otherwise). MASK: the caption mask file, given to the API as the array.
GENERATE_CASES = {
    "temperature": ("c2i", ["--temperature", "0.3"], {"temperature": 0.3}, {}),
    "top-k": ("c2i", ["--top-k", "2"], {"top_k": 2}, {}),
    "top-p": ("c2i", ["--top-p", "0.3"], {"top_p": 0.3}, {}),
    "lam": ("c2i", ["--lam", "5"], {"lam": 5.0}, {}),
    "cfg-interval": ("c2i", ["--cfg-scale", "4", "--cfg-interval", "5"], {"cfg_scale": 4.0, "cfg_interval": 5},
                     {"cfg_scale": 4.0}),
    "delta": ("c2i", ["--mode", "lantern", "--delta", "0.02"], {"mode": "lantern", "delta": 0.02}, {"mode": "lantern"}),
    "caption-mask": ("t2i", ["--caption-mask", "MASK"], {}, {}),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_option_reaches_the_engine(case, engines, caption_files, tmp_path, capsys):
    kind, options, settings, baseline = GENERATE_CASES[case]
    engine = engines[kind]
    if kind == "c2i":
        argv, condition = ["--classes", ",".join(map(str, CLASSES))], {"classes": CLASSES}
    else:
        argv, condition = ["--caption", caption_files["caption"]], {"caption": caption_files["arrays"][0]}
    with_option = dict(condition, caption_mask=caption_files["arrays"][1]) if "MASK" in options else condition
    options = [caption_files["mask"] if o == "MASK" else o for o in options]

    out = tmp_path / "out"
    assert run_cli.main(["generate", engine.directory, *argv, *options, "--seed", str(SEED), "--threads", "1",
                         "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    got = np.load(out / "tokens.npy")

    want = engine.generate(GenerationSettings(**settings), **with_option, seed=SEED).tokens
    unchanged = engine.generate(GenerationSettings(**baseline), **condition, seed=SEED).tokens
    assert (want != unchanged).any(), f"{case}: {options} changes no token; pick a value that does"
    np.testing.assert_array_equal(got, want)


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def test_inspect_json_of_a_checkpoint_states_its_facts(c2i_engine, capsys):
    """inspect --json of the engine's own source target (.pt + config) and drafter directory,
    against the files read here: the config's fields, the tensors' count and dtype."""
    sources = manifest(c2i_engine)["sources"]
    target, config_file = sources["target"]["path"], sources["target"]["options"]["config_file"]
    assert export_cli.main(["inspect", target, "--config", config_file, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    state = torch.load(target, weights_only=True)["model"]
    assert info["format"] == "llamagen-pt" and info["role"] == "target" and info["family"] == "llamagen"
    assert info["parameters"] == sum(t.numel() for t in state.values())
    assert {str(t.dtype) for t in state.values()} == {f"torch.{info['dtype']}"}
    config = _read_json(config_file)
    assert {k: info["config"][k] for k in config} == config

    drafter = sources["drafter"]["path"]
    assert export_cli.main(["inspect", drafter, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    state = torch.load(os.path.join(drafter, "pytorch_model.bin"), weights_only=True)
    hf = _read_json(os.path.join(drafter, "config.json"))
    assert info["role"] == "drafter" and info["parameters"] == sum(t.numel() for t in state.values())
    assert (info["config"]["dim"], info["config"]["n_head"], info["config"]["n_kv_head"],
            info["config"]["intermediate_size"], info["config"]["vocab_size"]) == (
        hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["intermediate_size"],
        hf["vocab_size"])


def test_inspect_json_of_an_engine_states_its_manifest(c2i_engine, capsys):
    assert export_cli.main(["inspect", c2i_engine, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    m = manifest(c2i_engine)
    assert (info["family"], info["dtype"], info["modes"]) == (m["family"], m["dtype"], m["modes"])
    assert list(info["graphs"]) == list(m["graphs"])
    for name, graph in m["graphs"].items():
        assert info["graphs"][name] == {"file": graph["file"], "dtype": graph["dtype"],
                                        "inputs": list(graph["inputs"]), "outputs": list(graph["outputs"])}
    assert info["plans"] == {} and not m["tensorrt"]
    # the text listing states the same: one line per graph
    assert export_cli.main(["inspect", c2i_engine]) == 0
    text = capsys.readouterr().out
    for name, graph in m["graphs"].items():
        assert (f"graph        {name}: {graph['file']} ({graph['dtype']}), {len(graph['inputs'])} inputs, "
                f"{len(graph['outputs'])} outputs") in text
    # --graphs prints Polygraphy's text: asking for JSON as well is one line, exit 2
    assert export_cli.main(["inspect", c2i_engine, "--json", "--graphs"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--json" in err and len(err.splitlines()) == 1


def _check(engine, tmp_path, capsys, name, *options):
    path = tmp_path / f"{name}.json"
    rc = export_cli.main(["check", engine, *options, "--json", str(path)])
    return rc, capsys.readouterr().out, json.loads(path.read_text())


def _table_rows(out):
    """The printed report's rows: (graph, case, output, max abs as printed or None, ok)."""
    rows = []
    for line in out.splitlines():
        m = re.match(r"^(\S+)\s+(\S+)\s+(\S+)\s+(?:(\S+)\s+\S+)?\s+(ok|FAIL)\b", line)
        if m and m.group(1) != "graph":
            rows.append((m.group(1), m.group(2), m.group(3), m.group(4), m.group(5) == "ok"))
    return rows


def _assert_json_matches_table(report, out):
    rows = _table_rows(out)
    assert len(rows) == len(report["results"])
    for (graph, case, output, max_abs, ok), r in zip(rows, report["results"]):
        assert (graph, case, output, ok) == (r["graph"], r["case"], r["output"], r["ok"])
        if max_abs is not None:
            assert float(max_abs) == pytest.approx(r["max_abs"], rel=0.01, abs=1e-300)


def _split(values):
    """A threshold among the values: in the widest gap of their middle half (its geometric mean),
    so outputs fall on both sides of it."""
    v = sorted({x for x in values if x > 0})
    gaps = list(zip(v, v[1:]))[len(v) // 4: max(3 * len(v) // 4, len(v) // 4 + 1)]
    lo, hi = max(gaps, key=lambda p: p[1] / p[0])
    return math.sqrt(lo * hi)


def test_check_tolerances_decide_the_verdict(c2i_engine, tmp_path, capsys):
    """A loose --atol passes; a threshold among the measured errors (--atol alone, then --rtol
    alone) fails exactly the outputs above it, with one FAILED line and exit 1; --json holds what
    was printed."""
    rc, out, loose = _check(c2i_engine, tmp_path, capsys, "loose", "--atol", "1", "--rtol", "0")
    assert rc == 0 and loose["ok"] and (loose["atol"], loose["rtol"]) == (1.0, 0.0)
    assert out.strip().splitlines()[-1] == f"check passed: {len(loose['results'])} outputs within tolerance"
    _assert_json_matches_table(loose, out)
    floats = [i for i, r in enumerate(loose["results"]) if "scale" in r and r["graph"] != "vq_decoder"]
    assert len(floats) > 10

    def expect(report, measure, threshold, atol, rtol):
        """report's verdicts against the loose run's errors: each float output passes iff
        measure(its errors) <= threshold (outputs within 10% of the threshold are not judged:
        another run may round them to its other side)."""
        sides = set()
        for i, (before, r) in enumerate(zip(loose["results"], report["results"])):
            assert (r["graph"], r["case"], r["output"]) == (before["graph"], before["case"], before["output"])
            if i in floats:
                value = measure(before)
                if not threshold / 1.1 <= value <= threshold * 1.1:
                    assert r["ok"] == (value <= threshold), (threshold, r)
                    sides.add(r["ok"])
            elif r["graph"] == "vq_decoder":  # images keep their floor
                assert r["ok"] == (before["max_abs"] <= max(atol, IMAGE_ATOL) + rtol * before["scale"]), r
        assert sides == {True, False}  # the threshold was among the outputs, as meant
        failed = sum(not r["ok"] for r in report["results"])
        assert not report["ok"] and len(report["failures"]) == failed
        return failed

    atol = _split(loose["results"][i]["max_abs"] for i in floats)
    rc, out, by_atol = _check(c2i_engine, tmp_path, capsys, "atol", "--atol", repr(atol), "--rtol", "0")
    assert (by_atol["atol"], by_atol["rtol"]) == (atol, 0.0)
    failed = expect(by_atol, lambda r: r["max_abs"], atol, atol, 0.0)
    assert rc == 1 and out.count("check FAILED") == 1
    assert out.strip().splitlines()[-1].startswith(f"check FAILED: {failed} output(s) over tolerance: ")
    _assert_json_matches_table(by_atol, out)

    ratio = lambda r: r["max_abs"] / r["scale"] if r["scale"] else 0.0  # noqa: E731
    rtol = _split(ratio(loose["results"][i]) for i in floats)
    rc, out, by_rtol = _check(c2i_engine, tmp_path, capsys, "rtol", "--atol", "0", "--rtol", repr(rtol))
    assert (by_rtol["atol"], by_rtol["rtol"]) == (0.0, rtol)
    failed = expect(by_rtol, ratio, rtol, 0.0, rtol)
    assert rc == 1 and out.strip().splitlines()[-1].startswith(f"check FAILED: {failed} output(s)")
    _assert_json_matches_table(by_rtol, out)
