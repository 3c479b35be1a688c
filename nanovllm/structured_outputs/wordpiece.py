"""WordPiece vocabularies (BERT's) under a grammar: the text each token adds to an output.

A WordPiece decoder puts a space before every word token and glues each continuation piece on
without its prefix ("the", "fo", "##x" -> "the fox"). An output follows its prompt, so each of
its tokens adds " word" or "piece": that is the text xgrammar is given per token, and the
grammar then constrains exactly the output text. The decoder's `cleanup` (" ." -> ".", " ' " ->
"'", ...) rewrites text across tokens, which no per-token text can say; so a constrained
request's text is decoded here, as the concatenation the grammar walked (`decode`), not by the
tokenizer, whose cleanup (and whose first-token rule, when the prompt ends in special tokens
only) could break the constraint. Special tokens add nothing and are never allowed (xgrammar
never allows an empty token); the end-of-text token ends the grammar as for any tokenizer.
"""
from tokenizers import decoders
from transformers import PreTrainedTokenizerBase


class WordPieceText:

    def __init__(self, texts: list[str], special: dict[int, str]):
        self.texts = texts  # per token id, the text it adds after another token ("" for special tokens)
        self.special = special  # special token id -> its text, shown only without skip_special_tokens

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> "WordPieceText | None":
        """The texts of a WordPiece tokenizer's tokens; None for any other kind of tokenizer."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.model).__name__ != "WordPiece":
            return None
        decoder = backend.decoder
        prefix = decoder.prefix if isinstance(decoder, decoders.WordPiece) else backend.model.continuing_subword_prefix
        special_ids = set(tokenizer.all_special_ids)
        special_ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
        vocab = tokenizer.get_vocab()
        texts = [""] * (max(vocab.values()) + 1)
        special = {}
        for token, token_id in vocab.items():
            if token_id in special_ids:
                special[token_id] = " " + token
            else:
                texts[token_id] = token[len(prefix):] if token.startswith(prefix) else " " + token
        return cls(texts, special)

    def vocabulary(self, vocab_size: int) -> list[str]:
        """xgrammar's encoded vocabulary for a model of `vocab_size` logits (ids past the
        tokenizer's are empty: never allowed)."""
        return (self.texts + [""] * vocab_size)[:vocab_size]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids` as they follow other text: what the grammar constrained."""
        texts, special = self.texts, self.special
        return "".join(special.get(i, "") if i in special and not skip_special_tokens
                       else texts[i] if i < len(texts) else "" for i in token_ids)
