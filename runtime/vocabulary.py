"""The token space acceptance works in: the image codes, then any token a model's grammar forces
(Lumina-mGPT's end-of-line and end-of-image). Logits, drafts and the neighbor table are mapped
into it once per step; for LlamaGen and Anole it is the image-token columns of the logits, a
view with nothing to copy.

Forced tokens (REFERENCE.md §5.4): where the body index t has a forced id, the target may only
emit that id (every other logit is -inf, as Lumina's logits processor does), and the drafts at
that depth are that id with drafter probability 1, so acceptance takes them outright and never
drafts against them; elsewhere forced ids are -inf.
"""
import numpy as np


class VocabularyView:
    def __init__(self, vocabulary, forced):
        """vocabulary: the manifest's Vocabulary; forced [length]: per body index, the id that
        must come there or -1."""
        self.start, self.codes = vocabulary.image_start, vocabulary.codes
        self.forced = np.asarray(forced, dtype=np.int64)
        self.extra = np.unique(self.forced[self.forced >= 0])  # forced ids, after the codes
        self.size = self.codes + len(self.extra)
        # per body index: the forced token's column, or -1
        self.forced_column = np.full(len(self.forced), -1, dtype=np.int64)
        where = self.forced >= 0
        self.forced_column[where] = self.codes + np.searchsorted(self.extra, self.forced[where])

    @property
    def plain(self):
        return len(self.extra) == 0

    def columns(self, ids):
        """Vocabulary ids -> columns (image ids and forced ids only)."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.plain:
            return ids - self.start
        extra = np.searchsorted(self.extra, ids)
        is_extra = (extra < len(self.extra)) & (self.extra[np.minimum(extra, len(self.extra) - 1)] == ids)
        return np.where(is_extra, self.codes + extra, ids - self.start)

    def ids(self, columns):
        columns = np.asarray(columns, dtype=np.int64)
        if self.plain:
            return columns + self.start
        return np.where(columns < self.codes, columns + self.start, self.extra[np.maximum(columns - self.codes, 0)
                                                                                % max(len(self.extra), 1)])

    def gather(self, logits):
        """Full-vocabulary logits [..., V] -> this space's columns [..., size] (a view when plain)."""
        view = logits[..., self.start: self.start + self.codes]
        return view if self.plain else np.concatenate([view, logits[..., self.extra]], axis=-1)

    def force(self, logits, body_index):
        """In place, on gathered logits [N, T, size] predicting body indices [N, T]: a forced row
        keeps only its forced column; a free row loses the forced columns."""
        if self.plain:
            return logits
        column = self.forced_at(body_index)
        forced = column >= 0
        logits[..., self.codes:][~forced] = -np.inf
        n, t = np.nonzero(forced)
        keep = logits[n, t, column[n, t]]
        logits[n, t] = -np.inf
        logits[n, t, column[n, t]] = keep
        return logits

    def forced_at(self, body_index):
        """The forced column at each body index, -1 where free (or past the end)."""
        body_index = np.asarray(body_index)
        inside = (body_index >= 0) & (body_index < len(self.forced_column))
        return np.where(inside, self.forced_column[np.clip(body_index, 0, len(self.forced_column) - 1)], -1)

    def neighbors(self, table):
        """The neighbor table [codes, k] with rows for the forced columns (their neighbors have
        probability 0 wherever a forced token is drafted, so nothing is ever relaxed there)."""
        if table is None or self.plain:
            return table
        rows = np.broadcast_to(np.arange(table.shape[1]) % self.codes, (len(self.extra), table.shape[1]))
        return np.concatenate([table, rows.astype(table.dtype)])

    def codes_of(self, body):
        """Generated bodies [N, length] of ids -> VQ codes [N, h * w] in grid order (forced
        tokens dropped; they are where the grammar puts them, or the loop is broken)."""
        where = self.forced >= 0
        assert (body[:, where] == self.forced[where]).all(), "forced tokens out of place"
        return body[:, ~where] - self.start
