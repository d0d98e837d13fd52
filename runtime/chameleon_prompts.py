"""How the Chameleon-family models (Anole, Lumina-mGPT) form their input rows: pure numpy
functions for a condition adapter (no torch, no tokenizer: text comes in as token ids).

The public code each rule follows, file: function (jadohu/LANTERN unless said otherwise;
REFERENCE.md §5.3-5.4):

Anole  (models/ea_model_anole.py: EaModel.generate, tree_decoding;
        models/kv_variants/modeling_anole_kv.py: ChameleonForConditionalGeneration.generate)
  cond    [BOS 0] + prompt ids + [END_OF_TURN 8710, IMAGE_START 8197]; the prompt is the raw
          text, no template (entrypoints/generate_images.py)
  uncond  [PAD 1] * (L - 2) + [BOS 0, IMAGE_START 8197], i.e. [0, 8197] left-padded
  batch   rows left-padded with PAD 1 to the longest; keys visible where id != PAD
  positions  cond 0..L-1, uncond 0,...,0,1; new tokens continue each row (cond L.., uncond 2..)
  body    exactly 32 x 32 = 1024 image tokens, nothing forced, no end-of-line or end-of-image
Lumina-mGPT  (Alpha-VLLM/Lumina-mGPT generate_examples/generate.py, data/item_processor.py:
        get_n_grids_token, decode_image, inference_solver.py: MultiModalLogitsProcessor,
        LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor;
        LANTERN models/ea_model_lumina_mgpt.py: generate, tree_decoding)
  cond    [BOS 0] + ids("Generate an image of {W}x{H} according to the following prompt:\\n{prompt}")
          + [END_OF_TURN 8710] (conversation.py: the turn separator <reserved08706>)
          + [IMAGE_START 8197, h_token, w_token], h/w_token = <reserved{8800 + n}> = id 8804 + n,
          n = pixels / 32 = latent rows (columns) / 2. EaModel and the parallel base append the
          three grid tokens to the prompt; so does this module (so CFG, which Lumina starts once
          the grid tokens exist, applies to every body token)
  uncond  the ids from the last IMAGE_START on: [8197, h_token, w_token], positions from 0
          (batched like Lumina's parallel CFG mode: left-padded, pads invisible)
  body    h rows of (w image tokens + NEW_LINE 8803), then IMAGE_END 8196: (w + 1) * h + 1 tokens;
          NEW_LINE and IMAGE_END are forced (every other id is -inf there), image ids only elsewhere

Position rule (both): a row's tokens are numbered from its first visible token (pads get 0 and
are never visible), so a prompt's positions do not depend on what it is batched with. The public
code runs one prompt at a time, where this is exactly its arange / cumsum(mask) - 1; its Anole
batching (arange over the padded length for every cond row) breaks for more than one prompt.
Each position also sees itself, so a pad query never has an empty softmax.

Not here (the runtime's loop): tree verification puts node positions at next_position + tokens
generated + depth in every row (EaModel.tree_decoding: cond tree_position_ids + len(ids), uncond
the same minus L - 2; Lumina minus the index of the 8197, which is the same rule); LANTERN's
drafters give the pair (h_t, x_{t+1}) position t and clamp the unconditional row's stable-part
positions at 0 (cnets_anole.py: topK_genrate_v1).
"""
import numpy as np

from lantern.runtime.errors import LanternError

BOS, PAD, EOS = 0, 1, 2
IMAGE_END = 8196  # <eoss>
IMAGE_START = 8197  # <racm3:break>
END_OF_TURN = 8710  # <reserved08706>
NEW_LINE = 8803  # <reserved08799>
GRID_TOKEN_BASE = 8804  # <reserved{8800 + n}> has id 8804 + n
FIRST_IMAGE_ID = 4  # image token id = VQ code + 4 (LANTERN: nearest_latents[x - 4] + 4)
LUMINA_PATCH = 32  # pixels per grid unit in Lumina's h/w tokens (item_processor.py: patch_size)
VQ_DOWNSAMPLE = 16  # pixels per latent code (Chameleon's VQ-GAN)
ANOLE_GRID = (32, 32)  # Anole-7b always generates 512 x 512 (1024 tokens)


class PromptBatch:
    """Left-padded rows of one prefill call: ids, visible keys, positions [B, L] and, per row,
    the position of the first token generated after the prompt."""

    def __init__(self, ids, visible, positions):
        self.ids, self.visible, self.positions = ids, visible, positions
        self.next_position = visible.sum(axis=1).astype(np.int64)

    def attention_mask(self):
        """[B, 1, L, L] bool: query i sees key j if j <= i and j is visible, and always itself."""
        L = self.ids.shape[1]
        causal = np.tril(np.ones((L, L), dtype=bool))
        mask = causal[None] & self.visible[:, None, :]
        mask |= np.eye(L, dtype=bool)[None]
        return mask[:, None]


def batch_rows(rows):
    """Rows of token ids (lists) -> PromptBatch, left-padded with PAD."""
    if not rows or any(len(r) == 0 for r in rows):
        raise LanternError("every row needs at least one token")
    L = max(len(r) for r in rows)
    ids = np.full((len(rows), L), PAD, dtype=np.int64)
    visible = np.zeros((len(rows), L), dtype=bool)
    for b, row in enumerate(rows):
        ids[b, L - len(row):] = row
        visible[b, L - len(row):] = True
    positions = np.maximum(np.cumsum(visible, axis=1) - 1, 0).astype(np.int64)
    return PromptBatch(ids, visible, positions)


def cfg_batch(cond_rows, uncond_rows):
    """[cond; uncond] as one PromptBatch (rows 0..N-1 conditional, N..2N-1 their partners) and
    cfg_pair [2N]: each row's CFG partner (cond i <-> uncond N + i)."""
    n = len(cond_rows)
    if len(uncond_rows) != n:
        raise LanternError(f"{n} conditional rows but {len(uncond_rows)} unconditional rows")
    pair = np.concatenate([np.arange(n, 2 * n), np.arange(n)]).astype(np.int64)
    return batch_rows(list(cond_rows) + list(uncond_rows)), pair


# ---------------------------------------------------------------------------------------------
# Anole


def anole_rows(prompt_ids):
    """prompt_ids: per image, the prompt's text token ids (no special tokens) -> (cond rows,
    uncond rows). The uncond row is [BOS, IMAGE_START]; left-padding gives the public
    [PAD] * (L - 2) + [BOS, IMAGE_START]."""
    cond = [[BOS] + [int(t) for t in ids] + [END_OF_TURN, IMAGE_START] for ids in prompt_ids]
    uncond = [[BOS, IMAGE_START] for _ in prompt_ids]
    return cond, uncond


# ---------------------------------------------------------------------------------------------
# Lumina-mGPT


def lumina_prompt_prefix(grid):
    """The template text before the prompt for an image of `grid` = (latent rows, latent
    columns): generate.py's "Generate an image of {w}x{h} according to the following prompt:\\n",
    width first, in pixels."""
    h, w = _lumina_grid(grid)
    return f"Generate an image of {w * VQ_DOWNSAMPLE}x{h * VQ_DOWNSAMPLE} according to the following prompt:\n"


def lumina_prompt_text(prompt, grid):
    """The whole text Lumina-mGPT encodes. Tokenize it in one piece; joining the ids of the
    prefix and of the prompt (what a caller holding only prompt ids can do) matches whenever the
    tokenizer splits at the newline, which byte-level pre-tokenizers do."""
    return lumina_prompt_prefix(grid) + prompt


def lumina_grid_tokens(grid):
    """[IMAGE_START, h_token, w_token] for `grid` = (latent rows, latent columns)."""
    h, w = _lumina_grid(grid)
    per_grid = LUMINA_PATCH // VQ_DOWNSAMPLE
    return [IMAGE_START, GRID_TOKEN_BASE + h // per_grid, GRID_TOKEN_BASE + w // per_grid]


def lumina_rows(template_ids, grid):
    """template_ids: per image, the token ids of lumina_prompt_text(...) (no special tokens) ->
    (cond rows, uncond rows)."""
    start = lumina_grid_tokens(grid)
    cond = [[BOS] + [int(t) for t in ids] + [END_OF_TURN] + start for ids in template_ids]
    uncond = [list(start) for _ in template_ids]
    return cond, uncond


def _lumina_grid(grid):
    h, w = (int(x) for x in grid)
    per_grid = LUMINA_PATCH // VQ_DOWNSAMPLE
    if h < per_grid or w < per_grid or h % per_grid or w % per_grid:
        raise LanternError(f"Lumina-mGPT grids come in units of {per_grid} latent rows/columns "
                         f"({LUMINA_PATCH} px); got {h}x{w}")
    return h, w


# ---------------------------------------------------------------------------------------------
# The image body: forced tokens and codes


def body_length(family, grid):
    h, w = grid
    return h * w if family == "anole" else (w + 1) * h + 1


def forced_tokens(family, grid):
    """For each body index (0 = the first token after the prompt), the id that must come there,
    or -1 where the model chooses an image token. Lumina (inference_solver.py:
    MultiModalLogitsProcessor, t = body tokens so far): NEW_LINE where (t + 1) % (w + 1) == 0,
    IMAGE_END at t = (w + 1) * h. Anole forces nothing."""
    h, w = grid
    n = body_length(family, grid)
    forced = np.full(n, -1, dtype=np.int64)
    if family == "lumina_mgpt":
        t = np.arange(n)
        forced[((t + 1) % (w + 1) == 0) & (t < (w + 1) * h)] = NEW_LINE
        forced[(w + 1) * h] = IMAGE_END
    elif family != "anole":
        raise LanternError(f"unknown family {family!r}")
    return forced


def codes_from_body(family, body, grid):
    """A body of token ids (as generated) -> VQ codes [h, w] in grid order, line breaks and the
    end-of-image token dropped (item_processor.py: decode_image), id - 4 per code."""
    h, w = grid
    body = np.asarray(body, dtype=np.int64)
    if body.shape != (body_length(family, grid),):
        raise LanternError(f"{family} body for a {h}x{w} grid has {body_length(family, grid)} tokens, got {body.shape}")
    forced = forced_tokens(family, grid)
    if np.any(body[forced >= 0] != forced[forced >= 0]):
        raise LanternError("the body's line-break / end-of-image tokens are not where the grid puts them")
    image = body[forced < 0]
    if np.any((image < FIRST_IMAGE_ID) | (image >= IMAGE_END)):
        raise LanternError("the body holds non-image tokens where image tokens belong")
    return (image - FIRST_IMAGE_ID).reshape(h, w)
