"""Chameleon's text tokenizer (`text_tokenizer.json`), read with the `tokenizers` library as the
public code does (LANTERN base_models/anole/chameleon/chameleon.py: TokenManager uses
`Tokenizer.from_file(...)` and `tokenize_text(text) = encode(text).ids`).

encode() returns the text's ids without special tokens: each family adds its own (see
lantern.runtime.chameleon_prompts). Loading checks that the file is Chameleon's: the special
tokens the runtime relies on must have their Chameleon ids.
"""
import os

from lantern.runtime.errors import LanternError

FILE_NAME = "text_tokenizer.json"
EXPECTED_IDS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<eoss>": 8196, "<racm3:break>": 8197, "<reserved08706>": 8710,
                "<reserved08799>": 8803}


class TextTokenizer:
    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise LanternError("reading text_tokenizer.json needs the `tokenizers` package (pip install tokenizers)") from None
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise LanternError(f"{path}: no such file")
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # the library raises its own exception type
            raise LanternError(f"{path}: not a tokenizers JSON file ({str(e).splitlines()[0]})") from None
        wrong = {name: self._tokenizer.token_to_id(name) for name, i in EXPECTED_IDS.items()
                 if self._tokenizer.token_to_id(name) != i}
        if wrong:
            raise LanternError(f"{path}: not Chameleon's text tokenizer (special token ids {wrong}, expected "
                               f"{ {k: EXPECTED_IDS[k] for k in wrong} })")
        self.path = path

    def encode(self, text):
        """The text's token ids, no BOS or other special tokens added."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_id(self, name):
        token_id = self._tokenizer.token_to_id(name)
        if token_id is None:
            raise LanternError(f"{self.path}: no token {name!r}")
        return token_id
