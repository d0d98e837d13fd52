"""Chameleon's token vocabulary as its text tokenizer lays it out: the ids of the special and
image tokens (the real ones, which the runtime relies on), the byte-level symbols, and the
vocabulary_map config.json carries. lantern.export.chameleon_checkpoints writes tiny tokenizers
and configs from it."""
from lantern.export import chameleon
from lantern.runtime.errors import LanternError

# Words the tiny tokenizer merges into single tokens (the rest falls back to bytes).
_TINY_WORDS = ("Generate", "an", "image", "of", "according", "to", "the", "following", "prompt", "a", "cat",
               "dog", "red", "blue", "on", "sitting", "mat", "photo")


def text_vocabulary(vocab_size=65536, num_image_tokens=8192):
    """(vocab, merges) laid out as Chameleon's text_tokenizer.json: <s> <pad> </s> <unk>, the
    image tokens IMGIMG<code as letters>Z with code = id - 4, <eoss> 8196, <racm3:break> 8197,
    <reservedNNNNN> = id NNNNN + 4 up to 8999; then, for the tiny tokenizer, the 256 byte-level
    symbols, merges of a few words, and placeholder names. Real text tokens differ; the id of
    every special token the runtime uses is the real one."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for code in range(num_image_tokens):
        vocab[chameleon.image_token_name(code)] = 4 + code
    vocab["<eoss>"], vocab["<racm3:break>"] = chameleon.IMAGE_END, chameleon.IMAGE_START
    for token_id in range(chameleon.IMAGE_START + 1, 9000):
        vocab[f"<reserved{token_id - 4:05d}>"] = token_id
    for symbol in sorted(byte_level_alphabet()):
        vocab[symbol] = len(vocab)
    merges = []
    for word in _TINY_WORDS:  # each word merges left to right, then with a leading space
        piece = word[0]
        for ch in word[1:]:
            if piece + ch not in vocab:
                merges.append((piece, ch))
                vocab[piece + ch] = len(vocab)
            piece += ch
    for word in _TINY_WORDS:  # byte-level BPE spells a leading space as U+0120
        merges.append(("\u0120", word))
        vocab["\u0120" + word] = len(vocab)
    for token_id in range(len(vocab), vocab_size):
        vocab[f"<text{token_id}>"] = token_id
    if len(vocab) != vocab_size:
        raise LanternError(f"a Chameleon vocabulary needs at least {len(vocab)} ids, got vocab_size {vocab_size}")
    return vocab, merges


def byte_level_alphabet():
    """The 256 symbols byte-level BPE spells bytes with (GPT-2's bytes_to_unicode): printable
    bytes stand for themselves, the others are shifted to U+0100 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b) for b in printable} | {chr(256 + i) for i in range(len(shifted))}


def vocabulary_map(vocab_size=65536, num_image_tokens=8192):
    """config.json's vocabulary_map: the tokenizer vocabulary with <reserved08707> (8711) renamed
    <image>, as transformers' convert_chameleon_weights_to_hf.py writes it."""
    vocab, _ = text_vocabulary(vocab_size, num_image_tokens)
    vocab["<image>"] = vocab.pop("<reserved08707>")
    return vocab
