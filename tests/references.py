"""Independent references for generated tokens: one causal PyTorch forward of the reference model
(the checkpoint the engine was exported from) over the finished sequences, written here from the
models' documented rules (positions, masks, CFG, forced tokens), not from the decoding loop.

Greedy decoding is then checked token by token (greedy_violations): a token the engine chose
itself must be the argmax of the full forward's logits at its index (ties to the lowest id), a
draft the relaxed rule accepted must pass that rule against the same logits. Which tokens were
accepted drafts comes from the loop's StepRecords (draft_mask)."""
import json
import os

import numpy as np
import torch

from lantern.export import chameleon_checkpoints, checkpoints
from lantern.runtime import accept as acceptance
from lantern.runtime import chameleon_prompts as prompts
from lantern.runtime.tree import build_tree

FIRST_IMAGE_ID, IMAGE_CODES = 4, 8192  # Chameleon: image token id = code + 4


def source(engine_dir, role="target"):
    with open(os.path.join(engine_dir, "manifest.json")) as f:
        return json.load(f)["sources"][role]


def llamagen_forward(engine_dir, kind, tokens, cond, cfg, shift=0, cfg_from=None):
    """LlamaGen: logits [N, T, V] per image token (row t predicts token t) and the conditional
    rows' hidden states before them [N, T, D], over the finished sequences tokens [N, T].
    CFG-combined (uncond + cfg * (cond - uncond)) when cfg > 1, the conditional logits alone from
    index cfg_from on. shift: the image tokens' positions moved by that many rows of the table
    (the position canary)."""
    model = load_llamagen(engine_dir)
    N, T = tokens.shape
    if kind == "c2i":
        c = torch.tensor(cond["classes"])
        cond_in = torch.cat([c, model.unconditional(N)]) if cfg > 1 else c
    else:
        cap = torch.from_numpy(cond["caption"] * cond["caption_mask"][..., None])
        cond_in = torch.cat([cap, model.unconditional(N)]) if cfg > 1 else cap
    B = len(cond_in)
    toks = torch.from_numpy(np.asarray(tokens)).repeat(B // N, 1)
    with torch.no_grad():
        embeds = torch.cat([model.embed_condition(cond_in), model.embed_tokens(toks[:, :-1])], dim=1)
        L, cls = embeds.shape[1], model.args.cls_token_num
        mask = torch.tril(torch.ones(L, L, dtype=torch.bool)).expand(B, L, L).clone()
        if kind == "t2i":  # padded caption rows are hidden keys (both halves), every token sees itself
            key_ok = torch.from_numpy(cond["caption_mask"]).repeat(B // N, 1)
            mask[:, :, :cls] &= key_ok[:, None, :]
            mask |= torch.eye(L, dtype=torch.bool)
        pos = torch.arange(L).expand(B, L).clone()
        pos[:, cls:] = (pos[:, cls:] + shift).clamp(max=model.rope.shape[0] - 1)
        logits, hidden = model(embeds, pos, mask[:, None], *model.empty_cache(B))[:2]
    logits, hidden = logits[:, cls - 1:].numpy(), hidden[:N, cls - 1:].numpy()
    if cfg > 1:
        c, u = logits[:N], logits[N:]
        combined = u + np.float32(cfg) * (c - u)
        if cfg_from is not None:
            combined[:, cfg_from:] = c[:, cfg_from:]
        logits = combined
    return logits, hidden


_MODELS = {}


def load_llamagen(engine_dir):
    s = source(engine_dir)
    key = (s["path"], json.dumps(s.get("options", {}), sort_keys=True))
    if key not in _MODELS:
        _MODELS[key] = checkpoints.load_target(s["path"], None, **s["options"])[0].float().eval()
    return _MODELS[key]


def llamagen_drafts(engine_dir, tokens, hidden):
    """LlamaGen drafter logits over the finished sequences tokens [N, T] (no CFG), through the
    target's head, at the first two depths of a step whose root is token j:
      depth 1 [N, T, V], row j: from the pairs (h_{i-1}, token i), i <= j, each at its token's
        position (the drafter's cache holds every committed pair, DESIGN.md) -> token j + 1;
      depth 2 [N, T - 1, V], row j: from those pairs and (d_j, token j + 1) at token j + 1's
        position, d_j the drafter's own output at pair j (EAGLE feeds a draft its parent's
        drafter state) -> token j + 2.
    hidden [N, T, D]: the full forward's target hidden states (llamagen_forward), row j the one
    before token j."""
    target = load_llamagen(engine_dir)
    s = source(engine_dir, "drafter")
    drafter = checkpoints.load_drafter(s["path"], target.args)[0].float().eval()
    N, T = tokens.shape
    tokens = torch.from_numpy(np.asarray(tokens))
    pos = torch.arange(T).expand(N, T) + target.args.cls_token_num
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    with torch.no_grad():
        first = drafter(torch.from_numpy(hidden), tokens, pos, causal.expand(N, 1, T, T), *drafter.empty_cache(N),
                        target.rope)[0]
        # one call: the T committed pairs, then T - 1 depth-2 pairs, each seeing pairs 0..j and itself
        mask = torch.zeros(2 * T - 1, 2 * T - 1, dtype=torch.bool)
        mask[:T, :T] = causal
        mask[T:, :T - 1] = causal[:-1, :-1]
        mask[T:, T:] = torch.eye(T - 1, dtype=torch.bool)
        second = drafter(torch.cat([torch.from_numpy(hidden), first[:, :-1]], 1), torch.cat([tokens, tokens[:, 1:]], 1),
                         torch.cat([pos, pos[:, 1:]], 1), mask.expand(N, 1, 2 * T - 1, 2 * T - 1),
                         *drafter.empty_cache(N), target.rope)[0][:, T:]
        return target.output(first).float().numpy(), target.output(second).float().numpy()


def chameleon_forward(engine, body, cfg, shift=0, **request):
    """Anole / Lumina-mGPT: logits [N, T, 8192] over the image codes for every index of body
    [N, T] (the ids a generation made for request, its prompt= and grid=; row t predicts body
    token t), CFG-combined. Rows as chameleon_prompts
    documents them (the engine's condition adapter builds them; test_chameleon_engine checks
    them against the public code): prompt keys visible where not padding, every token sees
    itself, body tokens continue each row's positions from its count of visible prompt tokens.
    shift: the body tokens' positions moved by that much (the position canary)."""
    s = source(engine.directory)
    key = (s["path"], "chameleon")
    if key not in _MODELS:
        _MODELS[key] = chameleon_checkpoints.load_target(s["path"])[0].float().eval()
    model = _MODELS[key]
    prefix = engine.condition.prefix(cfg > 1, **request)
    N, (B, C) = len(body), prefix.ids.shape
    ids = np.concatenate([prefix.ids, np.tile(body, (B // N, 1))[:, :-1]], axis=1)  # [cond rows; uncond rows]
    L = ids.shape[1]
    start = prefix.key_visible.sum(axis=1)  # the first body token's position per row
    positions = np.concatenate([prefix.positions, start[:, None] + shift + np.arange(L - C)[None, :]], axis=1)
    visible = np.concatenate([prefix.key_visible, np.ones((B, L - C), dtype=bool)], axis=1)
    mask = (np.tril(np.ones((L, L), dtype=bool))[None] & visible[:, None, :]) | np.eye(L, dtype=bool)[None]
    with torch.no_grad():
        logits = model(torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(mask[:, None]),
                       *model.empty_cache(B, dtype=torch.float32))[0]
    logits = logits[:, C - 1:, FIRST_IMAGE_ID:FIRST_IMAGE_ID + IMAGE_CODES].numpy()
    if cfg > 1:
        c, u = logits[:N], logits[N:]
        logits = u + np.float32(cfg) * (c - u)
    return logits


def draft_mask(records, length, first=1):
    """[N, length] bool from the StepRecords of one generation: True at the body indices whose
    token was an accepted draft. Index 0 comes from prefill; each step then emits its accepted
    drafts and one token of its own (the bonus), cut at the end."""
    N = len(records[0].active)
    drafts = np.zeros((N, length), dtype=bool)
    count = np.full(N, first)
    for r in records:
        for n in np.flatnonzero(r.active):
            a = int(r.accepted[n])
            drafts[n, count[n]: min(count[n] + a, length)] = True
            count[n] = min(count[n] + a + 1, length)
    assert (count == length).all(), "the records do not account for every token"
    return drafts


def greedy_violations(codes, logits, drafts, rule=None, neighbors=None, skip=None):
    """(image, index, why) for every token that breaks greedy decoding against the reference
    logits: codes [N, T] (the columns of logits [N, T, V]); drafts [N, T] bool: accepted drafts,
    which must pass `rule` (acceptance's relaxed test, as one node of a chain) instead of being
    the argmax; skip [T] bool: indices not checked (forced tokens)."""
    chain = build_tree("chain-1")
    bad = []
    for n, t in np.ndindex(codes.shape):
        if skip is not None and skip[t]:
            continue
        x, best = int(codes[n, t]), int(np.argmax(logits[n, t]))
        if not drafts[n, t]:
            if x != best:
                bad.append((n, t, f"token {x}, argmax {best} (gap {logits[n, t, best] - logits[n, t, x]:.3g})"))
            continue
        if rule is None:
            bad.append((n, t, "an accepted draft where nothing relaxes"))
            continue
        rows = np.stack([logits[n, t], logits[n, t]])  # the root's row decides the node
        if acceptance.accept_greedy(chain, [best, x], rows, rule, neighbors).accept_length != 1:
            bad.append((n, t, f"draft {x} fails {rule.name} against argmax {best}"))
    return bad
