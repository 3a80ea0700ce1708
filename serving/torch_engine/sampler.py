"""The torch engine's sampler: what one step records per token.

Per running batch and step (:class:`Sampler`): the token of every row from the raw logits of
its next token (greedy ``argmax``, or temperature, top-k and top-p with the row's own CPU
``torch.Generator``: :class:`BatchFilter`), its behavior logprob (the raw ``log_softmax`` at
temperature 1, unfiltered: what the learner's importance ratio divides by) and the top
logprobs a request asked for. Per forward: the expert routes it selected
(:func:`captured_routes`, vLLM's layout). Per finished request, with ``aligned_logprobs``: the
behavior logprobs and routes of one unpadded rescoring forward (:func:`score_aligned`).

The draw of a sampled row depends only on its logits, its parameters and its generator, so a
seeded request gets the same tokens alone or in any batch, on any device.
"""

from __future__ import annotations

from typing import Any

TOP_P_CANDIDATES = 256  # largest logits a top-p row is first filtered among (see BatchFilter._top_p)


class BatchFilter:
    """Temperature, top-k and top-p for the sampled rows of a batch, as batched tensor ops.

    Semantics per row (same as vLLM's): divide the raw logits by the temperature; keep the
    ``top_k`` largest (0 = all; ties with the k-th kept); keep the smallest prefix of the
    sorted distribution whose mass reaches ``top_p``; draw one token from the softmax of
    what is left with the row's own ``torch.Generator``. Filtering only picks the token: the
    logged behavior logprob stays the raw one. A row's top-p prefix is looked for among its
    ``TOP_P_CANDIDATES`` largest logits first (:meth:`_top_p`).

    Args:
        params: one :class:`schemas.events.SamplingParams` per sampled row (temperature > 0).
    """

    def __init__(self, params):
        import torch

        self.temp = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)  # (S, 1)
        self.k = [p.top_k if p.top_k and p.top_k > 0 else 0 for p in params]
        self.top_p = [float(p.top_p) for p in params]
        self.k_rows = [j for j, k in enumerate(self.k) if k]
        self.p_rows = [j for j, p in enumerate(self.top_p) if p < 1.0]
        if self.p_rows:
            self.p_ix = torch.tensor(self.p_rows, dtype=torch.long)
            self.p_val = torch.tensor([self.top_p[j] for j in self.p_rows], dtype=torch.float32).unsqueeze(1)

    def _top_p(self, xp) -> Any:
        """The top-p rows' logits ``(R, V)`` with everything outside each row's smallest
        sorted prefix of mass >= top_p set to -inf. A row is sorted whole only when its
        ``TOP_P_CANDIDATES`` largest logits hold less than its top_p; the kept set, hence the
        draw, does not depend on which way it was found."""
        import torch

        def keep_prefix(sx, si, probs, p_val):
            """Rows ``(n, V)``: -inf but the sorted logits ``sx`` (at ``si``, with their
            whole-row probabilities ``probs``) of each row's smallest prefix with mass >= ``p_val``."""
            drop = probs.cumsum(-1) - probs > p_val
            return sx.new_full((sx.shape[0], V), float("-inf")).scatter(1, si, sx.masked_fill(drop, float("-inf")))

        V = xp.shape[-1]
        lse = torch.logsumexp(xp, dim=-1, keepdim=True)  # (R, 1)
        sx, si = torch.topk(xp, min(TOP_P_CANDIDATES, V), dim=-1)  # (R, K) descending
        probs = torch.exp(sx - lse)
        out = keep_prefix(sx, si, probs, self.p_val)
        short = torch.nonzero(probs.sum(-1, keepdim=True) < self.p_val)[:, 0]  # (R',) prefix beyond the K
        if short.numel():
            fx, fi = torch.sort(xp.index_select(0, short), dim=-1, descending=True)
            out.index_copy_(0, short, keep_prefix(fx, fi, torch.exp(fx - lse.index_select(0, short)),
                                                  self.p_val.index_select(0, short)))
        return out

    def sample(self, logits, gens) -> Any:
        """Token ids ``(S,)`` int64 from raw logits ``(S, V)`` float32 (CPU), one generator per row."""
        import torch

        x = logits / self.temp  # (S, V)
        V = x.shape[-1]
        rows = [j for j in self.k_rows if self.k[j] < V]
        if rows:
            kmax = max(self.k[j] for j in rows)
            vals = torch.topk(x[rows], kmax, dim=-1).values  # (R, kmax) descending
            kth = vals.gather(1, torch.tensor([[self.k[j] - 1] for j in rows]))  # (R, 1) k-th largest
            xr = x[rows]
            x[rows] = xr.masked_fill(xr < kth, float("-inf"))
        if self.p_rows:
            x.index_copy_(0, self.p_ix, self._top_p(x.index_select(0, self.p_ix)))
        probs = torch.softmax(x, dim=-1)  # (S, V)
        return torch.cat([torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(gens)])


class Sampler:
    """The sampler of one running batch: picks every row's next token and its behavior logprob.

    Rows are the batch's sequences in order; each has ``gen`` (its CPU ``torch.Generator``,
    None for a greedy row) and ``req`` (its :class:`serving.params.GenRequest`: ``sampling``,
    ``top_logprobs``). The :class:`BatchFilter` is rebuilt only when the set of sampled rows
    changes.
    """

    def __init__(self):
        self._filter_key: tuple | None = None
        self._filter: BatchFilter | None = None

    def _sampled_rows(self, rows: list) -> tuple[list[int], BatchFilter | None]:
        """(indices of the sampled rows, their filter)."""
        samp = [i for i, s in enumerate(rows) if s.gen is not None]
        key = tuple(id(rows[i]) for i in samp)
        if key != self._filter_key:
            self._filter_key = key
            self._filter = BatchFilter([rows[i].req.sampling for i in samp]) if samp else None
        return samp, self._filter

    def step(self, logits, rows: list, device) -> tuple[Any, list[float], list[float], dict]:
        """One token per row from the raw next-token logits.

        On ``device``: one ``log_softmax`` over ``logits`` ``(B, V)`` float32, one ``argmax``
        for greedy rows, the filtered draw of sampled rows (on CPU, each with its own
        generator), one gather of the behavior logprobs, then one device -> host transfer
        of the ``(B,)`` tokens and logprobs.

        Returns:
            ``(tok, tokens, logprobs, tops)``: ``tok`` the tokens ``(B,)`` int64 on
            ``device`` (the next decode forward's input), ``tokens`` / ``logprobs`` the same
            tokens and their raw behavior logprobs as host lists (float64 values of the
            float32 logprobs), ``tops`` ``{row: [(token, raw logprob), ...]}`` for the rows
            that asked for top logprobs.
        """
        import torch

        logp = torch.log_softmax(logits, dim=-1)  # (B, V) raw distribution (temperature 1)
        tok = torch.argmax(logits, dim=-1)  # (B,) greedy choice
        samp, filt = self._sampled_rows(rows)
        if samp:
            ix = torch.tensor(samp, dtype=torch.long, device=device)
            picked = filt.sample(logits.index_select(0, ix).cpu(), [rows[i].gen for i in samp])  # (S,)
            tok = tok.index_copy(0, ix, picked.to(device))
        lp = logp.gather(1, tok.unsqueeze(1)).squeeze(1)  # (B,) behavior logprobs
        tok_l, lp_l = torch.stack([tok.double(), lp.double()]).tolist()  # the step's one device sync
        return tok, tok_l, lp_l, top_logprobs(logp, rows)


def top_logprobs(logp, rows: list) -> dict[int, list[tuple[int, float]]]:
    """``{row: [(token, raw logprob), ...]}`` (each row's ``req.top_logprobs`` largest) for
    the rows of ``logp`` ``(B, V)`` that asked for top logprobs."""
    import torch

    want = [i for i, s in enumerate(rows) if s.req.top_logprobs]
    if not want:
        return {}
    n = max(rows[i].req.top_logprobs for i in want)
    tv, ti = torch.topk(logp.index_select(0, torch.tensor(want, device=logp.device)), min(n, logp.shape[-1]))
    tv, ti = tv.tolist(), ti.tolist()
    return {i: list(zip(ti[j], tv[j]))[:rows[i].req.top_logprobs] for j, i in enumerate(want)}


def new_generator(seed: int | None) -> Any:
    """A CPU ``torch.Generator`` seeded with ``seed`` (a random seed when None): a sampled
    request's own source of draws."""
    import torch

    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
    return gen


def captured_routes(lm, *lead: int) -> Any:
    """The expert routes of ``lm``'s last forward as a host array ``(*lead, L, k)`` int64,
    ``lead`` the forward's token layout (``(B,)``, ``(B, T)``, ``(T,)``): per fed token and
    transformer layer the ``k`` selected experts, zeros for dense layers (vLLM's layout).
    The forward hooks of :func:`serving.torch_engine.loader.wrap` fill them."""
    import torch

    k = lm.route_dims[1]
    return torch.stack([b.view(*lead, k) for b in lm.layer_routes()], dim=len(lead)).cpu().numpy()


def score_aligned(lm, prompt: list[int], completion: list[int], device) -> tuple[list[float], Any]:
    """Behavior logprobs and routes of one completion from one unpadded batch-1 forward in
    the learner's layout (:func:`schemas.modelspec.teacher_forced_inputs`,
    :func:`schemas.modelspec.token_logprobs`), so the learner's replay of the sample is the
    same computation on the same shapes (``aligned_logprobs``, docs/decisions.md D11).

    Returns:
        ``(logprobs, routes)``: ``C`` floats, and ``(P + C - 1, L, k)`` int64 or None for a
        dense model.
    """
    from schemas.modelspec import teacher_forced_inputs, token_logprobs

    x = {k: v.to(device) for k, v in teacher_forced_inputs(prompt, completion).items()}
    out = lm.model(input_ids=x["input_ids"], attention_mask=x["attention_mask"], position_ids=x["position_ids"],
                   use_cache=False)
    lp = token_logprobs(out.logits, x["target_ids"])[0, -len(completion):]  # (C,)
    routes = captured_routes(lm, x["input_ids"].shape[1]) if lm.route_buf else None  # (P + C - 1, L, k)
    return lp.cpu().tolist(), routes
