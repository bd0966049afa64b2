"""Rollout engine backed by an SGLang server, over its HTTP API.

**UNVERIFIED HERE.** SGLang (0.5.x) needs a CUDA torch and an older transformers
than relax's CPU stack, and its server does not start on CPU, so no SGLang server
has run against this code on the machines relax is developed on. The request and
response handling is tested against hand-written fixtures that follow SGLang's public
source (``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``InitWeightsUpdateGroupReqInput``;
``tokenizer_manager.py``: the ``meta_info`` of a response), served by a local HTTP
server in the tests. Nothing from ``sglang`` is imported; only ``requests``.

Endpoints used:

* ``POST /generate`` with ``input_ids`` (a batch), per-request ``sampling_params``
  and ``return_logprob: true``. Each answer item has ``text``, ``output_ids`` and
  ``meta_info`` with ``finish_reason`` (``{"type": "stop" | "length" | "abort", ...}``),
  ``output_token_logprobs`` (``[[logprob, token_id, text_or_null], ...]``) and
  ``weight_version`` (the server's version string when the answer was built).
  Log-probs: SGLang returns log-probs of the temperature-scaled logits unless the
  server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (then raw T = 1 log-probs,
  public case C12): run the server without it.
* Images and audio (a multimodal model): the same ``/generate`` with ``image_data`` /
  ``audio_data``, per prompt a list of ``data:MIME;base64,...`` URLs, and ``input_ids``
  with the chat template's *unexpanded* placeholders (one ``<image>`` per image): SGLang's
  multimodal processors decode the ids and run the model's transformers processor, which
  expands them (``python/sglang/srt/multimodal/processors/``). relax records the prompt
  the same processor expands locally (:func:`relax.trainer.multimodal.encode_prompt`);
  that the two agree is checked against transformers here, never against SGLang.
* ``POST /init_weights_update_group`` (``master_address``, ``master_port``,
  ``rank_offset``, ``world_size``, ``group_name``, ``backend``) and ``POST
  /update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``,
  ``group_name``, ``flush_cache``, ``weight_version``, ``load_format``). With
  ``load_format="flattened_bucket"`` SGLang receives one flat uint8 tensor per call
  whose layout (each tensor's bytes, in order, no padding) is relax's bucket layout
  (``relax.streams.weights.layout.plan_buckets``), so :meth:`SGLangEngine.weight_update_requests`
  makes one request per relax bucket.
* ``POST /pause_generation`` / ``POST /continue_generation`` around a weight update
  (partial rollout: in-flight requests keep their KV cache with ``mode="in_place"`` or
  are retracted; ``abort`` cancels them).

Requests a weight update aborts are continued, never dropped: when a pause for an update
came during a ``/generate`` call, every answer item that ends with ``abort`` is sent again
once the update is over, as its prompt plus the tokens it had (``max_new_tokens`` less
those), and the two parts are joined (:func:`continued`): its tokens keep the version that
produced them (``token_policy_versions``). An abort with no pause during the call (the
server refused the request) stays an ``abort`` (the aggregator drops it as
``error_rollout``). A retracted request goes on inside the server: its tokens span both
versions with no boundary in the answer, so it records ``policy_version_start`` = the
version before the call (its staleness is counted from there).

Weights: a rollout instance's :class:`relax.streams.weights.server.ServerSubscriber` registers
the server in the publisher's group (one member id per TP rank),
asks it to join with ``/init_weights_update_group`` (relax forms its groups on the store
keys of SGLang's ``init_custom_process_group``:
:func:`relax.streams.weights.rendezvous.group_store`), and for every version pauses
generation (``retract``: SGLang flushes its KV cache after an update and asserts the flush
worked, which fails while requests run), has the server receive each bucket, and
continues. That handshake is tested against a receiver that repeats SGLang's group and
bucket code with torch (``tests/consumers/fixtures/sglang/weight_receiver.py``), never
against SGLang itself. A late-joining server gets no checkpoint (SGLang loads those only
through ``/update_weights_from_disk``, from a model folder): it samples with the weights
it started with until the next broadcast.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from relax.consumers.engines.base import Generation, SamplingParams

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def sampling_params_json(params: SamplingParams) -> dict:
    """SGLang ``sampling_params`` for relax :class:`SamplingParams` (top_k 0 -> -1 = off).
    ``no_stop_trim`` keeps a matched stop string in the text (relax keeps the tokens)."""
    out = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "skip_special_tokens": True,
        "no_stop_trim": True,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def generate_request(prompts: list[list[int]], params: SamplingParams,
                     media: list[list[dict] | None] | None = None,
                     max_new_tokens: list[int] | None = None) -> dict:
    """The ``/generate`` JSON body for a batch of token-id prompts; with ``media`` (per
    prompt its media items, see :func:`media_fields`) the multimodal fields too; with
    ``max_new_tokens`` (per prompt, tokens) each prompt's own budget instead of
    ``params.max_new_tokens`` (continued requests)."""
    budgets = max_new_tokens or [params.max_new_tokens] * len(prompts)
    body = {
        "input_ids": [list(map(int, p)) for p in prompts],
        "sampling_params": [sampling_params_json(replace(params, max_new_tokens=n))
                            for n in budgets],
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
    }
    if media is not None:
        body.update(media_fields(media))
    return body


def media_fields(media: list[list[dict] | None]) -> dict:
    """SGLang's ``image_data`` / ``audio_data`` for a batch: per prompt, the list of its
    images' (audio clips') ``data:MIME;base64,...`` URLs, in order (None for a prompt
    without); a field is left out when no prompt has that kind.

    Raises:
        FileNotFoundError: a blob URI that does not exist.
        ValueError: a video item (not sent to SGLang: the rollout refuses such rows).
    """
    import base64

    from relax.trainer.multimodal import item_bytes

    if any(it["kind"] == "video" for items in media for it in items or []):
        raise ValueError("video items are not sent to SGLang (its server samples a clip "
                         "itself; relax stores the frames it sampled): use the HF engine")
    out = {}
    for kind, field in (("image", "image_data"), ("audio", "audio_data")):
        per = [[f"data:{it['mime']};base64,{base64.b64encode(item_bytes(it)).decode()}"
                for it in items or [] if it["kind"] == kind] or None for items in media]
        if any(per):
            out[field] = per
    return out


def parse_version(raw, default: int) -> int:
    """SGLang's ``weight_version`` string as a policy_version (``"default"`` or missing
    -> ``default``)."""
    if raw is None:
        return default
    try:
        return int(str(raw))
    except ValueError:
        return default


def parse_generate_response(body, n: int, default_version: int) -> list[Generation]:
    """Generations from a ``/generate`` answer.

    Args:
        body: the decoded JSON (a list for a batch; a dict for one prompt).
        n: prompts sent.
        default_version: policy_version when the answer has no numeric weight_version.

    Raises:
        ValueError: wrong item count, a missing field, token ids that disagree with
            ``output_ids``, or an unknown finish_reason (names the item and field).
    """
    items = body if isinstance(body, list) else [body]
    if len(items) != n:
        raise ValueError(f"/generate answered {len(items)} item(s) for {n} prompt(s)")
    out = []
    for i, item in enumerate(items):
        meta = item.get("meta_info")
        if not isinstance(meta, dict):
            raise ValueError(f"/generate item {i}: no meta_info")
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise ValueError(
                f"/generate item {i}: meta_info.output_token_logprobs missing "
                f"(was return_logprob sent?)"
            )
        ids = [int(p[1]) for p in pairs]
        lps = [float(p[0]) for p in pairs]
        if "output_ids" in item and list(item["output_ids"]) != ids:
            raise ValueError(
                f"/generate item {i}: output_ids {item['output_ids'][:8]}... differ "
                f"from the token ids of output_token_logprobs {ids[:8]}..."
            )
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        if kind not in _FINISH:
            raise ValueError(
                f"/generate item {i}: finish_reason {fr!r} is not one of {sorted(_FINISH)}"
            )
        v = parse_version(meta.get("weight_version"), default_version)
        out.append(
            Generation(
                token_ids=ids,
                logprobs=lps,
                finish_reason=_FINISH[kind],
                policy_version_start=v,
                policy_version_end=v,
                text=item.get("text", ""),
                meta={"sglang_id": meta.get("id")},
            )
        )
    return out


def token_versions(g: Generation) -> list[int]:
    """``[len(g.token_ids)]`` the policy_version of each token: ``token_policy_versions``
    when known, else ``policy_version_start`` for all (the oldest the tokens can have)."""
    if g.token_policy_versions is not None:
        return list(g.token_policy_versions)
    return [g.policy_version_start] * len(g.token_ids)


def continued(first: Generation, rest: Generation) -> Generation:
    """One generation from an aborted one (``first``) and its continuation (``rest``,
    sampled from the prompt + ``first.token_ids``): tokens and log-probs in order, each
    token with the version that produced it (:func:`token_versions`), the finish reason of
    ``rest``; ``text`` is the two texts joined (callers may decode the tokens again)."""
    versions = token_versions(first) + token_versions(rest)
    return Generation(
        token_ids=list(first.token_ids) + list(rest.token_ids),
        logprobs=list(first.logprobs) + list(rest.logprobs),
        finish_reason=rest.finish_reason,
        policy_version_start=versions[0] if versions else rest.policy_version_start,
        policy_version_end=versions[-1] if versions else rest.policy_version_end,
        token_policy_versions=versions,
        text=first.text + rest.text,
        meta={**rest.meta, "continued": first.meta.get("continued", 0) + 1},
    )


class SGLangError(RuntimeError):
    """An SGLang endpoint answered with an error or ``success: false``."""


class SGLangEngine:
    """Client of one SGLang server (unverified here; see the module docstring).

    Args:
        url: ``http://host:port`` of the server (or router).
        tokenizer: the model's tokenizer (chat template; the server is sent token ids).
        engine_id: name written into rollouts.
        policy_version: version of the weights the server starts with.
        timeout_s: HTTP timeout per request (seconds).
        session: a ``requests.Session`` (default: a new one).
        tp_size: the server's tensor-parallel ranks (each is one member of a weight
            broadcast group).
    """

    receives_broadcast = True
    """Its weights come from the broadcast group into the server, not through this
    process (:class:`relax.streams.weights.server.ServerSubscriber` asks it to join)."""

    def __init__(
        self,
        url: str,
        tokenizer,
        *,
        engine_id: str = "sglang-0",
        policy_version: int = 0,
        timeout_s: float = 600.0,
        session=None,
        tp_size: int = 1,
    ):
        import requests

        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self._session = session or requests.Session()
        self._version = policy_version
        self._pause = threading.Condition()  # the server paused for a weight update
        self._paused = False
        self._pauses = 0  # pause_generation calls so far
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = frozenset({eos} if eos is not None else set())

    @property
    def policy_version(self) -> int:
        """The newest weight version the server reported (or that was installed)."""
        return self._version

    def _post(self, path: str, body: dict):
        r = self._session.post(self.url + path, json=body, timeout=self.timeout_s)
        if r.status_code >= 400:
            raise SGLangError(f"POST {path} -> HTTP {r.status_code}: {r.text[:500]}")
        data = r.json() if r.content else {}
        if isinstance(data, dict) and data.get("success") is False:
            raise SGLangError(f"POST {path} failed: {data.get('message')}")
        return data

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 media: list[list[dict] | None] | None = None) -> list[Generation]:
        """Sample one continuation per prompt (``[N][prompt_len]`` token ids; with
        ``media``, per prompt its media items, and the ids with the placeholders
        unexpanded: see the module docstring). Each generation's policy_version_end is
        the version the server answered with; its policy_version_start is the one before
        the call when a version was received during it (the tokens span both), else the
        same. A request aborted by a weight update is continued after it (module
        docstring), its tokens' versions in ``token_policy_versions``. When the version
        received during the call is older than the one before it (a trainer restarted
        from an older checkpoint: its versions count again from there), every generation
        of the call carries the one before for all its tokens: they span a branch the
        run lost, and the trainer counts them stale.

        Raises:
            SGLangError: HTTP error, or the server still paused for an update after
                ``timeout_s``; ValueError: a malformed answer.
        """
        if not prompts:
            return []
        first = self._version
        gens, paused = self._generate_once(prompts, params, media, None)
        todo = [i for i, g in enumerate(gens) if paused and g.finish_reason == "abort"]
        while todo:
            for i in [i for i in todo if len(gens[i].token_ids) >= params.max_new_tokens]:
                gens[i].finish_reason = "length"  # aborted after its last token
            todo = [i for i in todo if gens[i].finish_reason == "abort"]
            if not todo:
                break
            more, paused = self._generate_once(
                [list(prompts[i]) + gens[i].token_ids for i in todo], params,
                None if media is None else [media[i] for i in todo],
                [params.max_new_tokens - len(gens[i].token_ids) for i in todo])
            for i, g in zip(todo, more):
                gens[i] = continued(gens[i], g)
                gens[i].text = self.tokenizer.decode(gens[i].token_ids, skip_special_tokens=True)
            todo = [i for i in todo if paused and gens[i].finish_reason == "abort"]
        if self._version < first:  # a restarted trainer's older version came in during it
            for g in gens:  # tokens of a lost branch in each: the trainer drops them as stale
                g.policy_version_start = g.policy_version_end = first
                if g.token_policy_versions is not None:
                    g.token_policy_versions = [first] * len(g.token_policy_versions)
        return gens

    def _generate_once(self, prompts, params, media, budgets) -> tuple[list[Generation], bool]:
        """One ``/generate`` call, sent once no weight update holds the server paused;
        returns its generations and whether a pause for an update came during it."""
        self._wait_unpaused()
        before, pauses = self._version, self._pauses
        body = self._post("/generate", generate_request(prompts, params, media, budgets))
        paused = self._pauses != pauses
        # a version was received during the call, or is being received: a pause for an
        # update came, and the answer may carry the new version before receive_weights
        # has set it here (an aborted request's tokens are still the version before)
        changed = paused or self._version != before
        # "default": the server has had no update since it started, so nor during the call
        gens = parse_generate_response(body, len(prompts), before)
        for g in gens:
            if changed:  # retracted requests went on with the new weights
                g.policy_version_start = min(g.policy_version_start, before)
            else:  # (a version received during the call is already self._version)
                self._version = max(self._version, g.policy_version_end)
        return gens, paused

    def _wait_unpaused(self) -> None:
        with self._pause:
            if not self._pause.wait_for(lambda: not self._paused, self.timeout_s):
                raise SGLangError(f"the server is still paused for a weight update after "
                                  f"{self.timeout_s:g} s")

    def update_weights(self, named_tensors: dict, policy_version: int) -> None:
        """Not available: the server receives weights from the broadcast group
        (:meth:`receive_weights`); raises NotImplementedError."""
        raise NotImplementedError(
            "SGLang engines receive weights through "
            "init_weights_update_group/update_weights_from_distributed; "
            "in-process tensors cannot be handed to a server"
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> dict:
        """Ask the server to join a broadcast group (its TP ranks take ranks
        ``rank_offset .. rank_offset + tp - 1`` of ``world_size``)."""
        return self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": int(rank_offset),
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            },
        )

    @staticmethod
    def weight_update_requests(announcement: dict, *, flush_cache: bool = True) -> list[dict]:
        """``/update_weights_from_distributed`` bodies for a WEIGHTS announcement: one per
        relax bucket, ``load_format="flattened_bucket"``, ``weight_version`` = the
        policy_version (cache flushed after the last one only)."""
        from relax.streams.weights.layout import manifest_from_rows, plan_buckets

        manifest = manifest_from_rows(announcement["manifest"])
        buckets = plan_buckets(manifest, announcement["bucket_bytes"])
        out = []
        for k, (_, _, idx) in enumerate(buckets):
            out.append(
                {
                    "names": [manifest[i].name for i in idx],
                    "dtypes": [manifest[i].dtype for i in idx],
                    "shapes": [list(manifest[i].shape) for i in idx],
                    "group_name": announcement["group_name"],
                    "flush_cache": flush_cache and k == len(buckets) - 1,
                    "weight_version": str(announcement["policy_version"]),
                    "load_format": "flattened_bucket",
                }
            )
        return out

    def receive_weights(self, announcement: dict, pause_mode: str = "retract") -> int:
        """Have the server receive an announced version from its broadcast group (the
        publisher broadcasts the same buckets meanwhile), generation paused around it
        (``pause_mode``, see :meth:`pause_generation`; requests retracted go on with the
        new weights); returns the new version.

        Raises:
            SGLangError: a request failed (the server's weights may be partly updated;
                generation is continued either way).
        """
        try:
            self.pause_generation(pause_mode)
            for body in self.weight_update_requests(announcement):
                self._post("/update_weights_from_distributed", body)
            self._version = int(announcement["policy_version"])
        finally:
            self.continue_generation()
        return self._version

    def pause_generation(self, mode: str = "abort") -> dict:
        """``/pause_generation`` (``abort`` cancels in-flight requests, which
        :meth:`generate` then continues; ``retract`` / ``in_place`` keep them for
        :meth:`continue_generation`). No request is sent until that call."""
        with self._pause:
            self._pauses += 1
            self._paused = True
        return self._post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        """``/continue_generation``: resume after a pause (requests wait no longer, even
        when this call fails)."""
        try:
            return self._post("/continue_generation", {})
        finally:
            with self._pause:
                self._paused = False
                self._pause.notify_all()
