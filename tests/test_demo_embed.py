"""The demo model embedded exactly in a larger shape (lantern.export.embed): the same function, in
PyTorch on GPT-B itself, and the same tokens and images through real engines on a smaller shape
that is wider, deeper and has a larger vocabulary than the demo."""
import numpy as np
import pytest
import torch

from lantern.export import checkpoints, embed, llamagen
from lantern.export.onnx_export import export_engine
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.tools import export_cli, gpu_check

# wider heads (64 = 2 x the demo's 32: queries rescaled, RoPE pairs moved), a wider stream and FFN,
# more layers and ids than the demo; few enough weights to export in seconds
SMALL = dict(n_layer=5, n_head=6, dim=384, vocab_size=1024)


@pytest.fixture(scope="module")
def demo():
    src = embed.demo_sources(embed.DEMO_DIR)
    target, _ = checkpoints.load_target(src["target"], config_file=src["target_config"])
    drafter, _ = checkpoints.load_drafter(src["drafter"], target.args)
    return target, drafter


def teacher_forced(model, drafter, classes, ids):
    """Target logits and hidden states over [condition, ids[:-1]], and the drafter's logits on
    each (h_t, x_{t+1}) pair, as the engine feeds them."""
    B, T = ids.shape
    x = torch.cat([model.embed_condition(classes), model.embed_tokens(ids[:, :-1])], 1)
    pos = torch.arange(T)[None].expand(B, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    with torch.no_grad():
        logits, hidden, *_ = model(x, pos, mask, *model.empty_cache(B))
        h, *_ = drafter(hidden[:, :-1], ids[:, :-1], pos[:, 1:], mask[:, :, 1:, 1:], *drafter.empty_cache(B),
                        model.rope)
        return logits, hidden, model.output(h).float()


def test_gpt_b_computes_what_the_demo_computes(demo):
    target, drafter = demo
    args = embed.embedded_config(target.args, "GPT-B")
    assert (args.dim, args.n_layer, args.n_head, args.head_dim, args.ffn_hidden, args.vocab_size, args.codes) \
        == (768, 12, 12, 64, 2048, 16384, 256)
    big, big_drafter = embed.embed_target(target, args), embed.embed_drafter(drafter, target.args, args)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 64), generator=gen)
    classes = torch.tensor([7, target.null_class])  # the null class: CFG's unconditional half
    want = teacher_forced(target, drafter, classes, ids)
    got = teacher_forced(big, big_drafter, classes, ids)
    logits, hidden, draft = want
    assert torch.allclose(got[0][..., :256], logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[0][..., :256].argmax(-1), logits.argmax(-1))
    assert torch.all(got[0][..., 256:] == 0)  # the ids past the codes: computed, zero, never sampled
    assert torch.allclose(got[1][..., :192], hidden, atol=1e-4, rtol=1e-4)
    assert torch.all(got[1][..., 192:] == 0)
    assert torch.allclose(got[2][..., :256], draft, atol=1e-4, rtol=1e-4)
    # the same top-20 candidates up to near-ties: matmuls of other widths round differently, so
    # two drafts within rounding of each other may swap ranks (seen on a CI run), never more
    top = draft.topk(20)
    picked = draft.gather(-1, got[2][..., :256].topk(20).indices)
    assert torch.allclose(picked, top.values, atol=1e-4, rtol=1e-4)
    assert (got[2][..., :256].topk(20).indices == top.indices).float().mean() > 0.99


def test_rope_pairs_move_to_the_pairs_of_equal_frequency(demo):
    target, _ = demo
    pos = embed.positions(target.args, embed.embedded_config(target.args, "GPT-B"))
    # a 32-wide head: pairs 0..7 rotate with the row, 8..15 with the column, frequency base^(-i/8);
    # a 64-wide head's pair 2i of each half (16 pairs) has base^(-2i/16)
    pairs = [2 * i for i in range(8)] + [16 + 2 * i for i in range(8)]
    assert pos.tolist() == [2 * p + e for p in pairs for e in (0, 1)]
    small = llamagen.rope_table(target.args)
    large = llamagen.rope_table(embed.embedded_config(target.args, "GPT-B"))
    assert torch.allclose(large[:, pairs], small, atol=1e-6)


def test_shapes_that_cannot_hold_the_demo_are_refused(demo, tmp_path, capsys):
    target, _ = demo
    for shape in ("GPT-L", "GPT-XL"):
        assert embed.embedded_config(target.args, shape).codes == 256
    with pytest.raises(LanternError, match="head width 100 is not a multiple of the demo's 32"):
        embed.embedded_config(target.args, "GPT-3B")
    with pytest.raises(LanternError, match="heads 4 < 6"):
        embed.embedded_args(target.args, n_layer=4, n_head=4, dim=256)
    with pytest.raises(LanternError, match="layers 2 < 4"):
        embed.embedded_args(target.args, n_layer=2, n_head=6, dim=384)
    with pytest.raises(LanternError, match="image_codes 300 exceeds vocab_size 256"):
        llamagen.validate_config(llamagen.ModelArgs(dim=64, n_layer=1, n_head=2, vocab_size=256, image_codes=300,
                                                    block_size=16))
    out = tmp_path / "engine"
    assert export_cli.main(["demo", "--shape", "GPT-3B", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "GPT-3B cannot hold the demo model exactly" in err
    assert not out.exists() and not (tmp_path / "engine-checkpoints").exists()


@pytest.fixture(scope="module")
def embedded_engine(tmp_path_factory, graph_cache):
    root = tmp_path_factory.mktemp("embedded")
    src = embed.write_embedded(embed.DEMO_DIR, SMALL, root / "checkpoints")
    export_engine(root / "engine", src["target"], target_options={"config_file": src["target_config"]},
                  drafter=src["drafter"], vq=src["vq"], graph_cache=graph_cache)  # the demo's VQ decoder: cached
    return root / "engine"


def test_engine_records_the_image_codes(embedded_engine):
    m = Engine(embedded_engine).manifest
    assert (m.vocabulary.size, m.vocabulary.image_start, m.vocabulary.image_end) == (1024, 0, 256)
    assert m.candidates == 256  # the drafter's top-K spans the codes, as the demo's does
    assert (m.target.dim, m.target.layers, m.target.head_dim) == (384, 5, 64)


@pytest.mark.parametrize("mode", ["ar", "exact", "lantern++"])
def test_engines_decode_the_demos_tokens(demo_engine, embedded_engine, mode):
    small, big = Engine(demo_engine), Engine(embedded_engine)
    tree = {} if mode == "ar" else {"tree": "mc_sim_7b_63"}
    common = dict(mode=mode, classes=[0, 14], cfg_scale=3.0, **tree)
    greedy = [e.generate(greedy=True, **common).tokens for e in (small, big)]
    assert np.array_equal(*greedy)
    for seed in (0, 5):
        a, b = (e.generate(seed=seed, **common) for e in (small, big))
        assert np.array_equal(a.tokens, b.tokens)
    assert np.array_equal(small.decode(a.tokens), big.decode(b.tokens))


def test_gpu_check_refuses_a_shape_that_cannot_hold_the_demo(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--demo-shape", "GPT-3B", "--device", "cpu"])
    assert e.value.code == 2 and "GPT-3B cannot hold the demo model exactly" in capsys.readouterr().err


def test_the_grid_in_calls_of_a_batch_is_the_grid_in_one_call(demo_engine):
    """`demo --batch`: images keep their seeds across calls, so the tokens are one call's; the
    stats add up over the calls."""
    from lantern.tools.demo import generate_batches

    engine = Engine(demo_engine)
    kw = dict(classes=[0, 3, 6, 9, 12], seed=4, mode="exact", tree="chain-2", cfg_scale=3.0)
    whole = generate_batches(engine, None, **kw)
    parts = generate_batches(engine, 2, **kw)
    assert np.array_equal(whole.tokens, parts.tokens)
    assert parts.stats["images"] == 5 and parts.stats["batch"] == 2
    assert parts.stats["steps_per_image"] == pytest.approx(whole.stats["steps_per_image"])
    assert sum(parts.stats["accepted_histogram"]) == sum(whole.stats["accepted_histogram"])
