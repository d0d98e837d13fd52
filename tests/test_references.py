"""Greedy tokens of every mode against an independent reference: one causal PyTorch forward of the
checkpoint each engine was exported from (tests/references.py), per family (LlamaGen c2i and
t2i, Anole, Lumina-mGPT with its forced tokens), on the host step (ONNX Runtime) and the torch
backend's whole device step. The paired tests (host vs device, ORT vs torch, batch vs alone)
cannot see a bug both sides share; this can: every token the engine chose itself is the full
forward's exact argmax, every draft a relaxed rule accepted passes that rule against the full
forward's logits. The tiny models are peaked (tests/tiny.py), so a position, mask or CFG slip
changes argmaxes (tests/test_canary.py)."""
import numpy as np
import pytest
import torch

from engines import captions
from lantern.export.torch_backend import open_torch_backend
from lantern.runtime import accept as acceptance
from lantern.runtime import chameleon_prompts as prompts
from lantern.runtime.generator import Engine
from references import chameleon_forward, draft_mask, FIRST_IMAGE_ID, greedy_violations, llamagen_drafts, \
    llamagen_forward

torch.set_grad_enabled(False)

MODES = [("ar", {}), ("exact", {}), ("lantern", dict(delta=0.1, k=8)), ("lantern++", dict(lam=3.0, k=8))]
CFG = 4.0
GRID = (4, 4)  # Chameleon engines: a 4x4 latent grid (Lumina: 21 body tokens with its forced ones)


def conditions(family):
    if family == "c2i":
        return dict(classes=[1, 2, 3])
    if family == "t2i":
        caption, mask = captions(3)
        return dict(caption=caption, caption_mask=mask)
    return dict(prompt=["a red cat", "a dog on a mat"], grid=GRID)


def open_engine(request, family, step):
    directory = request.getfixturevalue(f"{family}_engine") if family in ("c2i", "t2i") else \
        request.getfixturevalue("chameleon_engines")[family]
    if step == "host":
        return Engine(directory, threads=2, step="host")
    return Engine(directory, backend=open_torch_backend(directory, threads=2), step="device")


def generate(engine, mode, extra, cond):
    records = []
    out = engine.generate(mode=mode, greedy=True, cfg_scale=CFG, observer=records.append, **extra, **cond)
    return out, records


def check(engine, family, mode, extra, cond):
    """Generate greedily in one mode; the violations against the reference and the run's
    accepted drafts [N, T] bool, with the tokens as the reference's columns."""
    out, records = generate(engine, mode, extra, cond)
    if family in ("c2i", "t2i"):
        codes, skip = out.tokens, None
        logits = llamagen_forward(engine.directory, family, codes, cond, CFG)[0]
    else:  # body ids (forced tokens included) as image codes; forced indices are checked apart
        forced = prompts.forced_tokens(family, GRID)
        np.testing.assert_array_equal(out.body[:, forced >= 0], np.broadcast_to(forced[forced >= 0],
                                                                                out.body[:, forced >= 0].shape))
        codes, skip = np.where(forced >= 0, 0, out.body - FIRST_IMAGE_ID), forced >= 0
        logits = chameleon_forward(engine, out.body, CFG, **cond)
    drafts = draft_mask(records, codes.shape[1]) if mode != "ar" else np.zeros(codes.shape, dtype=bool)
    rule = acceptance.rule_for(mode, **extra) if mode != "ar" else None
    bad = greedy_violations(codes, logits, drafts, rule, engine.neighbors, skip)
    return bad, drafts, codes, logits


@pytest.mark.parametrize("family, step", [("c2i", "host"), ("c2i", "device"), ("t2i", "host"), ("t2i", "device"),
                                          ("anole", "host"), ("lumina_mgpt", "host"), ("lumina_mgpt", "device")])
def test_greedy_tokens_of_every_mode_match_a_full_forward(request, family, step):
    engine = open_engine(request, family, step)
    cond = conditions(family)
    accepted = relaxed_drafts = 0
    for mode, extra in MODES:
        bad, drafts, codes, logits = check(engine, family, mode, extra, cond)
        assert not bad, (mode, bad[:5])
        accepted += int(drafts.sum())
        if mode in ("lantern", "lantern++"):  # drafts the relaxed rule took that the target would not have chosen
            relaxed_drafts += int((drafts & (codes != logits.argmax(-1))).sum())
    assert accepted > 0  # steps committed accepted drafts
    # the relaxed branch of the check really ran (Chameleon: 8 latent neighbors among 8192 random
    # codes hold too little of a peaked target's mass for the rules to relax anything)
    assert relaxed_drafts > 0 or family in ("anole", "lumina_mgpt")


def test_the_reference_check_rejects_wrong_tokens(c2i_engine):
    """Negative controls: the check must fail for a bonus token that is not the argmax, for an
    accepted draft that the relaxed rule would refuse, and for random tokens (the check it
    replaces accepted those at lam 3 on the old near-uniform models)."""
    engine = Engine(c2i_engine, threads=2)
    cond = conditions("c2i")
    mode, extra = MODES[3]
    bad, drafts, codes, logits = check(engine, "c2i", mode, extra, cond)
    assert not bad
    rule = acceptance.rule_for(mode, **extra)

    def violations(tokens):
        return greedy_violations(tokens, llamagen_forward(c2i_engine, "c2i", tokens, cond, CFG)[0], drafts, rule,
                                 engine.neighbors)

    n, t = np.argwhere(~drafts[:, 1:])[0] + [0, 1]  # a token the engine chose itself
    runner_up = codes.copy()
    runner_up[n, t] = np.argsort(logits[n, t])[-2]
    assert (n, t) in [(i, j) for i, j, _ in violations(runner_up)]
    n, t = np.argwhere(drafts)[0]  # an accepted draft
    worst = codes.copy()
    worst[n, t] = np.argmin(logits[n, t])
    assert (n, t) in [(i, j) for i, j, _ in violations(worst)]
    random = np.random.default_rng(0).integers(0, logits.shape[-1], size=codes.shape)
    assert len(violations(random)) > codes.size // 2


@pytest.mark.parametrize("family, step", [("c2i", "host"), ("c2i", "device"), ("t2i", "host")])
def test_drafts_match_a_full_drafter_forward(request, family, step):
    """Drafts do not change greedy exact tokens, so the token references cannot see a slip in
    the draft phase (draft0's pairs, positions, hidden states; the deeper drafter calls). This
    pins the first two depths: in greedy exact a step accepts a draft exactly when the target's
    next token is one of the root's children, and two when the token after it is one of that
    child's children, each node's children being the candidates of the ranks the tree gives it
    from a drafter forward over every committed pair (tests/references.py: llamagen_drafts)."""
    engine = open_engine(request, family, step)
    cond = conditions(family)
    records = []
    out = engine.generate(mode="exact", greedy=True, cfg_scale=1.0, observer=records.append, **cond)
    tokens, tree = out.tokens, engine.tree
    hidden = llamagen_forward(engine.directory, family, tokens, cond, 1.0)[1]
    depth1, depth2 = (np.argsort(-logits, axis=-1, kind="stable") for logits in
                      llamagen_drafts(engine.directory, tokens, hidden))

    def child(node, ranking, token):  # the child of node holding token, or -1
        rank = int(np.flatnonzero(ranking == token)[0])
        return tree.child_at[node, rank] if rank < tree.child_at.shape[1] else -1

    logits1, logits2 = llamagen_drafts(engine.directory, tokens, hidden)
    lv1, lv2 = tree.levels[0], tree.levels[1]

    def same_rank(logits, drafted, ranks):  # each draft is the reference's candidate of its rank (ties aside)
        best = np.sort(logits)[::-1][ranks]
        return np.abs(logits[drafted] - best) <= 1e-4 * max(1.0, np.abs(best).max())

    count, hits, checked = np.ones(len(tokens), dtype=np.int64), [0, 0], 0
    for r in records:
        for n in np.flatnonzero(r.active):
            root = count[n] - 1
            # the drafts themselves, rank by rank, against the full drafter forward: a slip in the
            # draft phase (positions, pairs, masks) changes candidates before it changes acceptance
            assert r.tokens[n, 0] == tokens[n, root]
            assert same_rank(logits1[n, root], r.tokens[n, lv1.nodes], lv1.ranks).all(), (n, root)
            truth = lv1.nodes[r.tokens[n, lv1.nodes] == tokens[n, root + 1]]
            if truth.size and root + 2 < tokens.shape[1]:
                below = lv2.nodes[lv2.parents == truth[0]]
                assert same_rank(logits2[n, root], r.tokens[n, below], tree.ranks[below]).all(), (n, root)
                checked += 1
            node = child(0, depth1[n, root], tokens[n, root + 1])
            assert (r.accepted[n] >= 1) == (node >= 0), (n, root, r.accepted[n])
            if node >= 0 and root + 2 < tokens.shape[1]:
                deeper = child(node, depth2[n, root], tokens[n, root + 2])
                assert (r.accepted[n] >= 2) == (deeper >= 0), (n, root, r.accepted[n])
                hits[1] += deeper >= 0
            hits[0] += node >= 0
            count[n] += r.accepted[n] + 1
    assert hits[0] > 0 and hits[1] > 0 and checked > 0  # steps accepted drafts at both depths
