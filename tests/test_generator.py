"""The decoding loop end to end on real ONNX Runtime engines (tiny models) and the torch backend."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy import stats

from engines import build_engine, captions, strike_drafter
from lantern.export import checkpoints
from lantern.export.torch_backend import open_torch_backend
from lantern.runtime import accept as acceptance, filtering
from lantern.runtime.cli import main as run_main
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.tree import build_tree
from references import llamagen_forward, load_llamagen as references_load, source as references_source

torch.set_grad_enabled(False)


@pytest.fixture(scope="module")
def c2i(c2i_engine):
    return c2i_engine


@pytest.fixture(scope="module")
def t2i(t2i_engine):
    return t2i_engine


def inputs(kind, n=3):
    if kind == "c2i":
        return dict(classes=list(range(1, n + 1)))
    caption, mask = captions(n)
    return dict(caption=caption, caption_mask=mask)


@pytest.mark.parametrize("kind", ["c2i", "t2i"])
@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_greedy_exact_equals_greedy_ar(request, kind, cfg):
    engine = Engine(request.getfixturevalue(kind), threads=2)
    ar = engine.generate(mode="ar", greedy=True, cfg_scale=cfg, **inputs(kind))
    exact = engine.generate(mode="exact", greedy=True, cfg_scale=cfg, **inputs(kind))
    np.testing.assert_array_equal(exact.tokens, ar.tokens)
    assert exact.stats["steps_per_image"] < ar.stats["steps_per_image"] or exact.stats["mean_accepted_drafts"] == 0
    lam1 = engine.generate(mode="lantern++", lam=1.0, k=8, greedy=True, cfg_scale=cfg, **inputs(kind))
    np.testing.assert_array_equal(lam1.tokens, ar.tokens)
    delta0 = engine.generate(mode="lantern", delta=0.0, k=8, greedy=True, cfg_scale=cfg, **inputs(kind))
    np.testing.assert_array_equal(delta0.tokens, ar.tokens)
    relaxed = engine.generate(mode="lantern++", lam=3.0, k=8, greedy=True, cfg_scale=cfg, **inputs(kind))
    assert relaxed.stats["mean_accepted_length"] >= exact.stats["mean_accepted_length"]


def test_a_run_time_tree_gives_the_same_greedy_tokens(c2i):
    engine = Engine(c2i, threads=2)
    ar = engine.generate(mode="ar", greedy=True, cfg_scale=2.0, **inputs("c2i"))
    for tree in ("chain-3", "kary-4-2", "naive_extend_57"):
        out = engine.generate(mode="exact", greedy=True, cfg_scale=2.0, tree=tree, **inputs("c2i"))
        np.testing.assert_array_equal(out.tokens, ar.tokens)


@pytest.mark.parametrize("step", ["host", "torch-device", "onnxruntime-device"])
def test_cfg_interval_switches_to_conditional_logits_at_its_index(request, step):
    """cfg_interval I: body tokens 0..I-1 from the CFG-combined logits, token I on from the
    conditional ones. The whole sequence must be the greedy decode of a full forward that
    switches at exactly I, on the host step and both device steps (each compares on its own:
    generator.combined_logits, the step graphs the torch step and ONNX Runtime run), and both
    device steps' sampling must draw what the host step draws."""
    I = 5
    cond = inputs("c2i")
    if step == "host":
        directory = request.getfixturevalue("c2i")
        engine = Engine(directory, threads=2, step="host")
    elif step == "torch-device":
        directory = request.getfixturevalue("c2i")
        engine = Engine(directory, backend=open_torch_backend(directory, threads=2), step="device")
    else:
        directory = request.getfixturevalue("c2i")
        engine = Engine(directory, threads=2, step="device")
    for mode in ("ar", "exact"):  # AR runs on its own step graphs on ONNX Runtime's device step
        out = engine.generate(mode=mode, greedy=True, cfg_scale=4.0, cfg_interval=I, **cond)
        assert out.stats["step"] == step.split("-")[-1]
        switched = llamagen_forward(directory, "c2i", out.tokens, cond, 4.0, cfg_from=I)[0]
        np.testing.assert_array_equal(out.tokens, switched.argmax(-1), err_msg=mode)
    # the boundary shows: at index I the CFG-combined argmax is another token for some image
    combined = llamagen_forward(directory, "c2i", out.tokens, cond, 4.0)[0]
    assert (combined[:, I].argmax(-1) != switched[:, I].argmax(-1)).any()
    if step != "host":  # its sampling rule combines on its own (accept_graphs.cfg_combined, float32): the host's draws
        kw = dict(mode="exact", temperature=1.0, top_k=20, cfg_scale=4.0, cfg_interval=I, seed=3, classes=list(range(10)))
        host = Engine(directory, threads=2, step="host").generate(**kw)
        np.testing.assert_array_equal(engine.generate(**kw).tokens, host.tokens)


def test_torch_backend_agrees_with_onnxruntime(c2i):
    ort_engine = Engine(c2i, threads=2)
    torch_engine = Engine(c2i, backend=open_torch_backend(c2i, threads=2))
    for mode in ("ar", "exact"):
        a = ort_engine.generate(mode=mode, greedy=True, cfg_scale=4.0, **inputs("c2i"))
        b = torch_engine.generate(mode=mode, greedy=True, cfg_scale=4.0, **inputs("c2i"))
        np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(ort_engine.decode(a.tokens), torch_engine.decode(a.tokens), atol=2)


def test_sampling_is_reproducible_and_seed_dependent(c2i):
    engine = Engine(c2i, threads=2)
    kw = dict(mode="lantern++", lam=2.0, k=8, temperature=1.0, top_k=20, top_p=0.95, cfg_scale=2.0, **inputs("c2i"))
    a = engine.generate(seed=7, **kw)
    b = engine.generate(seed=7, **kw)
    c = engine.generate(seed=8, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    # a 16-code VQ: the relaxed rules' neighbor table comes from its codebook
    return build_engine(tmp_path_factory.mktemp("v16"), "c2i", tree="kary-3-2", block_size=4, vocab=16,
                        extra=["--candidates", "8", "--neighbors-k", "4"])


@pytest.mark.parametrize("mode", ["ar", "exact"])
def test_exact_sampling_matches_the_target_distribution(small_vocab, mode):
    """Tokens 1 and 2 come from speculative steps: their conditional distributions given the
    earlier tokens must be the target's (chi-square goodness of fit, pooled over contexts)."""
    engine = Engine(small_vocab, threads=2)
    n = 3000
    cond = dict(classes=[2] * n)
    out = engine.generate(mode=mode, temperature=1.0, top_k=12, seed=11, cfg_scale=1.0, **cond)
    assert out.stats["mean_accepted_drafts"] > 0.2 or mode == "ar"
    logits = llamagen_forward(small_vocab, "c2i", out.tokens, cond, 1.0)[0]
    for t in (1, 2):
        contexts, first, which = np.unique(out.tokens[:, :t], axis=0, return_index=True, return_inverse=True)
        which = which.ravel()
        observed = np.stack([np.bincount(out.tokens[which == c, t], minlength=16) for c in range(len(contexts))])
        p = filtering.filtered_probs(logits[first, t], 1.0, 12, 1.0)
        assert observed[p == 0].sum() == 0  # never a token the target filtered out
        chi2, dof = pooled_chi2(observed, p)
        assert stats.chi2.sf(chi2, dof) > 1e-3, (t, chi2, dof)


def first_step_spec(engine, directory, class_id, tokens0, logits1, rule, sampling, draws, seed=0):
    """The numpy specification's (lantern.runtime.accept) first speculative step of class
    class_id (no CFG), draws times per context: the distribution of body token 1 given token 0
    as counts [contexts, V]. The target
    is the full forward's logits1 [contexts, V]; q the drafter's top-K at the root, computed
    here from the drafter checkpoint over the pair (h_prefix, token 0) at token 0's position;
    the root's children drawn from q without replacement (sequentially), as acceptance assumes.
    Token 1 is the first accepted child's token, else the residual draw at the root."""
    target = references_load(directory)
    s = references_source(directory, "drafter")
    drafter = checkpoints.load_drafter(s["path"], target.args)[0].float().eval()
    K, width = engine.manifest.candidates, engine.tree.levels[0].width
    tree = build_tree(f"kary-{width}-1")
    rng = np.random.default_rng(seed)
    V = logits1.shape[-1]
    counts = np.zeros((len(tokens0), V), dtype=np.int64)
    for c, (x0, row) in enumerate(zip(tokens0, logits1)):
        hidden = target(target.embed_condition(torch.tensor([class_id])), torch.zeros(1, 1, dtype=torch.long),
                        torch.ones(1, 1, 1, 1, dtype=torch.bool), *target.empty_cache(1))[1]
        h = drafter(hidden, torch.tensor([[x0]]), torch.ones(1, 1, dtype=torch.long),
                    torch.ones(1, 1, 1, 1, dtype=torch.bool), *drafter.empty_cache(1), target.rope)[0]
        values, ids = torch.topk(target.output(h)[0, 0].float(), K)
        q = torch.softmax(values / sampling["temperature"], -1).double().numpy()
        children = np.empty((draws, width), dtype=np.int64)
        left = np.broadcast_to(q, (draws, K)).copy()
        for r in range(width):  # sequential draws without replacement
            pick = (rng.random((draws, 1)) * left.sum(1, keepdims=True) > np.cumsum(left, 1)).sum(1)
            children[:, r] = ids.numpy()[pick]
            left[np.arange(draws), pick] = 0
        tokens = np.concatenate([np.full((draws, 1), x0), children], axis=1)
        logits = np.broadcast_to(row, (draws, width + 1, V))
        draft_ids = np.broadcast_to(ids.numpy(), (draws, width + 1, K))
        draft_probs = np.broadcast_to(q, (draws, width + 1, K))
        out = acceptance.accept_sampling_batch(tree, tokens, logits, draft_ids, draft_probs, rule,
                                               rng.random((draws, width + 1)), engine.neighbors, **sampling)
        first = np.where(out.accepted > 0, tokens[np.arange(draws), np.maximum(out.path[:, 1], 0)], out.next_token)
        counts[c] = np.bincount(first, minlength=V)
    return counts


def pooled_chi2(observed, reference):
    """Chi-square over contexts: are observed counts [contexts, V] drawn from reference, given as
    probabilities [contexts, V] (goodness of fit) or as counts of other draws (two-sample)?
    Per context, cells whose expected observed count is < 5 are pooled into one. Returns
    (statistic, degrees of freedom)."""
    chi2, dof = 0.0, 0
    for o, r in zip(observed, reference):
        if o.sum() == 0:
            continue
        counts = not np.issubdtype(r.dtype, np.floating)
        e = (o + r) * o.sum() / (o.sum() + r.sum()) if counts else r * o.sum()
        big = e >= 5
        table = np.stack([np.append(o[big], o[~big].sum()), np.append(r[big], r[~big].sum())])
        table = table[:, table.sum(0) > 0]
        if table.shape[1] < 2:
            continue
        if counts:
            chi2 += stats.chi2_contingency(table, correction=False)[0]
        else:  # an observed token of reference probability 0 makes the statistic infinite
            expected = table[1] * o.sum()
            with np.errstate(divide="ignore"):
                chi2 += ((table[0] - expected) ** 2 / expected).sum()
        dof += table.shape[1] - 1
    return chi2, dof


@pytest.mark.parametrize("mode, extra", [("lantern++", dict(lam=3.0, k=4)), ("lantern", dict(delta=0.3, k=4))])
def test_relaxed_sampling_matches_the_specification(small_vocab, mode, extra):
    """Body token 1 comes from the first speculative step; given token 0 its distribution must be
    the one the numpy specification gives from the full forward's target and the drafter's q
    (two-sample chi-square against 20000 draws of the spec per context), and not the target's
    own distribution (the relaxation acts: the same test against the target fails)."""
    engine = Engine(small_vocab, threads=2)
    n, sampling = 3000, dict(temperature=1.0, top_k=12, top_p=1.0)
    cond = dict(classes=[2] * n)
    out = engine.generate(mode=mode, seed=11, cfg_scale=1.0, **extra, **sampling, **cond)
    assert out.stats["mean_accepted_drafts"] > 0.2
    logits = llamagen_forward(small_vocab, "c2i", out.tokens, cond, 1.0)[0]
    contexts, first = np.unique(out.tokens[:, 0], return_index=True)
    observed = np.stack([np.bincount(out.tokens[out.tokens[:, 0] == c, 1], minlength=16) for c in contexts])
    spec = first_step_spec(engine, small_vocab, 2, contexts, logits[first, 1], acceptance.rule_for(mode, **extra),
                           sampling, draws=20000)
    chi2, dof = pooled_chi2(observed, spec)
    assert stats.chi2.sf(chi2, dof) > 1e-3, (chi2, dof)
    chi2, dof = pooled_chi2(observed, filtering.filtered_probs(logits[first, 1], 1.0, 12, 1.0))
    assert stats.chi2.sf(chi2, dof) < 1e-6, (chi2, dof)


def test_cli_generate_writes_outputs(c2i, tmp_path, capsys):
    out = tmp_path / "gen"
    assert run_main(["generate", c2i, "--mode", "lantern++", "--lam", "2", "--k", "8", "--cfg-scale", "4", "--classes", "3,7",
                     "--seed", "1", "--threads", "2", "--out", str(out)]) == 0
    tokens = np.load(out / "tokens.npy")
    assert tokens.shape == (2, 36)
    s = json.loads((out / "stats.json").read_text())
    for key in ("steps_per_image", "mean_accepted_length", "tokens_per_second", "phase_seconds"):
        assert key in s
    assert set(s["phase_seconds"]) >= {"draft", "verify", "accept", "commit"}
    assert (out / "image_000.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean accepted length" in capsys.readouterr().out


def test_cli_bad_input_writes_nothing(c2i, t2i, tmp_path, capsys):
    out = tmp_path / "never"
    bad_caption = tmp_path / "cap.npy"
    np.save(bad_caption, np.zeros((1, 5, 24), dtype=np.float32))
    cases = [
        (["generate", c2i, "--classes", "3,99"], "class labels must be in [0, 9]"),
        (["generate", t2i, "--caption", str(bad_caption)], "caption features must be [N, 6, 24]"),
        (["generate", c2i, "--classes", "1", "--mode", "lantern++", "--lam", "0.5"], "lam"),
        (["generate", str(tmp_path / "nope"), "--classes", "1"], "no such engine directory"),
        (["generate", c2i, "--classes", "1", "--tree", "kary-20-2"], "re-export with --candidates 20"),
        (["generate", c2i, "--classes", "1", "--tree", "no_such_tree"], "no_such_tree"),
    ]
    for argv, message in cases:
        assert run_main(argv + ["--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not out.exists()


def test_damaged_engine_directories_are_refused(c2i, tmp_path):
    def copy():
        d = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(c2i, d)
        return d

    d = copy()
    os.remove(d / "drafter.onnx")
    with pytest.raises(LanternError, match="drafter.onnx is missing"):
        Engine(d)
    d = copy()
    data = bytearray((d / "condition.onnx").read_bytes())
    data[-1] ^= 1
    (d / "condition.onnx").write_bytes(bytes(data))
    Engine(d, verify=False)  # same size: only a hash check catches it, and it is on by default
    with pytest.raises(LanternError, match="sha256"):
        Engine(d)
    d = copy()
    m = json.loads((d / "manifest.json").read_text())
    m["schema"] = 99
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(LanternError, match="engine schema 99 is not the supported"):
        Engine(d)


def test_ar_only_engine(c2i, tmp_path):
    """An engine without a drafter: the c2i engine's condition and target graphs with the drafter
    and VQ decoder struck from its manifest and removed (an AR-only export itself is
    test_export's bf16 test)."""
    d = strike_drafter(shutil.copytree(c2i, tmp_path / "ar"))
    engine = Engine(d, threads=2)
    assert engine.generate(mode="ar", greedy=True, classes=[1]).tokens.shape == (1, 36)
    with pytest.raises(LanternError, match="serves modes ar, not 'exact'"):
        engine.generate(mode="exact", classes=[1])


def test_generation_runs_without_torch(c2i, tmp_path):
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from lantern.runtime.cli import main\n"
        f"rc = main(['generate', {c2i!r}, '--classes', '1,2', '--cfg-scale', '3', '--threads', '2', '--out', {str(tmp_path / 'o')!r}])\n"
        "assert 'torch' not in sys.modules\n"
        "sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "image_001.png").exists()
