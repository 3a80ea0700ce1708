"""From an OpenAI request to what the engine runs: prompt token ids, new-token budget,
stop-string checks, and back from token ids to text (whole, or incrementally while a
completion streams: :class:`TextStream`). Knows the tokenizer and the model's context length,
nothing about HTTP or events."""

from __future__ import annotations

from typing import Callable

from serving.params import ContextLengthError, ServingValidationError
from serving.protocol import ChatCompletionRequest, CompletionRequest

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: streams decode the whole completion per step
    DecodeStream = None


def _decoded_cut(tok, ids: list[int], stops: list[str]) -> str:
    """``ids`` decoded (special tokens skipped), cut before the first stop string."""
    text = tok.decode(ids, skip_special_tokens=True)
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else text


class PromptIds(list):
    """A prompt's token ids (a ``list[int]``) that also name the request field they came
    from (``param``: ``messages`` or ``prompt``), so that a context error names it."""

    def __init__(self, ids, param: str):
        super().__init__(ids)
        self.param = param


class PromptBuilder:
    """Tokenization rules of one pod.

    A prompt the context cannot take is refused as OpenAI refuses it: 400
    ``context_length_exceeded`` naming ``messages`` or ``prompt``
    (:class:`serving.params.ContextLengthError`; docs/decisions.md D77). A request body over
    its size bound never gets here: 413 before it is parsed (``serving.http.limits``).

    Args:
        tokenizer: the served model's Hugging Face tokenizer (with a chat template).
        max_positions: the model's context length in tokens (None: unbounded).
        max_prompt_tokens: longer prompts are refused (tokens; the server's bound, below the
            context or not).
    """

    def __init__(self, tokenizer, max_positions: int | None, max_prompt_tokens: int):
        self.tok = tokenizer
        self.context = max_positions  # None: unbounded
        self.max_positions = max_positions or 10**9
        self.max_prompt_tokens = max_prompt_tokens
        self._backend: object | None = None  # tokenizers.Tokenizer when streams may decode with it
        self._backend_checked = False

    def chat_ids(self, body: ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        """The chat template applied to ``messages`` with the generation prompt (``developer``
        is sent as ``system``); with ``tools``, the template's tool rendering (and each
        message's ``tool_calls`` / ``tool_call_id`` kept)."""
        msgs = []
        for i, m in enumerate(body.messages):
            d = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            if tools:
                d.update({k: v for k, v in (m.model_extra or {}).items() if k in ("tool_calls", "tool_call_id", "name")})
            msgs.append(d)
        kw = {"tools": tools} if tools else {}
        ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return PromptIds(ids, "messages")

    def completion_ids(self, body: CompletionRequest) -> list[int]:
        """``prompt`` as token ids: a string (tokenized, no special tokens), token ids (each
        in ``[0, vocab)``), or a one-element list of either."""
        p = body.prompt
        if isinstance(p, list):
            if not p:
                raise ServingValidationError("prompt", p, "must not be empty")
            if isinstance(p[0], (str, list)):
                if len(p) != 1:
                    raise ServingValidationError("prompt", f"{len(p)} prompts", "only one prompt per request")
                p = p[0]
        if isinstance(p, str):
            ids = self.tok(p, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ServingValidationError("prompt", body.prompt, "must not be empty")
            return PromptIds(ids, "prompt")
        vocab = len(self.tok)
        bad = [t for t in p if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab]
        if bad:
            raise ServingValidationError("prompt", bad[:5], f"token ids must be in [0, {vocab})")
        return PromptIds(p, "prompt")

    def check_len(self, field: str, ids: list[int]) -> None:
        """Refuse a prompt that leaves no room for one new token or is longer than
        ``max_prompt_tokens``.

        Raises:
            ContextLengthError: 400 ``context_length_exceeded`` naming ``field`` (``messages``
                or ``prompt``), the prompt's length, the context and the bound it broke.
        """
        if len(ids) > min(self.max_prompt_tokens, self.max_positions - 1):
            raise ContextLengthError(field, len(ids), context=self.context, max_prompt_tokens=self.max_prompt_tokens)

    def budget(self, field: str, prompt: list[int], asked: int | None, default: int) -> int:
        """New-token budget: an explicit value must fit the context with the prompt, as
        OpenAI requires (``prompt + max_tokens <= context``); a default is clamped to the room.

        Args:
            field: the request field of the budget (``max_tokens``, ``max_completion_tokens``).
            prompt: the prompt's token ids (a :class:`PromptIds` names its field).
            asked: the budget the request set, or None.
            default: the budget when none was set (tokens).

        Raises:
            ContextLengthError: 400 ``context_length_exceeded`` naming the prompt's field
                (``messages`` or ``prompt``, as OpenAI does), with both counts and ``field``.
        """
        room = self.max_positions - len(prompt)
        if asked is None:
            return max(1, min(default, room))
        if asked > room:
            raise ContextLengthError(getattr(prompt, "param", "prompt"), len(prompt), context=self.context,
                                     asked=asked, budget_field=field)
        return asked

    def stop_check(self, stops: list[str]) -> Callable[[list[int]], bool] | None:
        """A check for the engine: True once the decoded tail holds a stop string."""
        if not stops:
            return None
        tok = self.tok

        def check(toks: list[int]) -> bool:
            text = tok.decode(toks[-64:], skip_special_tokens=True)
            return any(s in text for s in stops)
        return check

    def text(self, ids: list[int], stops: list[str]) -> str:
        """Decoded completion, cut before the first stop string."""
        return _decoded_cut(self.tok, ids, stops)

    def text_stream(self, stops: list[str]) -> "TextStream":
        """A :class:`TextStream` of one completion: the text :meth:`text` gives, built token by
        token (incremental detokenization, no whole-completion decode per token)."""
        return TextStream(self.tok, stops, self._stream_backend())

    def _stream_backend(self):
        """The ``tokenizers.Tokenizer`` behind :attr:`tok` when decoding with it equals
        ``tok.decode`` (a fast tokenizer whose ``decode`` adds no clean-up of spaces: checked
        once on a probe text holding every pattern that clean-up rewrites), else None."""
        if not self._backend_checked:
            self._backend_checked = True
            be = getattr(self.tok, "backend_tokenizer", None)
            if be is not None and DecodeStream is not None:
                probe = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're k do not l"
                ids = self.tok(probe, add_special_tokens=False)["input_ids"]
                if self.tok.decode(ids, skip_special_tokens=True) == be.decode(ids, skip_special_tokens=True):
                    self._backend = be
        return self._backend

    def token_str(self, t: int) -> str:
        """One token's text (for logprobs)."""
        return self.tok.decode([t])


class TextStream:
    """One completion's text while it streams: after :meth:`add` of its token ids so far, the
    same text as ``PromptBuilder.text(ids, stops)`` (decoded with special tokens skipped, cut
    before the first stop string), except that an incomplete UTF-8 sequence at the end is held
    back until the tokens completing it arrive.

    With a fast tokenizer (``backend`` given) it decodes incrementally with
    ``tokenizers.decoders.DecodeStream`` (O(1) per token; stop strings are searched only in the
    new text and the ``len(longest stop) - 1`` characters before it); else it decodes the whole
    completion at each :meth:`add`, as before (``U+FFFD`` then marks an incomplete sequence).

    Args:
        tokenizer: the Hugging Face tokenizer (used without ``backend``).
        stops: stop strings.
        backend: the ``tokenizers.Tokenizer`` to decode with incrementally, or None.
    """

    def __init__(self, tokenizer, stops: list[str], backend=None):
        self._tok = tokenizer
        self._stops = list(stops)
        self._backend = backend
        self._ds = DecodeStream(skip_special_tokens=True) if backend is not None else None
        self._ids: list[int] = []  # only without a backend
        self._full = ""  # decoded text so far (whole characters only with a backend)
        self._cut = 0 if "" in self._stops else -1  # where the first stop string starts, -1: none yet

    def add(self, token_ids: list[int]) -> str:
        """Append ``token_ids`` (the completion's next tokens) and return the text so far, cut
        before the first stop string. Once a stop string is found the text stops growing (it
        can only move earlier: a longer stop string completed later may start before it)."""
        if self._ds is None:
            self._ids += token_ids
            return _decoded_cut(self._tok, self._ids, self._stops)
        old = len(self._full)
        parts = [p for p in (self._ds.step(self._backend, t) for t in token_ids) if p]
        if parts:
            self._full += "".join(parts)
            for s in self._stops:
                if s:
                    at = self._full.find(s, max(0, old - len(s) + 1))
                    if at >= 0 and (self._cut < 0 or at < self._cut):
                        self._cut = at
        return self._full[:self._cut] if self._cut >= 0 else self._full
