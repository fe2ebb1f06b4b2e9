"""The engine: add_request / step / abort over the scheduler, the KV manager and the model runner.

Every step is plan -> execute -> commit: the scheduler and KV manager decide the slices and transfers,
the runner executes them, and only then are the computed slices published to the prefix index, the
sampled tokens appended, and events emitted. Owns *exactly one terminal event per accepted request*
(invariant 9): finishing goes through `_finish`, which releases the request's KV and emits it.

A step's sampled tokens stay on the device (`inflight.InflightStep`) until the host commits them
(`_accept_tokens`), with async scheduling after the next step was launched on them (`async_steps`). The engine
takes each step's transfer plan from the KV manager and hands it to the runner; a step that fails is lost alone,
its plan still run (`lost_steps`). A decision's questions fork from their material (`decision_forks`).
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..decision.questions import readout
from ..distributed.tensor_parallel import TPGroup
from ..kv.manager import KVCacheManager
from ..media.prepare import PreparedImage
from . import async_steps, decision_forks, lost_steps
from .config import EngineConfig
from .detokenize import TextStream
from .inflight import InflightStep
from .inputs import InputProcessor, PreparedPrompt, read_processor_configs
from .penalty_counts import PenaltyCounts, PenaltyTableOutOfMemory
from .rank import build_rank_runner, check_rank_devices
from .request import (
    Branch,
    FinishReason,
    Request,
    RequestError,
    RequestOutput,
    RequestState,
    TokenLogprobs,
)
from .sampler import make_generator, sample, take_rows, token_logprobs
from .sampling import SamplingParams, SamplingParamsError
from .scheduler import ScheduledSlice, Scheduler, SchedulerOutput
from .step_payload import MediaWork
from .tp_workers import Followers, build_rank_0_runner, launch_followers

log = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine can serve no more requests (its tensor-parallel ranks were stopped): a server answers 503."""

    status = 503


@dataclass
class EngineStats:
    requests_finished: int = 0
    preemptions: int = 0
    async_steps: int = 0  # decode steps launched before the host read the previous step's tokens
    async_chunk_steps: int = 0  # ... of which carried a prefill chunk beside the decode rows
    scheduled_ahead_steps: int = 0  # ... of which the scheduler scheduled (requests were waiting)


def logits_rows(sampled: list[bool]) -> list[int | None]:
    """The logits row of each slice of a step (one per sampling slice, in order), None where it does not sample."""
    rows, row = [], 0
    for flag in sampled:
        rows.append(row if flag else None)
        row += flag
    return rows


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        model_id = self.config.model_id or str(self.model_dir.resolve())
        read_processor_configs(self.model_dir)  # before the weights load: a bad setting fails the start at once
        self._followers: Followers | None = None
        if self.config.tensor_parallel_size > 1:
            self._followers = launch_followers(self.model_dir, self.config)
            group = self._followers.group
            self.runner, self.max_model_len = build_rank_0_runner(self._followers, self.model_dir, self.config)
        else:
            check_rank_devices(self.config)
            group = TPGroup.single(self.config.resolved_device())
            self.runner, self.max_model_len = build_rank_runner(self.model_dir, self.config, group)
        if self._followers is not None:
            self.runner.publish = self._followers.send
            self._followers.release_graphs = self.runner.release_cuda_graphs
            weakref.finalize(self, self._followers.close)
        model, layout = self.runner.model, self.runner.layout
        # An image is encoded in one step: one larger than a step's tokens is downscaled to fit (`within_tokens`).
        self.inputs = InputProcessor(self.model_dir, model_id=model_id, cache_bytes=self.config.preprocess_cache_bytes,
                                     max_image_tokens=self.config.max_num_batched_tokens,
                                     max_image_pixels=self.config.max_image_pixels,
                                     max_video_pixels=self.config.max_video_pixels,
                                     max_text_tokens=self.max_prompt_tokens,
                                     prompt_limit_reason=self._prompt_limit_reason())
        namespace = f"{model_id}|weights={model.dtype}|kv={layout.kv_dtype}"
        self.kv = KVCacheManager(
            layout.num_pages,
            layout.page_size,
            namespace,
            self.config.num_cpu_pages,
            enable_prefix_cache=self.config.enable_prefix_cache,
            page_aligned_hits=self.config.deterministic,
            min_tail_tokens=self.config.tail_copy_threshold,
        )
        self.scheduler = Scheduler(self.config, self.kv, self.max_model_len)
        self.scheduler.is_media_encoded = self.runner.is_encoder_cached
        self.scheduler.media_ahead_pending = self.runner.encoding_in_background
        self.requests: dict[str, Request] = {}
        # A decision's question id -> its material request, until the material is computed and the question forked:
        # the id is taken, an abort of it ends the question, and a material that ends otherwise ends its questions.
        self._unspawned: dict[str, Request] = {}
        self._streams: dict[str, TextStream] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._events: list[RequestOutput] = []
        self._arrivals = 0
        self._inflight: InflightStep | None = None  # sampled on the device, not yet read by the host
        # The penalized requests' output counts: a slot for each running one, so max_num_seqs slots (allocated, whole,
        # when a penalized request first samples).
        self.penalty_counts = PenaltyCounts(self.runner.device, model.config.text.vocab_size, self.config.max_num_seqs)
        self.stats = EngineStats()
        if self.config.python_switch_interval_ms is not None:  # process-wide: the last engine made sets it
            sys.setswitchinterval(self.config.python_switch_interval_ms / 1e3)
        log.info("engine ready: %s, KV %s x %d pages of %d tokens, tensor parallel %d", self.model_dir,
                 layout.kv_dtype, layout.num_pages, layout.page_size, group.world_size)

    @property
    def is_stopped(self) -> bool:
        """Whether the engine can serve no more: its tensor-parallel ranks were stopped (a shutdown, or a lost step),
        or a follower has died (noticed here, by its exit code, though no step has run since: `/health` reads it)."""
        return self._followers is not None and self._followers.why_stopped() is not None

    def shutdown(self) -> bool:
        """Stop the tensor-parallel follower ranks (a no-op with one rank). The engine is unusable after. False
        if this rank's leaving its group did not finish in time (logged)."""
        if self._followers is not None:
            if self._inflight is not None and self._inflight.ready is not None:
                self._inflight.ready.synchronize()  # async under TP: its collectives end before the group does
            return self._followers.close()
        if self.runner.background is not None:  # its encodings may still use buffers that are about to be freed
            self.runner.background.wait()
        return True

    # -- requests --------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: PreparedPrompt | str | list[dict], params: SamplingParams | None = None
    ) -> Request:
        """Accept a request (a prepared prompt, a raw prompt string, or chat messages)."""
        if self.is_stopped:
            why = self._followers.why_stopped() if self._followers is not None else None
            raise EngineStopped(f"this engine's tensor-parallel ranks were stopped "
                                f"({why or 'it was shut down, or a step failed'}): build a new engine")
        if self._id_in_use(request_id):
            raise RequestError(f"request id {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling parameters must be a SamplingParams, got {type(params).__name__}")
        vocab = self.runner.model.config.text.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be below the vocabulary size {vocab}, got "
                               f"{[t for t in params.stop_token_ids if t >= vocab]}")
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted by token id
            raise SamplingParamsError(f"logit_bias token ids must be below the vocabulary size {vocab}, got "
                                      f"{[t for t, _ in params.logit_bias if t >= vocab][:8]}")
        if isinstance(prompt, dict) or (isinstance(prompt, list) and not all(isinstance(m, dict) for m in prompt)):
            raise RequestError("a prompt's chat messages are a list of dicts ({'role': ..., 'content': ...}): one "
                               "conversation is [message, ...]")
        if not isinstance(prompt, (PreparedPrompt, str, list)):
            raise RequestError(f"a prompt is a PreparedPrompt, a string or a list of chat messages, got "
                               f"{type(prompt).__name__}")
        if params.n != 1:  # not silently one: a caller asking for n sequences must not get one
            raise RequestError(f"n={params.n}: an engine request is one sequence; ask for n choices as n requests "
                               "(the server does: each choice its own request, a seeded one with seed + i)")
        if isinstance(prompt, str):
            prompt = self.inputs.prepare_prompt(prompt)
        elif isinstance(prompt, list):
            encode = self.config.encode_media_while_preparing and self._followers is None
            prompt = self.inputs.prepare_chat(prompt, on_image=self._encode_while_preparing if encode else None,
                                              bind_names=False)
        self._check_prompt(prompt)
        self.inputs.bind_names(prompt)  # accepted: its image uuids name their images from now on
        request = Request(request_id, prompt, params, self._arrivals)
        self._arrivals += 1
        self.requests[request_id] = request
        self._streams[request_id] = TextStream(
            self.inputs.tokenizer, params, prompt.token_ids, eos_token_ids=self.inputs.eos_token_ids
        )
        generator = make_generator(params)  # on the CPU: the same seed gives the same tokens on any device
        if generator is not None:
            self._generators[request_id] = generator
        self.scheduler.add(request)
        return request

    def _id_in_use(self, request_id: str) -> bool:
        """A live request's id, or a decision's question not yet forked from its material."""
        return request_id in self.requests or request_id in self._unspawned

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt `add_request` accepts: below max_model_len, and within one step's budget when
        chunked prefill is off (what a caller building a prompt of its own, e.g. a decide's re-read, must fit)."""
        if self.config.enable_chunked_prefill:
            return self.max_model_len - 1
        return min(self.max_model_len - 1, self.config.max_num_batched_tokens)

    def _prompt_limit_reason(self) -> str:
        if self.max_prompt_tokens < self.max_model_len - 1:
            return (f"max_num_batched_tokens={self.config.max_num_batched_tokens} with chunked prefill off: a prompt "
                    "is computed in one step")
        return f"max_model_len={self.max_model_len}, less the first token generated"

    def _check_prompt(self, prompt: PreparedPrompt, what: str = "the prompt") -> None:
        """RequestError unless the engine can always finish `prompt`: what `add_request` checks, and
        `add_decision` for every branch (a branch the pool could never hold would wait for ever)."""
        n = len(prompt.token_ids)
        if n == 0:
            raise RequestError(f"{what} is empty")
        ids = np.asarray(prompt.token_ids)
        vocab = self.runner.model.config.text.vocab_size
        if ids.dtype.kind not in "iu" or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise RequestError(f"{what}'s token ids must be integers in [0, {vocab})")
        if n >= self.max_model_len:
            raise RequestError(f"{what} has {n} tokens; max_model_len is {self.max_model_len}")
        widest = max((length for m in prompt.media for _, length in m.spans), default=0)
        if widest > self.config.max_num_batched_tokens:
            vision = self.runner.model.config.vision
            pixels = self.config.max_num_batched_tokens * (vision.patch_size * vision.spatial_merge_size) ** 2
            raise RequestError(
                f"an image (or video frame pair) of {widest} visual tokens is too large for this server: one is "
                f"computed in one step, of at most max_num_batched_tokens={self.config.max_num_batched_tokens} "
                f"tokens; send it at most about {pixels / 1e6:.1f} megapixels"
            )
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise RequestError(
                f"{what} has {n} tokens, more than max_num_batched_tokens={self.config.max_num_batched_tokens} "
                "with chunked prefill off"
            )

    def abort(self, request_id: str) -> None:
        """Cancel a request; its terminal event comes out of the next `step`. Unknown or finished: no-op."""
        material = self._unspawned.get(request_id)
        if material is not None:  # a question not forked yet: it ends; its material too if no question is left
            (branch,) = (b for b in material.branches if b.request_id == request_id)
            material.branches = [b for b in material.branches if b is not branch]
            self._end_question(branch, material, FinishReason.ABORT)
            if not material.branches:
                self._finish(material, FinishReason.ABORT)
            return
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            self._finish(request, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._events)

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, commit. Returns the events of this step (including earlier aborts). With a step in
        flight (async scheduling), launch the next step of its sequences (and of a prompt's chunks beside them)
        when nothing else needs scheduling, and commit it; its events return at once, before any step that must be scheduled (running
        one first would hold them back behind it: a longer gap between tokens)."""
        if self._inflight is not None:
            async_steps.advance_inflight(self)
        else:
            self._scheduled_step()
        if self.config.check_invariants:
            self.kv.check_invariants()
        events, self._events = self._events, []
        return events

    def _scheduled_step(self) -> None:
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        for request, reason in out.failed:
            self._finish(request, FinishReason.ERROR, reason, keep_kv=False)
        if not out.slices and self.kv.plan.is_empty():
            return
        self._stamp_first_scheduled(out.slices)
        plan = self.kv.take_plan()
        try:
            logits = self.runner.execute(out.slices, self.kv, plan, out.media_ahead)
        except Exception as error:  # the step is lost: fail its requests loudly, keep the engine alive (one rank)
            # The request whose media were encoded ahead fails with the step: its media may be the cause,
            # and its own prefill must not fail another step's requests the same way.
            lost_steps.fail_a_lost_step(self, plan, [s.request for s in out.slices] + out.media_ahead_requests, error)
            return
        except BaseException:  # interrupted: the plan is settled all the same, then the interrupt goes on
            lost_steps.settle_after_an_interrupt(self, plan)
            raise
        self.kv.finish_plan(plan)
        self._fail_a_failed_encoding_ahead(out)
        self._commit(out.slices, logits)

    def _stamp_first_scheduled(self, slices) -> None:
        now = time.perf_counter()
        for s in slices:
            if s.request.times.first_scheduled is None:
                s.request.times.first_scheduled = now

    def _fail_a_failed_encoding_ahead(self, out: SchedulerOutput) -> None:
        """If the step's encoding ahead failed (`ModelRunner.take_encode_ahead_failure`), the waiting request the
        media were for fails, not the step's requests."""
        failure = self.runner.take_encode_ahead_failure()
        if failure is not None:
            log.error("encoding media ahead failed", exc_info=failure)
            self._fail(out.media_ahead_requests, failure)

    def _encode_while_preparing(self, image: PreparedImage) -> None:
        """A request's image, just prepared while its others still are: encode it now unless its features are
        cached or the prefix cache holds pages of it (a hit would not read them), or requests already wait (this
        one is not next: many requests added at once would push each other's features out of the encoder cache
        before their prefills). The vision work overlaps the preparation of the rest; the prefill finds the
        features in the encoder cache."""
        if (self.scheduler.waiting or self.runner.is_encoder_cached(image.digest)
                or self.kv.index.holds_media(image.digest)
                or image.num_tokens(self.inputs.merge_size) > self.config.max_num_batched_tokens):
            return
        try:
            self.runner.encode_ahead([MediaWork(image.digest, image.grid_thw, True, image.pixels)])
        except Exception:  # the request is not accepted yet: its prefill encodes the image, and fails it if need be
            log.exception("encoding an image while its request was prepared failed; its prefill will encode it")

    # -- committing a step -----------------------------------------------------------------------
    def _commit(self, slices, logits: torch.Tensor) -> None:
        rows = logits_rows([s.sample for s in slices])
        if self._publish_and_sample(list(zip(slices, rows, strict=True)), logits):
            async_steps.advance_inflight(self)

    def _publish_and_sample(self, computed: list[tuple[ScheduledSlice, int | None]], logits: torch.Tensor) -> bool:
        """Publish each computed slice, then act on the sampling ones' logits rows: a decision's material spawns
        its branches, a readout finishes, the others sample (launched on the device: the step in flight).
        Whether a step is in flight now."""
        for s, _ in computed:
            self.kv.publish_computed(s.request.request_id, s.start, s.end)
        sampling, sampling_rows = [], []
        for s, row in computed:
            if row is None:
                continue
            if s.request.branches is not None:
                decision_forks.spawn_branches(self, s.request)
            elif s.request.readout_candidates is not None:
                request = s.request
                request.readout = readout(logits[row], request.readout_candidates, request.readout_temperature)
                self._finish(request, FinishReason.STOP)
            else:
                sampling.append(s)
                sampling_rows.append(row)
        if not sampling:
            return False
        logits = take_rows(logits, sampling_rows)
        try:
            result = self._sample(sampling, logits)
        except PenaltyTableOutOfMemory as error:  # the penalized requests fail with it; the others sample as they would
            log.error("failing the step's penalized requests: %s", error)
            self._fail([s.request for s in sampling if s.request.params.has_penalties], error)
            kept = [i for i, s in enumerate(sampling) if not s.request.params.has_penalties]
            if not kept:
                return False
            sampling, logits = [sampling[i] for i in kept], take_rows(logits, kept)
            result = self._sample(sampling, logits)
        self._inflight = InflightStep.launch(sampling, result)
        return True

    def _sample(self, slices, logits: torch.Tensor):
        requests = [s.request for s in slices]
        return sample(logits, [r.params for r in requests], [self._generators.get(r.request_id) for r in requests],
                      [r.token_history() if r.params.has_penalties else None for r in requests], self.penalty_counts)

    def _commit_live(self, slices, launched: list[bool], logits: torch.Tensor | None) -> None:
        """Commit a step launched before `_accept_tokens` read the tokens it was fed: its slices whose requests
        are still live, each sampling slice (`launched`, as judged at launch) taking its logits row."""
        rows = logits_rows(launched)
        self._publish_and_sample([(s, r) for s, r in zip(slices, rows, strict=True) if not s.request.is_finished],
                                 logits)

    def _accept_tokens(self, step: InflightStep, pending: set[str]) -> None:
        """Commit `step`'s sampled tokens: append (or fill the pending slot of a continued sequence), stream,
        finish. A request that finished while the step was in flight (aborted) is skipped."""
        result = step.host_result()
        token_ids = result.token_ids.tolist()
        now = time.perf_counter()
        for i, s in enumerate(step.sampled):
            request = s.request
            if request.is_finished:
                continue
            token = token_ids[i]
            request.output_token_ids.append(token)
            if request.times.first_token is None:
                request.times.first_token = now
            request.times.last_token = now
            delta, stopped_by_text = self._streams[request.request_id].push(token)
            logprobs = (token_logprobs(result, i, token, request.params.logprobs)
                        if request.params.logprobs is not None else None)
            reason = request.finish_reason_after(token, stopped_by_text, self.inputs.eos_token_ids, self.max_model_len)
            if reason is None:
                if request.request_id in pending:
                    self.kv.fill_pending(request.request_id, token)
                else:
                    self.kv.append_tokens(request.request_id, [token])
                self._events.append(RequestOutput.of(request, [token], delta, logprobs))
            else:
                self._finish(request, reason, new_tokens=[token], new_text=delta, logprobs=logprobs)

    # -- decisions ---------------------------------------------------------------------------------
    def add_readout_request(
        self, request_id: str, prompt: PreparedPrompt, candidates: tuple[int, ...], temperature: float = 1.0
    ) -> Request:
        """A request that ends at its last prompt position with probabilities over `candidates`."""
        request = self.add_request(request_id, prompt, SamplingParams(max_tokens=1))
        request.readout_candidates = tuple(candidates)
        request.readout_temperature = temperature
        return request

    def add_decision(self, decision_id: str, branches: list[Branch]) -> list[str]:
        """Questions over one material: the shared prefix of the branch prompts is prefilled once as a
        material request; when it is computed every branch forks from it (sharing its pages, copying
        on write) and computes only its question, all in the same steps. Returns the branch request ids,
        whose terminal events carry the readout (`decision_forks`)."""
        return decision_forks.add_decision(self, decision_id, branches)

    # -- ending ----------------------------------------------------------------------------------
    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        error: str | None = None,
        *,
        keep_kv: bool = True,
        new_tokens: list[int] | None = None,
        new_text: str = "",
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        if request.request_id in self.kv.seqs:
            self.kv.release(request.request_id, keep_in_cache=keep_kv)
        self.scheduler.remove(request)
        if reason is not FinishReason.ERROR and reason is not FinishReason.ABORT:
            last_text, reason = self._last_text(request, reason)
            new_text += last_text
        request.finish(reason, error)
        self._emit_terminal(request, new_tokens or [], new_text, logprobs)
        for b in request.branches or ():  # a material that ends before its questions were forked ends them
            if self._unspawned.get(b.request_id) is request:
                self._end_question(b, request, reason, error)

    def _fail(self, requests: list[Request], error: Exception) -> None:
        """End `requests` (those not ended yet) with an error naming `error`."""
        for request in requests:
            if not request.is_finished:
                self._finish(request, FinishReason.ERROR, f"{type(error).__name__}: {error}", keep_kv=False)

    def _last_text(self, request: Request, reason: FinishReason) -> tuple[str, FinishReason]:
        """The text `request`'s stream still holds, released as the request ends for `reason`, and the reason it ends
        for: the held text may complete a stop string (a character cut by the budget flushes as U+FFFD, with the text
        held back before it), and the request then stops on that string as on one completed mid-stream, cut before
        it, not on the budget that ended its tokens."""
        stream = self._streams[request.request_id]
        text = stream.flush()
        return text, FinishReason.STOP if stream.finish_reason == "stop" else reason

    def _end_question(self, branch: Branch, material: Request, reason: FinishReason, error: str | None = None
                      ) -> None:
        """The terminal event of a question its material never forked (aborted, or failed with its material)."""
        del self._unspawned[branch.request_id]
        question = Request(branch.request_id, branch.prompt, SamplingParams(max_tokens=1), material.arrival_order)
        question.finish(reason, error)
        self._events.append(RequestOutput.of(question, [], "", None))
        self.stats.requests_finished += 1

    def _emit_terminal(self, request: Request, new_tokens=(), new_text: str = "", logprobs=None) -> None:
        assert request.state is RequestState.FINISHED
        self._events.append(RequestOutput.of(request, list(new_tokens), new_text, logprobs))
        self._streams.pop(request.request_id, None)
        self._generators.pop(request.request_id, None)
        del self.requests[request.request_id]
        self.stats.requests_finished += 1
