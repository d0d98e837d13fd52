"""Condition adapters: what a generation is conditioned on, turned into the prefill the decoding
loop feeds the target. One adapter per condition kind of the manifest, chosen once when an engine
is opened; the loop only sees the `Prefix` it returns.

With classifier-free guidance the batch is [cond; uncond]: rows [0, N) are the images'
conditional rows, rows [N, 2N) their unconditional partners, and both get the same image tokens.
Each row has its own view of the prefix: which prefix slots its tokens may attend to and a
position offset (a token in cache slot s sits at position s - offset); LlamaGen's rows all use
offset 0, the Chameleon family's unconditional rows do not.
"""
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from lantern.runtime import chameleon_prompts
from lantern.runtime.errors import LanternError
from lantern.runtime.text_tokenizer import TextTokenizer


@dataclass(frozen=True)
class Prefix:
    images: int  # N
    cfg: bool
    ids: np.ndarray  # [B, C] int64: the prefill's target input ids (B = 2N with CFG, else N)
    positions: np.ndarray  # [B, C] int64
    key_visible: np.ndarray  # [B, C] bool: prefix slots later tokens may attend to
    position_offset: np.ndarray  # [B] int64
    grid: tuple  # (rows, columns) of VQ codes the generation makes
    forced: np.ndarray  # [tokens to generate] int64: the id that must come at each index, or -1
    condition_feeds: Optional[dict] = None  # the condition graph's inputs (its output is cond_embeds)

    @property
    def length(self):
        """Tokens a generation emits per image (the image codes plus any forced tokens)."""
        return len(self.forced)

    @property
    def rows(self):
        return len(self.ids)

    @property
    def tokens(self):
        return self.ids.shape[1]

    def left_padded(self, tokens):
        """This prefix in `tokens` slots: invisible slots in front (copies of each row's first
        id at position 0, each seeing only itself), every real token `tokens - C` slots later,
        the position offsets moved with them. A static cache holds every prompt this way."""
        pad = tokens - self.tokens
        if pad <= 0:
            return self
        rows = self.rows
        return dataclasses.replace(
            self, ids=np.concatenate([np.repeat(self.ids[:, :1], pad, axis=1), self.ids], axis=1),
            positions=np.concatenate([np.zeros((rows, pad), dtype=np.int64), self.positions], axis=1),
            key_visible=np.concatenate([np.zeros((rows, pad), dtype=bool), self.key_visible], axis=1),
            position_offset=self.position_offset + pad)


def _cond_token_ids(vocab_size, tokens, rows):
    """Target ids of the condition tokens: id V + j is row j of cond_embeds (see lantern.runtime.contracts.GRAPHS['target'])."""
    return np.broadcast_to(vocab_size + np.arange(tokens, dtype=np.int64), (rows, tokens)).copy()


class ClassLabels:
    """LlamaGen c2i: one condition token, a class label per image; the unconditional row uses the
    null class, as LlamaGen's sampler does."""

    def __init__(self, manifest):
        self.num_classes = manifest.condition.num_classes
        self.null_class = manifest.condition.null_class
        self.vocab_size = manifest.vocabulary.size
        self.grid = (manifest.image.grid_height, manifest.image.grid_width)

    def prefix(self, cfg, classes=None, **others):
        if classes is None or any(v is not None for v in others.values()):
            raise LanternError("this is a class-conditional (c2i) engine: give class labels (and nothing else)")
        try:
            ids = np.asarray(classes)
        except (TypeError, ValueError):
            ids = np.array([None])
        if ids.ndim == 0 and np.issubdtype(ids.dtype, np.integer):
            ids = ids.reshape(1)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise LanternError(f"class labels must be a non-empty list of integers; got {classes!r}")
        if ids.min() < 0 or ids.max() >= self.num_classes:
            bad = ids[(ids < 0) | (ids >= self.num_classes)]
            raise LanternError(f"class labels must be in [0, {self.num_classes - 1}]; got {bad[:8].tolist()}"
                               f"{f' and {bad.size - 8} more' if bad.size > 8 else ''}")
        if cfg and self.null_class is None:
            raise LanternError("this model has no null class, so it cannot run classifier-free guidance (use cfg 1)")
        ids = ids.astype(np.int64)
        class_ids = np.concatenate([ids, np.full(len(ids), self.null_class, dtype=np.int64)]) if cfg else ids
        rows = len(class_ids)
        return Prefix(images=len(ids), cfg=cfg, ids=_cond_token_ids(self.vocab_size, 1, rows),
                      positions=np.zeros((rows, 1), dtype=np.int64), key_visible=np.ones((rows, 1), dtype=bool),
                      position_offset=np.zeros(rows, dtype=np.int64), grid=self.grid,
                      forced=np.full(self.grid[0] * self.grid[1], -1, dtype=np.int64),
                      condition_feeds={"class_ids": class_ids})


class CaptionFeatures:
    """LlamaGen t2i: `tokens` T5 caption features per image, left-padded; the unconditional row
    uses the model's null caption (the condition graph's `unconditional` flag). As LlamaGen's
    sampler: padded caption rows are zeroed and their keys hidden, in both halves."""

    def __init__(self, manifest, float_dtype):
        self.tokens = manifest.condition.tokens
        self.dim = manifest.condition.caption_dim
        self.vocab_size = manifest.vocabulary.size
        self.float_dtype = float_dtype
        self.grid = (manifest.image.grid_height, manifest.image.grid_width)

    def prefix(self, cfg, caption=None, caption_mask=None, **others):
        if caption is None or any(v is not None for v in others.values()):
            raise LanternError("this is a text-conditional (t2i) engine: give caption features (and a mask)")
        caption = np.asarray(caption, dtype=np.float32)
        want = (self.tokens, self.dim)
        if caption.ndim == 2:
            caption = caption[None]
        if caption.ndim != 3 or caption.shape[1:] != want or len(caption) == 0:
            raise LanternError(f"caption features must be [N, {want[0]}, {want[1]}] with N >= 1 (T5 features, "
                               f"left-padded); got {list(caption.shape)}")
        if not np.isfinite(caption).all():
            raise LanternError("caption features contain NaN or inf")
        mask = np.ones(caption.shape[:2], dtype=bool) if caption_mask is None else np.asarray(caption_mask)
        if mask.ndim == 1:
            mask = mask[None]
        if mask.shape != caption.shape[:2]:
            raise LanternError(f"caption mask must be [N, {self.tokens}] matching the features; got {list(mask.shape)}")
        mask = mask.astype(bool)
        features = caption * mask[..., None]
        n = len(features)
        if cfg:
            features = np.concatenate([features, np.zeros_like(features)])
            mask = np.concatenate([mask, mask])
        rows = len(features)
        return Prefix(images=n, cfg=cfg, ids=_cond_token_ids(self.vocab_size, self.tokens, rows),
                      positions=np.broadcast_to(np.arange(self.tokens, dtype=np.int64), (rows, self.tokens)).copy(),
                      key_visible=mask, position_offset=np.zeros(rows, dtype=np.int64), grid=self.grid,
                      forced=np.full(self.grid[0] * self.grid[1], -1, dtype=np.int64),
                      condition_feeds={"caption": features.astype(self.float_dtype),
                                       "unconditional": np.arange(rows) >= n})


class Prompt:
    """The Chameleon family (Anole, Lumina-mGPT): a text prompt per image, as text (encoded with
    the engine's text_tokenizer.json) or as the tokenizer's ids without special tokens; the
    rows, positions and forced tokens of the model's style (lantern.runtime.chameleon_prompts).
    grid: latent rows x columns (Lumina-mGPT: in units of 2, written into its prompt; Anole: the
    public code always makes 32 x 32, the engine's default, and a smaller grid just stops early)."""

    def __init__(self, manifest, directory):
        self.rows_of = chameleon_prompts
        self.style = manifest.condition.style
        self.grid = (manifest.image.grid_height, manifest.image.grid_width)
        self.vocab_size = manifest.vocabulary.size
        # directory None: ids only (lantern-export trt lays out step plans without the engine's files)
        self.tokenizer_path = None if manifest.condition.tokenizer is None or directory is None else \
            os.path.join(directory, manifest.condition.tokenizer)
        self._tokenizer = None

    def tokenizer(self):
        if self.tokenizer_path is None:
            raise LanternError("this engine has no text tokenizer (re-export with a --vq directory holding "
                               "text_tokenizer.json), so it takes prompts as ids only (--prompt-ids)")
        if self._tokenizer is None:

            self._tokenizer = TextTokenizer(self.tokenizer_path)
        return self._tokenizer

    def prefix(self, cfg, prompt=None, prompt_ids=None, grid=None, **others):
        if (prompt is None) == (prompt_ids is None) or any(v is not None for v in others.values()):
            raise LanternError("this is a text-to-image (Chameleon) engine: give prompts as text or as token ids "
                               "(one of the two, and no class labels or caption features)")
        grid = self._grid(grid)
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not texts or not all(isinstance(t, str) and t for t in texts):
                raise LanternError("prompts must be non-empty strings")
            if self.style == "lumina_mgpt":
                texts = [self.rows_of.lumina_prompt_text(t, grid) for t in texts]
            ids = [self.tokenizer().encode(t) for t in texts]
        else:
            ids = self._ids(prompt_ids)
            top = max(max(row) for row in ids)
            if top >= self.vocab_size:
                raise LanternError(f"prompt id {top} is outside the engine's vocabulary of {self.vocab_size} ids "
                                   f"(0..{self.vocab_size - 1})")
            if self.style == "lumina_mgpt":
                ids = [self.tokenizer().encode(self.rows_of.lumina_prompt_prefix(grid)) + row for row in ids]
        cond, uncond = (self.rows_of.anole_rows(ids) if self.style == "anole" else self.rows_of.lumina_rows(ids, grid))
        batch = self.rows_of.cfg_batch(cond, uncond)[0] if cfg else self.rows_of.batch_rows(cond)
        L = batch.ids.shape[1]
        return Prefix(images=len(ids), cfg=cfg, ids=batch.ids, positions=batch.positions, key_visible=batch.visible,
                      position_offset=L - batch.next_position, grid=grid,
                      forced=self.rows_of.forced_tokens(self.style, grid))

    def _grid(self, grid):
        if grid is None:
            return self.grid
        try:
            h, w = (int(x) for x in grid)
        except (TypeError, ValueError):
            raise LanternError(f"grid must be (rows, columns) of latent codes, got {grid!r}") from None
        if h < 1 or w < 1:
            raise LanternError(f"grid must be positive, got {h}x{w}")
        return h, w

    @staticmethod
    def _ids(prompt_ids):
        try:
            rows = np.asarray(prompt_ids)
        except (TypeError, ValueError):
            rows = None
        if rows is None or rows.dtype == object or not np.issubdtype(rows.dtype, np.integer) or rows.ndim not in (1, 2) \
                or rows.size == 0 or rows.min() < 0:
            raise LanternError("prompt ids must be non-negative integers: one prompt [L] or N prompts [N, L]")
        rows = rows[None] if rows.ndim == 1 else rows
        return [[int(t) for t in row] for row in rows]


def condition_adapter(manifest, float_dtype, directory):
    """The adapter for the engine's condition kind."""
    if manifest.condition.kind == "class":
        return ClassLabels(manifest)
    if manifest.condition.kind == "caption":
        return CaptionFeatures(manifest, float_dtype)
    return Prompt(manifest, directory)
