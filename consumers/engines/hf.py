"""Rollout engine on Hugging Face transformers (CPU or GPU).

Sampling loop (batched, with a KV cache):

* identical prompts (the G samples of a group) are prefilled once and their KV
  cache is shared; prompts are left-padded; the attention mask and position ids
  come from the prompt *lengths* (never from token values: pad id == EOS id for SmolLM2,
  public case C24), so padded rows see exactly what an unpadded forward sees;
* at each step the next-token logits of every row are scaled by ``1 /
  temperature``, filtered by top-k / top-p for *sampling*, and the sampled
  token's log-prob is taken by :func:`relax.trainer.logprobs.token_logprobs` over
  the full vocabulary of the scaled logits: the same function the trainer uses,
  so the ratio is 1 for identical weights (public case C12; top-p/top-k
  convention documented in ``trainer/logprobs.py``);
* a row finishes with ``stop`` on a stop token id (the tokenizer's EOS, the
  model's ``generation_config.eos_token_id`` such as an end-of-turn token, or any
  extra ``stop_token_ids``; the token is kept) or when a stop string appears in its
  decoded output (the tokens through the one completing it are kept), and with
  ``length`` at ``max_new_tokens``. The reason is per row (public case C23:
  overlong filtering reads ``finish_reason``, not the last token id).

Weights (double buffering): :meth:`HFEngine.update_weights` copies the new tensors
into a second set of buffers (never into the live weights) and marks them pending;
at the next safe point the live parameters and the buffers trade storage (a pointer
swap, no copy), so generation waits microseconds, not a copy. Safe points: the
start of every :meth:`HFEngine.generate` call, and with ``partial_rollout=True`` also
every ``chunk_tokens`` generated tokens. Without partial rollout no sequence mixes
two policy versions. With it, the KV cache is kept from chunk to chunk while no swap
happens; at a swap it is dropped and the prefix (prompt + tokens so far) is re-encoded
with the new weights, and every token records the policy_version that produced it
(``token_policy_versions``).
:meth:`HFEngine.hold` defers swaps over several generate calls (a multi-turn episode).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from relax.consumers.engines.base import Generation, SamplingParams
from relax.consumers.engines.next_token import filter_logits, sample
from relax.streams.weights.layout import copy_tensor_
from relax.trainer.families import family_of
from relax.trainer.logprobs import token_logprobs
from relax.trainer.multimodal import cache_arg, kv_cache


@dataclass
class EngineStats:
    """Counters of one engine: generate calls, sampled tokens, seconds generating,
    weight swaps and the seconds generation was blocked by them (``swap_blocked_s``)."""

    generate_calls: int = 0
    tokens: int = 0
    generate_s: float = 0.0
    swaps: int = 0
    swap_blocked_s: float = 0.0
    staged_updates: int = 0


def _stop_ids(tokenizer, model, extra) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    ids.update(int(i) for i in extra or ())
    return frozenset(ids)


class _Row:
    """Generation state of one sequence (``media``: its prompt's media inputs, or None)."""

    __slots__ = ("finish_reason", "logprobs", "media", "prompt", "tokens", "versions")

    def __init__(self, prompt: list[int], media: dict | None = None):
        self.prompt = prompt
        self.media = media or None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None


class HFEngine:
    """Batched sampling with a transformers causal LM; see the module docstring.

    Args:
        model: a built-in model name / folder / Hub id (loaded with
            :func:`relax.trainer.models.load`) or a loaded ``PreTrainedModel``.
        tokenizer: the tokenizer (required when ``model`` is a module; used for
            stop ids, stop strings and ``Generation.text``).
        engine_id: name written into every rollout (``engine_id``).
        device: where a model given by name is placed (default: cuda if available).
        dtype: parameter dtype of a model given by name.
        policy_version: version of the initial weights (0 = the initial model).
        stop_token_ids: extra token ids that end a sequence with ``stop``. Pass
            ``use_default_stop_ids=False`` to use only these.
        partial_rollout: allow weight swaps between chunks of one generate call.
        chunk_tokens: tokens generated between safe points in partial-rollout mode.
        safe_point_hook: called with the engine at every safe point, before a pending
            swap is applied (instrumentation and tests).
        own_weights: copy CPU parameters into memory of their own at start (a loaded
            checkpoint is mapped from its file: the second swap would fault every page
            in, in a step's critical path). False for an engine that never swaps (the
            colocated one shares the trainer's parameters): the copy would be a second
            model in memory while both exist (measured: a 0.5B bf16 model's load peaked at
            2.75 GB with it, against the model's 0.95 GB).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        engine_id: str = "hf-0",
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        policy_version: int = 0,
        stop_token_ids=(),
        use_default_stop_ids: bool = True,
        partial_rollout: bool = False,
        chunk_tokens: int = 32,
        safe_point_hook=None,
        own_weights: bool = True,
    ):
        if isinstance(model, str):
            from relax.trainer.models import load

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            model, loaded_tok = load(model, dtype=dtype, device=device)
            tokenizer = tokenizer or loaded_tok
        if tokenizer is None:
            raise ValueError("HFEngine needs a tokenizer when given a model object")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        self.model = model.eval()
        self._cache_arg = cache_arg(self.model)  # past_key_values, or cache (renamed)
        self.family = family_of(getattr(self.model, "config", None))  # media inputs, positions
        self.tokenizer = tokenizer
        self.engine_id = engine_id
        self.partial_rollout = partial_rollout
        self.chunk_tokens = chunk_tokens
        self.safe_point_hook = safe_point_hook
        self.stop_token_ids = (
            _stop_ids(tokenizer, model, stop_token_ids)
            if use_default_stop_ids
            else frozenset(int(i) for i in stop_token_ids)
        )
        self.pad_token_id = (
            tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else next(iter(self.stop_token_ids), 0)
        )
        self.device = next(model.parameters()).device
        self.stats = EngineStats()
        self._version = policy_version
        self._pending: int | None = None
        self._spare: dict[int, torch.Tensor] | None = None
        self._stage_lock = threading.Lock()
        self._holds = 0
        self._params = self._unique_params()
        # The loader maps the checkpoint copy-on-write (safetensors); the swap makes the
        # loaded tensors the spare buffers of the second update, whose copy then faulted
        # every page in (SmolLM2-135M: 1.7 s instead of 0.07 s, in a sync step's critical
        # path). Memory of their own now, equal values, before any generate runs.
        with torch.no_grad():
            for p in self._params if own_weights else ():
                if p.device.type == "cpu":
                    p.data = p.data.clone()
        self._by_name = self._name_index()

    # ------------------------------------------------------------------ weights
    def _unique_params(self) -> list[torch.nn.Parameter]:
        seen, out = set(), []
        for _, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def _name_index(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters(remove_duplicate=False))

    @property
    def policy_version(self) -> int:
        """Version of the weights generation currently uses."""
        return self._version

    @property
    def pending_version(self) -> int | None:
        """Version staged by :meth:`update_weights` and not yet swapped in, or None."""
        return self._pending

    def update_weights(self, named_tensors: dict, policy_version: int) -> None:
        """Stage new weights; they take effect at the next safe point.

        Checks the whole update first (names, shapes, every parameter covered), then
        copies ``named_tensors`` into the spare buffers (:meth:`staging`); live weights
        are untouched, so this may run in another thread while :meth:`generate` runs. A
        second call before the swap overwrites the staged weights (the newest version
        wins); a call that raises before the copy leaves the staged weights as they
        were, one that fails during it leaves nothing staged: a swap never installs a
        mix of two updates.

        Args:
            named_tensors: ``{name: tensor}`` with the model's parameter names
                (``model.named_parameters()`` or ``state_dict()`` names; tied aliases
                such as ``lm_head.weight`` may be given or omitted). Every parameter
                must be covered.
            policy_version: version of these weights; below the current one after a
                trainer restarted from a checkpoint older than its last version (its
                versions count again from there; the subscriber decides what is newer).

        Raises:
            KeyError: a name that is not a parameter of the model (lists a few valid ones).
            ValueError: a shape mismatch, or a parameter not covered.
        """
        shapes = {name: tuple(t.shape) for name, t in named_tensors.items()}
        with self.staging(shapes, policy_version) as spare, torch.no_grad():
            for name, t in named_tensors.items():
                copy_tensor_(spare[name], t)

    @contextmanager
    def staging(self, shapes: dict[str, tuple[int, ...]],
                policy_version: int) -> Iterator[dict[str, torch.Tensor]]:
        """Stage ``policy_version`` by writing into the spare buffers (allocated once,
        the live parameters' shapes, dtypes and device) directly, so a receiver copies
        each tensor once, from its source into what the swap installs.

        Checks ``shapes`` (``{name: shape}`` to be written) as :meth:`update_weights`
        checks its tensors, then yields ``{name: spare buffer}`` for every parameter name
        (tied aliases share one). The version is staged when the block ends; nothing is
        staged when it raises (the buffers then hold no whole version).

        Raises:
            KeyError, ValueError: as :meth:`update_weights`, before any buffer is touched.
        """
        covered = set()  # check the whole update before touching a buffer
        for name, shape in shapes.items():
            p = self._by_name.get(name)
            if p is None:
                raise KeyError(f"{name!r} is not a parameter of the model (valid names look "
                               f"like: {', '.join(list(self._by_name)[:5])}, ...)")
            if tuple(shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(shape)} != parameter shape "
                                 f"{tuple(p.shape)}")
            covered.add(id(p))
        missing = [n for n, p in self._by_name.items() if id(p) not in covered]
        if missing:
            raise ValueError(f"update for policy_version {policy_version} does not cover "
                             f"{len(missing)} parameter(s), e.g. {missing[:3]}")
        with self._stage_lock:
            if self._spare is None:
                self._spare = {id(p): torch.empty_like(p.data) for p in self._params}
            self._pending = None  # the spare buffers are about to be overwritten
            yield {name: self._spare[id(p)] for name, p in self._by_name.items()}
            self._pending = policy_version
            self.stats.staged_updates += 1

    def apply_pending(self) -> bool:
        """Swap staged weights in now if there are any and no hold is active; a safe
        point for callers (the rollout stage calls it between groups).

        Returns:
            True if a swap happened.
        """
        if self.safe_point_hook is not None:
            self.safe_point_hook(self)
        if self._pending is None or self._holds:
            return False
        t0 = time.perf_counter()
        if not self._stage_lock.acquire(blocking=False):
            return False  # a copy into the spare buffers is under way: next safe point
        try:
            if self._pending is None:  # a copy failed since the check above: nothing staged
                return False
            with torch.no_grad():
                for p in self._params:
                    live = p.data
                    p.data = self._spare[id(p)]
                    self._spare[id(p)] = live
            self._version, self._pending = self._pending, None
            self.stats.swaps += 1
        finally:
            self._stage_lock.release()
            self.stats.swap_blocked_s += time.perf_counter() - t0
        return True

    @contextmanager
    def hold(self):
        """Defer weight swaps until the block ends (nested holds are counted), so several
        generate calls (the turns of one episode) use one policy_version; the outermost
        block's end is a safe point: staged weights are swapped in there (multi-turn
        rollouts call generate only inside holds, so without it they would never be)."""
        self._holds += 1
        try:
            yield self
        finally:
            self._holds -= 1
            if not self._holds:
                self.apply_pending()

    # --------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 media: list[dict | None] | None = None) -> list[Generation]:
        """Sample one continuation per prompt.

        Args:
            prompts: ``[N][prompt_len]`` token ids (each non-empty; a multimodal model's
                with the processor's media placeholders expanded).
            params: sampling settings.
            media: per prompt, its media inputs for a multimodal model
                (:func:`relax.trainer.multimodal.encode_prompt`: ``pixel_values``
                ``[1, n, 3, H, W]``, ``input_features`` ``[n, mel, frames]``, ...), or
                None; the same dict object for the samples of one prompt. Passed to the
                model at every prefill.

        Returns:
            ``N`` :class:`Generation` in prompt order.

        Raises:
            ValueError: an empty prompt, or ``media`` not one per prompt.
        """
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: at least one token is needed")
        if media is not None and len(media) != len(prompts):
            raise ValueError(f"{len(media)} media entries for {len(prompts)} prompts")
        if not prompts:
            return []
        t0 = time.perf_counter()
        self.apply_pending()
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        rows = [_Row(list(map(int, p)), m) for p, m in zip(prompts, media or [None] * len(prompts))]
        active = rows
        while active:  # more than once only when a swap lands between chunks
            self._run(active, params, params.max_new_tokens, gen,
                      self.chunk_tokens if self.partial_rollout else None)
            active = [r for r in rows if r.finish_reason is None]
            # a swap back to an older version (a restarted trainer counts again from its
            # checkpoint): the tokens so far are of a lost branch; they are sampled again
            for r in active:
                if r.versions and r.versions[-1] > self._version:
                    r.tokens, r.logprobs, r.versions = [], [], []
        out = [self._to_generation(r) for r in rows]
        self.stats.generate_calls += 1
        self.stats.tokens += sum(len(r.tokens) for r in rows)
        self.stats.generate_s += time.perf_counter() - t0
        return out

    def _to_generation(self, r: _Row) -> Generation:
        versions = r.versions
        return Generation(
            token_ids=r.tokens,
            logprobs=r.logprobs,
            finish_reason=r.finish_reason or "length",
            policy_version_start=versions[0] if versions else self._version,
            policy_version_end=versions[-1] if versions else self._version,
            token_policy_versions=list(versions) if self.partial_rollout else None,
            text=self.tokenizer.decode(r.tokens, skip_special_tokens=True),
        )

    def _forward(self, input_ids, attention_mask, position_ids, cache, **media_inputs):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
            **media_inputs,
        )
        return out.logits[:, -1, :], kv_cache(out)

    @torch.no_grad()
    def _run(self, rows: list[_Row], params: SamplingParams, budget: int, gen,
             chunk: int | None = None) -> None:
        """Generate up to ``budget`` more tokens for ``rows`` (fresh KV cache; the prefix
        is prompt + tokens so far), setting ``finish_reason`` of rows that end. With
        ``chunk``, every ``chunk`` tokens is a safe point: a swap there ends the call (rows
        go on in a new one, whose prefill re-encodes them with the new weights); without
        one the KV cache is kept."""
        from transformers import DynamicCache

        from relax.trainer.multimodal import stack_media

        version = self._version
        # identical prefixes (the G samples of a group) are prefilled once; the KV cache
        # and the next-token logits are then expanded to every row
        unique: dict[tuple, _Row] = {}  # (prefix, its media inputs) -> first row with it
        for r in rows:
            unique.setdefault((tuple(r.prompt + r.tokens), id(r.media)), r)
        index = {k: i for i, k in enumerate(unique)}
        which = [index[(tuple(r.prompt + r.tokens), id(r.media))] for r in rows]
        prefixes = [k[0] for k in unique]
        inputs = {k: v.to(self.device) for k, v in
                  stack_media([r.media or {} for r in unique.values()], self.family).items()}
        lengths = torch.tensor([len(p) for p in prefixes], device=self.device)
        width = int(lengths.max())
        ids = torch.full(
            (len(prefixes), width), self.pad_token_id, dtype=torch.long, device=self.device
        )
        for i, p in enumerate(prefixes):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long, device=self.device)
        positions = torch.arange(width, device=self.device)[None, :]
        attn = (positions >= (width - lengths)[:, None]).long()  # from lengths (C24)
        # [U, P] 1-D positions, or [3, U, P] multimodal RoPE; delta [U, 1]: what the
        # family adds to a later token's 1-D position (relax.trainer.families)
        pos_ids, delta = self.family.positions(self.model, ids, attn, inputs)
        logits, cache = self._forward(ids, attn, pos_ids, DynamicCache(), **inputs)
        if len(prefixes) < len(rows):
            index = torch.tensor(which, device=self.device)
            cache.batch_select_indices(index)
            logits, attn, lengths, delta = logits[index], attn[index], lengths[index], delta[index]
        next_pos = lengths + delta[:, 0]
        max_stop = max((len(s) for s in params.stop), default=0)
        done = [False] * len(rows)
        for step in range(1, budget + 1):
            remaining = [params.max_new_tokens - len(r.tokens) for r in rows]
            scaled = logits.float() / params.temperature
            probs = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1)
            tok = sample(probs, gen)  # [B, 1]
            lp = token_logprobs(logits[:, None, :], tok, params.temperature)[:, 0]
            tok_list, lp_list = tok[:, 0].tolist(), lp.tolist()
            for i, r in enumerate(rows):
                if done[i] or remaining[i] <= 0:
                    continue
                t = tok_list[i]
                r.tokens.append(t)
                r.logprobs.append(lp_list[i])
                r.versions.append(version)
                if (
                    t in self.stop_token_ids
                    or max_stop
                    and self._hit_stop_string(r.tokens, params.stop, max_stop)
                ):
                    r.finish_reason = "stop"
                elif len(r.tokens) >= params.max_new_tokens:
                    r.finish_reason = "length"
                if r.finish_reason is not None:
                    done[i] = True
            if all(done) or chunk and step % chunk == 0 and self.apply_pending():
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            logits, cache = self._forward(tok, attn, next_pos[:, None], cache)
            next_pos = next_pos + 1

    def _hit_stop_string(self, tokens: list[int], stops: tuple[str, ...], max_stop: int) -> bool:
        tail = self.tokenizer.decode(tokens[-(2 * max_stop + 4) :], skip_special_tokens=False)
        return any(s in tail for s in stops)
