"""Prefix caching for the torch engine: the KV cache of a shared prompt prefix is computed once.

Product traffic repeats the start of its prompts: the chat template's system turn (for the
default model about 20 tokens of every reply's prompt), a product's instructions, a task's
preamble. A :class:`PrefixCache` belongs to one :class:`serving.engine_base.LoadedModel` (so a KV
cache never mixes two versions' keys) and holds a few :class:`PrefixEntry` s: the prefix's
tokens, its per-layer keys and values ``(1, kv_heads, p, head_dim)`` and its expert routes
``(p, L, k)``. When a group of requests is prefilled (:meth:`serving.torch_engine.batch.RunningBatch.join`),
the longest entry that every prompt of the group starts with is expanded to the group and only
the suffixes run through the model.

Which prefixes are cached: vLLM hashes fixed-size blocks (``enable_prefix_caching``, block
size 16); the torch engine has no paged KV, so an entry here is one exact prefix: the longest
common prefix of the group being prefilled, or of its first prompt and a recently seen
prompt (:meth:`PrefixCache.candidate`), when it is at least ``min_tokens`` long and at least
``min_tokens`` longer than the best entry already held. Building an entry costs the forward
of the tokens it adds (which the group's prefill would have run anyway); entries are evicted
least recently used beyond ``max_entries``.

Numerics: a cached prefix's keys and values come from a batch-1 forward of the prefix, the
suffix from a forward over that cache; the logits of the next token differ from one
full-prompt prefill by float rounding (~1e-6 in fp32, other matmul shapes), as the
KV-cached decode already does (docs/decisions.md D11, D26). With ``aligned_logprobs`` the
logged behavior logprobs come from the unpadded rescoring pass and do not depend on it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class PrefixEntry:
    """One cached prefix.

    Attributes:
        tokens: the prefix's token ids (length ``p``).
        kv: per decoder layer ``(keys, values)``, each ``(1, kv_heads, p, head_dim)`` in the
            model's dtype, on its device.
        routes: ``(p, L, k)`` expert routes of the prefix tokens (uint8/uint16), or None for a
            dense model.
    """

    tokens: tuple[int, ...]
    kv: list[tuple[Any, Any]]
    routes: np.ndarray | None

    @property
    def length(self) -> int:
        return len(self.tokens)

    def cache_for(self, rows: int, config):
        """A fresh HF ``DynamicCache`` holding this prefix for ``rows`` rows (the entry's
        tensors are expanded, not copied; the forward's update concatenates new tensors,
        so the entry is never written)."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=[(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1))
                                            for k, v in self.kv], config=config)


@dataclass
class PrefixCache:
    """The prefix entries of one LoadedModel (see the module docstring).

    Args:
        min_tokens: shortest prefix worth an entry, and the least gain over the entry in use
            for a longer one to be built.
        max_entries: entries kept (least recently used evicted).
        recent: prompts remembered to find prefixes shared across groups.

    Counters: ``hits`` (groups prefilled from an entry), ``tokens_reused`` (prompt tokens not
    run through the model: prefix length times rows, per hit), ``built`` (entries made).
    """

    min_tokens: int = 8
    max_entries: int = 16
    recent: int = 32
    entries: "collections.OrderedDict[tuple[int, ...], PrefixEntry]" = field(
        default_factory=collections.OrderedDict)
    _recent: collections.deque = field(default_factory=collections.deque)
    hits: int = 0
    tokens_reused: int = 0
    built: int = 0

    def lookup(self, prompts: list[list[int]]) -> PrefixEntry | None:
        """The longest entry every prompt starts with and leaves at least one token after."""
        shortest = min(len(p) for p in prompts)
        best = None
        for e in self.entries.values():
            if e.length < shortest and (best is None or e.length > best.length) and all(
                    tuple(p[:e.length]) == e.tokens for p in prompts):
                best = e
        return best

    def candidate(self, prompts: list[list[int]]) -> int:
        """The length of the prefix worth caching for this group: the longest common prefix
        of its prompts (two or more), else of its prompt and the most similar recent prompt;
        at most the shortest prompt's length minus one. Remembers the group's prompts."""
        shortest = min(len(p) for p in prompts)
        if len(prompts) > 1:
            n = min(common_prefix_len(prompts[0], p) for p in prompts[1:])
        else:
            n = max((common_prefix_len(prompts[0], r) for r in self._recent), default=0)
        for p in prompts:
            self._recent.append(tuple(p))
            if len(self._recent) > self.recent:
                self._recent.popleft()
        return min(n, shortest - 1)

    def add(self, entry: PrefixEntry) -> None:
        """Insert ``entry`` (most recently used), evicting beyond ``max_entries``."""
        self.entries[entry.tokens] = entry
        self.entries.move_to_end(entry.tokens)
        self.built += 1
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def used(self, entry: PrefixEntry, rows: int, computed: int = 0) -> None:
        """Count a use of ``entry`` by a group of ``rows`` prompts, ``computed`` of its tokens
        having just been run to build it."""
        self.hits += 1
        self.tokens_reused += entry.length * rows - computed
        self.entries.move_to_end(entry.tokens)
