"""The torch engine's running batch: iteration-level (continuous) batching on one set of weights.

A :class:`RunningBatch` holds the sequences generating on one :class:`serving.engine_base.LoadedModel`,
their KV cache (HF ``DynamicCache`` of full layers, ``(B, heads, W, head_dim)`` per layer), the attention mask
``(B, W)``, each row's next position ``(B, 1)`` and the logits of each row's next token
``(B, V)``. Layout invariants (DESIGN §4, ``schemas.modelspec``):

- left padding: a row's real tokens end at the right edge; its padding columns are 0 in the
  mask, so they add exactly 0 to attention (a prefix-cache join's row is ``[prefix | padding |
  suffix]``);
- positions are per row, ``cumsum(mask) - 1`` at prefill and ``+1`` per step, so they never
  depend on the padding that other rows bring;
- ``mask.shape[1] == cache length`` between steps.

Requests join at a step boundary and leave at one (finished rows are dropped with
``index_select`` and columns that are padding in every remaining row are cut). A batch's first
requests are prefilled as one left-padded batch (:meth:`RunningBatch.join`); later ones wait
for the end of the next step (:meth:`RunningBatch.queue_join`), where their prompts ride in
that step's decode forward (:meth:`RunningBatch._decode_with_joins`) or, when that would pad
the running rows too much, are prefilled by a forward of their own whose cache is left-padded
to the batch's width and concatenated. One :meth:`RunningBatch.step` samples one token for
every row from the stored logits, does the per-request bookkeeping and runs one KV-cached
forward for the rows still running and those joining; the tokens, behavior logprobs and
routes it records come from :mod:`serving.torch_engine.sampler`. The cache belongs to the batch
and the batch to one LoadedModel, so a KV cache never holds two versions' keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serving.params import GenRequest, GenResult, StepOutput
from serving.torch_engine.sampler import Sampler, captured_routes, new_generator, score_aligned


@dataclass
class Seq:
    """One request inside a running batch.

    Attributes:
        item: the queue entry (:class:`serving.torch_engine.scheduler.WaitingRequest`:
            request, future, submit time).
        plen: prompt length P (tokens).
        routes: ``(P + max_tokens - 1, L, k)`` uint8/uint16 host buffer of expert routes
            (row ``j`` = the ``j``-th fed token), or None for a dense model.
        gen: CPU ``torch.Generator`` for sampled requests (seeded: the same draws in any
            batch), None for greedy ones.
        t_admit: perf_counter s when it joined the batch.
        toks / lps / tops: the completion so far: token ids, their raw behavior logprobs, and
            per token its top logprobs (when the request asked for them).
        ttft_ms: time to first token (ms since submit); finish: ``stop`` / ``length`` /
            ``abort``, None while it runs.
        max_rows: most rows its running batch had while it ran.
        cached: prompt tokens taken from a prefix cache entry.
    """

    item: Any
    plen: int
    routes: Any = None
    gen: Any = None
    t_admit: float = 0.0
    toks: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tops: list = field(default_factory=list)
    ttft_ms: float = 0.0
    finish: str | None = None
    max_rows: int = 0
    cached: int = 0

    @property
    def req(self) -> GenRequest:
        """The request this row runs."""
        return self.item.req


def _left_pad_cols(x, width: int, dim: int):
    """Pad ``x`` with zeros on the left of ``dim`` up to ``width``."""
    import torch

    n = width - x.shape[dim]
    if n <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([torch.zeros(shape, dtype=x.dtype, device=x.device), x], dim=dim)


def _full_cache():
    """An empty HF ``DynamicCache`` whose every layer keeps all its keys and values.

    Built without the model config on purpose: a config with sliding-window layers (gpt-oss)
    would make those layers drop old columns, breaking ``mask.shape[1] == cache length``;
    the engine serves such models up to the window only (``schemas.modelspec.attention_window``,
    docs/decisions.md D39), where the window masks nothing.
    """
    from transformers import DynamicCache

    return DynamicCache()


class RunningBatch:
    """The sequences running on one LoadedModel (see module docstring).

    Args:
        lm: the weights (:class:`serving.engine_base.LoadedModel`).
        engine: the owning :class:`serving.engine.TorchEngine`, read at every step for
            ``device``, ``pad_id``, ``eos_id``, ``max_positions`` (context limit in tokens or
            None), ``fused_join_pad_tokens`` and ``aligned_logprobs``.

    Attributes:
        fused_joins: join groups whose prefill rode in one of this batch's decode forwards.
    """

    def __init__(self, lm, engine):
        self.lm = lm
        self.eng = engine
        self.seqs: list[Seq] = []
        self.joining: list[Seq] = []  # admitted, prefilled at the end of the next step
        self.cache = None
        self.mask = None  # (B, W) int64
        self.pos = None  # (B, 1) int64
        self.logits = None  # (B, V) float32
        self.sampler = Sampler()
        self.fused_joins = 0
        self.n_layers, self.top_k, n_experts = lm.route_dims  # L = num_hidden_layers (vLLM's layout)
        self.route_dtype = np.uint16 if n_experts > 256 else np.uint8

    # ------------------------------------------------------------------ membership
    def join(self, items: list, now: float) -> None:
        """Prefill ``items`` (queue entries on this batch's weights) as one left-padded batch
        and add them to the running rows."""
        self._prefill(self._new_seqs(items, now))

    def queue_join(self, items: list, now: float) -> None:
        """Let ``items`` join at the end of the next :meth:`step`: their prefill rides in that
        step's decode forward when :meth:`_fusable` allows, else runs as its own forward."""
        self.joining += self._new_seqs(items, now)

    def _new_seqs(self, items: list, now: float) -> list[Seq]:
        """A row per queue entry: its seeded generator if sampled, its routes buffer if MoE."""
        seqs = []
        for it in items:
            r = it.req
            s = Seq(item=it, plen=len(r.prompt_token_ids), t_admit=now)
            if r.sampling.temperature != 0:
                s.gen = new_generator(r.sampling.seed)
            if self.n_layers:
                s.routes = np.zeros((s.plen + r.sampling.max_tokens - 1, self.n_layers, self.top_k),
                                    dtype=self.route_dtype)
            seqs.append(s)
        return seqs

    def _prefill(self, seqs: list[Seq]) -> None:
        """One forward of ``seqs``' prompts (left-padded; from a prefix cache entry when one
        applies); their rows join the batch."""
        import torch

        from schemas.modelspec import left_pad, position_ids

        eng, lm = self.eng, self.lm
        dev = eng.device
        prompts = [s.req.prompt_token_ids for s in seqs]
        entry = self._prefix_for(prompts)
        p = entry.length if entry is not None else 0
        for s in seqs:
            s.cached = p
        ids, mask0 = left_pad([pr[p:] for pr in prompts], eng.pad_id)  # (Bn, Tn) int64: the suffixes
        Bn, Tn = ids.shape
        cache = _full_cache()
        pos_ids = position_ids(mask0)
        if entry is not None:  # layout [prefix | left padding | suffix]; positions go on from p
            cache = entry.cache_for(Bn, None)
            pos_ids = pos_ids + p
            mask0 = torch.cat([torch.ones((Bn, p), dtype=mask0.dtype), mask0], dim=1)
        out = lm.model(input_ids=ids.to(dev), attention_mask=mask0.to(dev), position_ids=pos_ids.to(dev),
                       past_key_values=cache, use_cache=True, logits_to_keep=1)
        if self.n_layers:  # (Bn, Tn, L, k): every prefilled token's expert selection
            pr = captured_routes(lm, Bn, Tn)
            for j, s in enumerate(seqs):
                if entry is not None:
                    s.routes[:p] = entry.routes
                s.routes[p:s.plen] = pr[j, Tn - (s.plen - p):]
        pos = torch.tensor([[s.plen] for s in seqs], dtype=torch.long, device=dev)  # (Bn, 1)
        logits = out.logits[:, -1, :].float()  # (Bn, V)
        if not self.seqs:
            self.cache, self.mask, self.pos, self.logits = out.past_key_values, mask0.to(dev), pos, logits
        else:
            self._concat(out.past_key_values, mask0.to(dev), pos, logits)
        self.seqs += seqs

    def _prefix_for(self, prompts: list[list[int]]):
        """The :class:`serving.prefix_cache.PrefixEntry` to prefill ``prompts`` from (built
        now if worth it, ``serving.prefix_cache.PrefixCache.candidate``), or None: prefix
        caching off, or no shared prefix of ``min_tokens``."""
        pc = self.lm.prefix_cache
        if pc is None:
            return None
        entry = pc.lookup(prompts)
        n = pc.candidate(prompts)
        computed = 0
        if n >= pc.min_tokens and n >= (entry.length if entry is not None else 0) + pc.min_tokens:
            base = entry
            entry = self._build_prefix(tuple(prompts[0][:n]), base)
            computed = n - (base.length if base is not None else 0)
            pc.add(entry)
        if entry is not None:
            pc.used(entry, len(prompts), computed)
        return entry

    def _build_prefix(self, tokens: tuple[int, ...], base):
        """Run ``tokens`` (on top of the entry ``base``, a prefix of them, if given) as one
        batch-1 forward; return their :class:`serving.prefix_cache.PrefixEntry`."""
        import torch

        from serving.prefix_cache import PrefixEntry

        lm, dev = self.lm, self.eng.device
        b = base.length if base is not None else 0
        new = torch.tensor([tokens[b:]], dtype=torch.long, device=dev)  # (1, n - b)
        n = len(tokens)
        out = lm.model(input_ids=new, attention_mask=torch.ones((1, n), dtype=torch.long, device=dev),
                       position_ids=torch.arange(b, n, device=dev).unsqueeze(0),
                       past_key_values=base.cache_for(1, None) if base is not None else _full_cache(),
                       use_cache=True, logits_to_keep=1)
        routes = None
        if self.n_layers:
            rt = captured_routes(lm, n - b).astype(self.route_dtype)
            routes = np.concatenate([base.routes, rt]) if base is not None else rt
        kv = [(layer.keys.contiguous(), layer.values.contiguous()) for layer in out.past_key_values.layers]
        return PrefixEntry(tokens=tokens, kv=kv, routes=routes)

    def _concat(self, cache, mask, pos, logits) -> None:
        """Append prefilled rows: both caches and masks left-padded to one width, then stacked."""
        import torch

        W = max(self.mask.shape[1], mask.shape[1])
        for mine, new in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad_cols(mine.keys, W, 2), _left_pad_cols(new.keys, W, 2)], dim=0)
            mine.values = torch.cat([_left_pad_cols(mine.values, W, 2), _left_pad_cols(new.values, W, 2)], dim=0)
        self.mask = torch.cat([_left_pad_cols(self.mask, W, 1), _left_pad_cols(mask, W, 1)], dim=0)
        self.pos = torch.cat([self.pos, pos], dim=0)
        self.logits = torch.cat([self.logits, logits], dim=0)

    def _keep(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in order); cut the columns that are padding in every kept row."""
        import torch

        self.seqs = [self.seqs[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.pos = self.logits = None
            return
        ix = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, ix)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, ix)
            layer.values = layer.values.index_select(0, ix)
        self.pos = self.pos.index_select(0, ix)
        self.logits = self.logits.index_select(0, ix)
        self._trim()

    def _trim(self) -> None:
        """Cut the leading columns that are padding in every row (mask and cache)."""
        import torch

        c0 = int(torch.nonzero(self.mask.any(dim=0))[0, 0])  # first column any row uses
        if c0:
            self.mask = self.mask[:, c0:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, c0:]
                layer.values = layer.values[:, :, c0:]

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Seq]:
        """Sample one token per row, finish rows, run one decode forward for the rest (with the
        queued joiners' prefill in it when :meth:`_fusable`, else followed by their prefill).

        Per step on the model's device: the sampler's pass over the raw logits ``(B, V)``
        (:meth:`serving.torch_engine.sampler.Sampler.step`: one device -> host transfer of
        ``(B,)`` tokens and behavior logprobs), and after the forward one transfer of the
        step's routes ``(B, L, k)``.

        Returns:
            the rows that finished at this step (already out of the batch).
        """
        import torch

        eng = self.eng
        dev = eng.device
        # rows aborted since the last step leave without sampling another token
        pre = [i for i, s in enumerate(self.seqs) if s.req.cancelled.is_set()]
        done: list[Seq] = [s for s in self.joining if s.req.cancelled.is_set()]
        for s in done:
            s.finish = "abort"
        joining = self.joining = [s for s in self.joining if s.finish is None]  # emptied once they joined
        if pre:
            for i in pre:
                self.seqs[i].finish = "abort"
                done.append(self.seqs[i])
            self._keep([i for i in range(len(self.seqs)) if self.seqs[i].finish is None])
        if not self.seqs:
            if joining:
                self._prefill(joining)
                self.joining = []
            return done
        B = len(self.seqs)
        tok, tok_l, lp_l, tops = self.sampler.step(self.logits, self.seqs, dev)
        now = time.perf_counter()
        for i, s in enumerate(self.seqs):
            s.max_rows = max(s.max_rows, B)
            self._advance(s, int(tok_l[i]), lp_l[i], tops.get(i, []), now)
            if s.finish is not None:
                done.append(s)
        keep = [i for i, s in enumerate(self.seqs) if s.finish is None]
        if len(keep) < B:
            self._keep(keep)
            tok = tok.index_select(0, torch.tensor(keep, dtype=torch.long, device=dev))
        if self.seqs and joining and self._fusable(joining):
            self._decode_with_joins(tok, joining)
        else:
            if self.seqs:
                self._decode(tok)
            if joining:
                self._prefill(joining)
        self.joining = []
        return done

    def _fusable(self, joining: list[Seq]) -> bool:
        """Whether ``joining``'s prefill rides in this step's decode forward: no prefix cache
        (its layout is prefilled on its own) and the padding it adds to the running rows,
        ``running x (longest prompt - 1)`` tokens, is at most the engine's
        ``fused_join_pad_tokens``."""
        if self.lm.prefix_cache is not None:
            return False
        T = max(s.plen for s in joining)
        return len(self.seqs) * (T - 1) <= self.eng.fused_join_pad_tokens

    def _advance(self, s: Seq, t: int, lp: float, tops: list, now: float) -> None:
        """Append one sampled token to ``s``, stream it, and decide whether ``s`` is done."""
        r = s.req
        s.toks.append(t)
        s.lps.append(lp)
        if r.top_logprobs:
            s.tops.append(tops)
        if len(s.toks) == 1:
            s.ttft_ms = (now - s.item.t_submit) * 1000
        r.emit_step(StepOutput(request_id=r.request_id, token_ids=[t], logprobs=[lp],
                               top_logprobs=[tops] if r.top_logprobs else []))
        n = len(s.toks)
        max_pos = self.eng.max_positions
        if t == self.eng.eos_id or t in r.stop_token_ids:
            s.finish = "stop"
        elif r.stop_check is not None and r.stop_check(s.toks):
            s.finish = "stop"
        elif n >= r.sampling.max_tokens:
            s.finish = "length"
        elif r.cancelled.is_set():
            s.finish = "abort"
        elif max_pos and s.plen + n >= max_pos:
            s.finish = "length"

    def _decode(self, tok) -> None:
        """One KV-cached forward of each running row's last token ``tok`` ``(B,)``."""
        import torch

        B = len(self.seqs)
        self.mask = torch.cat([self.mask, torch.ones((B, 1), dtype=self.mask.dtype, device=self.mask.device)], 1)
        out = self.lm.model(input_ids=tok.unsqueeze(1), attention_mask=self.mask, position_ids=self.pos,
                            past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.pos = self.pos + 1
        self.logits = out.logits[:, -1, :].float()
        if self.n_layers:  # (B, L, k): routes of the tokens just fed
            rt = captured_routes(self.lm, B)
            for j, s in enumerate(self.seqs):
                s.routes[s.plen + len(s.toks) - 1] = rt[j]

    def _decode_with_joins(self, tok, joining: list[Seq]) -> None:
        """One forward that decodes the running rows' last tokens ``tok`` ``(R,)`` and
        prefills ``joining``'s prompts (as vLLM mixes prefills into decode steps).

        The forward's input is ``(R + J, T)``, ``T`` the longest joining prompt: a running row
        is ``T - 1`` padding tokens then its token (at its own position), a joining row its
        left-padded prompt over ``W`` empty cache columns (``W`` the cache width). The mask
        hides every padding column, so each row attends to exactly its own tokens, and the
        last column holds every row's next-token logits. Afterwards a running row's ``T - 1``
        padding columns are moved to its left edge (left padding holds again) and columns that
        are padding in every row are cut.
        """
        import torch

        from schemas.modelspec import left_pad, position_ids

        dev = self.mask.device
        R, J = len(self.seqs), len(joining)
        ids_j, mask_j = left_pad([s.req.prompt_token_ids for s in joining], self.eng.pad_id)  # (J, T)
        T, W = ids_j.shape[1], self.mask.shape[1]
        md = self.mask.dtype
        ids_r = torch.full((R, T), self.eng.pad_id, dtype=torch.long, device=dev)
        ids_r[:, -1] = tok
        ones_r = torch.ones((R, 1), dtype=md, device=dev)
        gap = torch.zeros((R, T - 1), dtype=md, device=dev)
        mask = torch.cat([torch.cat([self.mask, gap, ones_r], 1),
                          torch.cat([torch.zeros((J, W), dtype=md, device=dev), mask_j.to(dev)], 1)], 0)
        pos = torch.cat([self.pos.expand(R, T), position_ids(mask_j).to(dev)], 0)  # (R + J, T)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                x = getattr(layer, name)
                setattr(layer, name, torch.cat([x, x.new_zeros((J,) + tuple(x.shape[1:]))], 0))
        out = self.lm.model(input_ids=torch.cat([ids_r, ids_j.to(dev)], 0), attention_mask=mask,
                            position_ids=pos, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        B = R + J
        if self.n_layers:  # (B, T, L, k): routes of every token fed
            rt = captured_routes(self.lm, B, T)
            for j, s in enumerate(self.seqs):
                s.routes[s.plen + len(s.toks) - 1] = rt[j, -1]
            for j, s in enumerate(joining):
                s.routes[:s.plen] = rt[R + j, T - s.plen:]
        if T > 1:  # running rows: [cache | T - 1 padding | token] -> [T - 1 padding | cache | token]
            for layer in self.cache.layers:
                for name in ("keys", "values"):
                    x = getattr(layer, name)
                    run = torch.cat([x.new_zeros(x[:R, :, :T - 1].shape), x[:R, :, :W], x[:R, :, W + T - 1:]], 2)
                    setattr(layer, name, torch.cat([run, x[R:]], 0))
            mask = torch.cat([torch.cat([gap, self.mask, ones_r], 1), mask[R:]], 0)
        self.logits = out.logits[:, -1, :].float()
        self.pos = torch.cat([self.pos + 1, torch.tensor([[s.plen] for s in joining], dtype=torch.long,
                                                          device=dev)], 0)
        self.mask = mask
        self.seqs += joining
        self._trim()
        self.fused_joins += 1

    # ------------------------------------------------------------------ results
    def result(self, s: Seq) -> GenResult:
        """The :class:`GenResult` of a finished row (aligned rescoring applied if enabled:
        :func:`serving.torch_engine.sampler.score_aligned`)."""
        eng, lm = self.eng, self.lm
        t_end = time.perf_counter()
        n = len(s.toks)
        rt = s.routes[:s.plen + n - 1] if s.routes is not None and n else None
        lps = s.lps
        if eng.aligned_logprobs and n and s.finish != "abort":
            lps, rescored = score_aligned(lm, s.req.prompt_token_ids, s.toks, eng.device)
            if rt is not None:  # the routes of the scoring pass go with its logprobs
                rt = rescored.astype(self.route_dtype)
            t_end = time.perf_counter()
        if rt is not None:
            assert rt.shape[0] == s.plen + n - 1, rt.shape
        t_submit = s.item.t_submit
        return GenResult(completion_token_ids=s.toks, behavior_logprobs=lps, top_logprobs=s.tops,
                         expert_routes=rt, finish_reason=s.finish, ttft_ms=s.ttft_ms,
                         latency_ms=(t_end - t_submit) * 1000, version=lm.version, batch_size=max(s.max_rows, 1),
                         queue_ms=max(0.0, (s.t_admit - t_submit) * 1000), cached_tokens=s.cached)
