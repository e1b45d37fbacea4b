"""The character tokenizer of the embedded default model: one token per character, a real ``transformers`` tokenizer.

Built with the ``tokenizers`` library (a BPE model with an empty merge list, so every character stays one token) and
wrapped in :class:`transformers.PreTrainedTokenizerFast`, so ``save_pretrained`` writes the standard
``tokenizer.json`` / ``tokenizer_config.json`` pair and ``AutoTokenizer.from_pretrained`` loads it back: the same path
a hub model's tokenizer takes.

Vocabulary (ids are fixed):

=====  ==================================================================
0      ``<pad>``  padding (prompts are padded on the left)
1      ``<bos>``  prepended to every encoded text
2      ``<eos>``  end of a completion; generation stops on it
3      ``<unk>``  any character outside the alphabet (never silently dropped)
4..    printable ASCII (space ``' '`` to ``'~'``, code points 32–126), then ``'\\n'``
=====  ==================================================================

Digits are one token each. Special-token strings typed in a prompt (``"<eos>"``) are split into characters
(``split_special_tokens``), so text can never forge a control token.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
#: Special tokens in id order (``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3).
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
#: First and last printable ASCII code points (space and tilde).
_FIRST_PRINTABLE, _LAST_PRINTABLE = 0x20, 0x7E
#: The characters that get their own token, in id order after the special tokens.
CHARSET: str = "".join(chr(c) for c in range(_FIRST_PRINTABLE, _LAST_PRINTABLE + 1)) + "\n"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer (vocabulary size ``len(SPECIAL_TOKENS) + len(CHARSET)`` = 100).

    Encoding adds ``<bos>`` in front (a template post-processor), never ``<eos>``; padding is on the left, as
    batched prompts need. Decoding joins characters without separators (``Fuse`` decoder).
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(CHARSET)})
    backend = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    bos = (BOS_TOKEN, vocab[BOS_TOKEN])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[bos]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        split_special_tokens=True,
    )
