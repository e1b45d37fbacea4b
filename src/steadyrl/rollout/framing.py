"""Framing of tool output: text a tool wrote is encoded so that it can never become a control token.

A tool turn's text (stdout, stderr, a traceback quoting the code) is untrusted and goes into the model's context.
Encoded as a prompt is, a string such as ``<|im_end|>``, ``<|im_start|>user`` or ``<|endoftext|>`` inside it would
become the checkpoint's end-of-turn, role or end-of-text token, so a tool could forge turns the model never wrote.
:func:`encode_tool_text` encodes it so that no id of :func:`control_token_ids` ever appears:

1. ``tokenizer.encode(text, add_special_tokens=False)``; when no control id is among the ids (all ordinary output),
   these are the ids, exactly as before framing existed;
2. otherwise the text is encoded again with ``split_special_tokens=True`` (transformers: special-token strings are
   tokenized by the model's vocabulary as ordinary text, e.g. ``<|im_end|>`` → ``<``, ``|``, ``im``, …);
3. an id still in the control set (a tokenizer that ignores that flag, or a vocabulary that holds the special string
   as an ordinary entry) is replaced by its text spelled out one character at a time; a character whose own encoding
   is a control token is dropped.

Control tokens are ``tokenizer.all_special_ids`` plus every added token marked special (``added_tokens_decoder``
entries with ``special=True``, such as ChatML's ``<|im_start|>`` and ``<|im_end|>``, which ``all_special_ids`` omits
unless they are named). The unknown token is not one when it is nothing else: it stands for a character the
vocabulary lacks, it forges no turn, and ordinary output holding such a character keeps it. Added tokens not marked
special (e.g. ``<tool_call>`` in some vocabularies) are ordinary text to the tokenizer and stay as it encodes them.
The template around the output (``ToolCallFormat.output_template``) is the run's own text and is encoded as it is
(it may use the chat format's tokens on purpose).

Confidence: [exact] (a property of the returned ids, checked on every call; no paper formula involved).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def control_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids tool output must never encode to: the special tokens and the added tokens marked special, without the
    unknown token unless it also plays another role (as when ``unk_token`` is the EOS token)."""
    added = tokenizer.added_tokens_decoder
    unk = tokenizer.unk_token
    strings = _special_roles_but_unk(tokenizer)
    strings |= {tok.content for tok in added.values() if tok.special and tok.content != unk}
    ids = {int(i) for i, tok in added.items() if tok.content in strings}
    for string in strings:
        token_id = tokenizer.convert_tokens_to_ids(string)
        if token_id is not None and tokenizer.convert_ids_to_tokens(int(token_id)) == string:  # in the vocabulary
            ids.add(int(token_id))
    return frozenset(ids)


def _special_roles_but_unk(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """Strings of every special token except the ``unk_token`` role (the string stays when another role shares it)."""
    named = tokenizer.special_tokens_map
    strings = {
        str(token)
        for role, value in named.items()
        if role != "unk_token"
        for token in (value if isinstance(value, (list, tuple)) else [value])
    }
    extra = set(tokenizer.all_special_tokens) - {str(v) for v in named.values() if not isinstance(v, (list, tuple))}
    return strings | extra


def encode_tool_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids of ``text`` as a tool turn's body: none is a control token; ordinary text gets the tokenizer's ids."""
    control = control_token_ids(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if control.isdisjoint(ids):
        return ids
    ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    if control.isdisjoint(ids):
        return ids
    return _spell_out(tokenizer, ids, control)


def _spell_out(tokenizer: PreTrainedTokenizerBase, ids: list[int], control: frozenset[int]) -> list[int]:
    """``ids`` with every control id replaced by its text encoded one character at a time (control ids dropped)."""
    out: list[int] = []
    for token_id in ids:
        if token_id not in control:
            out.append(token_id)
            continue
        for char in tokenizer.decode([token_id]):
            pieces = tokenizer.encode(char, add_special_tokens=False, split_special_tokens=True)
            out.extend(piece for piece in pieces if piece not in control)
    return out
