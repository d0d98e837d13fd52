"""The Chameleon family end to end: tiny Anole (Hugging Face layout) and Lumina-mGPT (xllmx)
targets with LANTERN drafters and a Meta-layout VQ-GAN, written by the project in the real
on-disk layouts, exported through `lantern-export onnx`, checked against PyTorch and decoded on
ONNX Runtime by the same loop that runs LlamaGen."""
import numpy as np
import pytest
import torch

from lantern.export import chameleon_vq as cvq
from lantern.export.check import check_engine
from lantern.runtime import chameleon_prompts as prompts
from lantern.runtime.cli import main as run_main
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine

# The engines' vocabulary (tests/engines.py: build_chameleon_engines) keeps Chameleon's layout:
# image tokens 4..8195 (8192 codes), then the special ids the prompts use.
IMAGE_END_ID, CODES = 8196, 8192
GRID = (4, 4)


@pytest.fixture(scope="module")
def engines(chameleon_engines):
    return chameleon_engines


@pytest.mark.parametrize("family", ["anole", "lumina_mgpt"])
def test_greedy_exact_equals_ar_and_forced_tokens_land_at_row_ends(engines, family):
    engine = Engine(engines[family], threads=2)
    kw = dict(prompt=["a red cat", "a dog on a mat"], grid=GRID, greedy=True, cfg_scale=3.0)
    ar = engine.generate(mode="ar", **kw)
    exact = engine.generate(mode="exact", **kw)
    np.testing.assert_array_equal(exact.tokens, ar.tokens)
    lam1 = engine.generate(mode="lantern++", lam=1.0, k=8, **kw)
    np.testing.assert_array_equal(lam1.tokens, ar.tokens)
    relaxed = engine.generate(mode="lantern++", lam=4.0, k=8, **kw)
    assert relaxed.stats["mean_accepted_length"] > 1.0
    forced = prompts.forced_tokens(family, GRID)
    for out in (ar, exact, relaxed, engine.generate(mode="lantern++", lam=4.0, k=8, seed=3, prompt="a blue photo",
                                                    grid=GRID, cfg_scale=3.0)):
        assert out.tokens.shape[1] == GRID[0] * GRID[1] and out.grid == GRID
        body = out.body
        np.testing.assert_array_equal(body[:, forced >= 0], np.broadcast_to(forced[forced >= 0], body[:, forced >= 0].shape))
        assert ((body[:, forced < 0] >= 4) & (body[:, forced < 0] < IMAGE_END_ID)).all()  # image tokens elsewhere
        np.testing.assert_array_equal(out.tokens, np.stack([prompts.codes_from_body(family, b, GRID).ravel()
                                                            for b in body]))
    if family == "lumina_mgpt":
        # one line break per row, then the end of the image: (w + 1) * h + 1 tokens
        assert ar.body.shape[1] == (GRID[1] + 1) * GRID[0] + 1 and (forced >= 0).sum() == GRID[0] + 1


def test_unconditional_rows_and_positions_follow_the_public_code(engines):
    """Anole (ea_model_anole.py): cond [BOS] + prompt + [8710, 8197] at positions 0..L-1; uncond
    [PAD]*(L-2) + [BOS, 8197] at 0,..,0,1; new tokens continue at L (cond) and 2 (uncond).
    Lumina (ea_model_lumina_mgpt.py): uncond is [8197, h, w] from position 0."""
    anole = Engine(engines["anole"], threads=1).condition
    p = anole.prefix(True, prompt_ids=[[17, 18, 19]])
    L = 6
    np.testing.assert_array_equal(p.ids, [[0, 17, 18, 19, 8710, 8197], [1, 1, 1, 1, 0, 8197]])
    np.testing.assert_array_equal(p.positions[0], np.arange(L))
    np.testing.assert_array_equal(p.positions[1][p.key_visible[1]], [0, 1])
    np.testing.assert_array_equal(L - p.position_offset, [L, 2])  # the first new token's position per row
    lumina = Engine(engines["lumina_mgpt"], threads=1).condition
    p = lumina.prefix(True, prompt_ids=[[17, 18]], grid=GRID)
    h_tok, w_tok = prompts.GRID_TOKEN_BASE + GRID[0] // 2, prompts.GRID_TOKEN_BASE + GRID[1] // 2
    np.testing.assert_array_equal(p.ids[1][p.key_visible[1]], [8197, h_tok, w_tok])
    np.testing.assert_array_equal(p.positions[1][p.key_visible[1]], [0, 1, 2])
    np.testing.assert_array_equal(p.ids[0][-3:], [8197, h_tok, w_tok])
    assert p.position_offset[1] == p.ids.shape[1] - 3
    with pytest.raises(LanternError, match="units of 2"):
        lumina.prefix(True, prompt_ids=[[17]], grid=(3, 4))


@pytest.mark.parametrize("family", ["anole", "lumina_mgpt"])
def test_onnx_graphs_match_pytorch(engines, family):
    report = check_engine(engines[family])
    assert report["ok"], report["failures"]
    assert {r["graph"] for r in report["results"]} == {"target", "drafter", "vq_decoder"}


def test_generate_cli_takes_text_or_ids(engines, tmp_path, capsys):
    out = tmp_path / "text"
    assert run_main(["generate", engines["lumina_mgpt"], "--prompt", "a red cat", "--prompt", "a blue dog",
                     "--grid", "4x4", "--mode", "lantern++", "--k", "8", "--cfg-scale", "3", "--threads", "2",
                     "--out", str(out)]) == 0
    assert np.load(out / "tokens.npy").shape == (2, 16)
    assert (out / "image_001.png").read_bytes()[:4] == b"\x89PNG"
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([[30, 31, 32]], dtype=np.int64))
    assert run_main(["generate", engines["anole"], "--prompt-ids", str(ids), "--grid", "4x4", "--mode", "exact",
                     "--greedy", "--threads", "2", "--out", str(tmp_path / "ids")]) == 0
    capsys.readouterr()
    assert run_main(["generate", engines["anole"], "--classes", "3", "--out", str(tmp_path / "bad")]) == 2
    assert "give prompts as text or as token ids" in capsys.readouterr().err


def test_vq_decoder_on_onnx_runtime_matches_pytorch_decode(engines):
    engine = Engine(engines["anole"], threads=2)
    vq, _ = cvq.load_vq(engine.manifest.sources["vq"]["path"])
    codes = np.random.default_rng(0).integers(0, CODES, size=(2, 16))
    images = engine.decode(codes, GRID)
    with torch.no_grad():
        want = vq.decode_codes(torch.from_numpy(codes).reshape(2, *GRID)).numpy()
    want = np.clip((want.transpose(0, 2, 3, 1) + 1) * 127.5 + 0.5, 0, 255).astype(np.uint8)
    assert images.shape == want.shape == (2, 64, 64, 3)
    assert np.abs(images.astype(int) - want).max() <= 1


@pytest.mark.parametrize("family", ["lumina_mgpt"])
def test_quantized_engine_passes_check_and_generates(engines, family, tmp_path):
    """Weight-only int4 on a Chameleon-family engine (q/k norms, forced row ends): the head is
    found, `check` passes at the int4 tolerance against the fp32 modules, and the loop runs."""
    from lantern.export.quantize import QuantizeOptions, quantize_engine

    out = tmp_path / "int4"
    m = quantize_engine(engines[family], out, QuantizeOptions("int4"))
    assert all(len(m.graphs[g].quantization.head_nodes) == 1 for g in ("target", "drafter"))
    report = check_engine(out)
    assert report["ok"], report["failures"]
    assert report["quantization"]["target"] == {"scheme": "int4", "tolerance": 0.25}
    engine = Engine(out, threads=2)
    tokens = engine.generate(mode="lantern++", k=8, lam=4.0, prompt=["a red cat"], grid=GRID, cfg_scale=3.0).tokens
    assert tokens.shape == (1, GRID[0] * GRID[1]) and 0 <= tokens.min() and tokens.max() < CODES


def test_step_plans_lay_out_without_the_engines_files(engines):
    """`lantern-export trt` lays out a Chameleon engine's step plans from its manifest alone: the
    prompt adapter then takes ids only (it once joined directory None with the tokenizer's name)."""
    from lantern.export.trt_export import PROMPT_TOKENS, call_shapes
    from lantern.runtime.conditions import Prompt
    from lantern.runtime.manifest import read_manifest
    from lantern.runtime.tree import build_tree

    manifest = read_manifest(engines["anole"], verify=False)
    assert manifest.condition.tokenizer is not None  # the case that failed: an engine with a tokenizer
    shapes = call_shapes(manifest, [1], [False, True], [build_tree(manifest.tree)])
    prefill = {label: s for label, (s, _) in shapes["target"].items() if label.startswith("prefill")}
    assert prefill and all(s["input_ids"][-1] >= PROMPT_TOKENS for s in prefill.values())
    with pytest.raises(LanternError, match="ids only"):
        Prompt(manifest, None).tokenizer()
    assert Prompt(manifest, engines["anole"]).tokenizer().encode("a cat")  # with the directory: text works
