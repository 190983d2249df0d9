"""``LLMEngine``: requests in, one scheduled forward per ``step()``, outputs out.

    seq_group_metadata, scheduler_outputs = self.scheduler.schedule()
    step = self.worker.execute_model(seq_group_metadata, scheduler_outputs)
    return self._update(scheduler_outputs, step.get_output())

The worker owns the device (model, KV cache, persistent batch, runner); the
processor checks and tokenizes requests before anything is queued; the
scheduler owns every sequence's state, and ``Scheduler.update`` applies a
step's tokens and beam decisions; the output processor owns the text and the
``RequestOutput``s.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq  # encdec.sequence.Sequence is the other one
from dataclasses import dataclass, replace
from typing import Any

from encdec.config import SchedulerConfig
from encdec.core.outputs import ModelRunnerOutput
from encdec.core.scheduler import Scheduler, SchedulerOutputs, SchedulerStats
from encdec.core.speculation import Speculation
from encdec.engine.arg_utils import EngineArgs
from encdec.engine.encoder_key import encoder_cache_key
from encdec.engine.processor import Processor
from encdec.inputs import PromptType
from encdec.output_processor import OutputProcessor
from encdec.outputs import RequestOutput
from encdec.sampling_params import SamplingParams, SamplingType
from encdec.sequence import Sequence, SequenceGroup, SequenceStatus
from encdec.spec_decode import NgramProposer
from encdec.worker.draft_rows import DraftProposer
from encdec.worker.enc_dec_model_runner import StepPlan
from encdec.worker.worker import Worker

logger = logging.getLogger("encdec")


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # sequence groups running (on device)
    num_waiting: int  # sequence groups not yet admitted
    num_swapped: int  # sequence groups swapped out to CPU
    kv_cache_usage: float  # fraction of device KV blocks in use, 0..1
    num_preemptions: int  # since the engine started
    encoder_cache_queries: int  # requests that looked up a shared cross table, since start
    encoder_cache_hits: int  # of those, requests that reused one (no encoder pass)
    prefix_cache_queries: int = 0  # decoder prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached (their prefill skipped)
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified, since start (speculative decoding)
    spec_decode_num_accepted_tokens: int = 0  # of those, drafts kept
    spec_decode_num_drafts: int = 0  # rows verified with drafts, since start (vLLM's num_drafts)

    @property
    def spec_decode_acceptance_rate(self) -> float | None:
        """Drafts kept per draft verified; None before any."""
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else None

    @property
    def spec_decode_mean_accepted_length(self) -> float | None:
        """Tokens a speculating row gained per step (its kept drafts and the
        target's token: vLLM's mean acceptance length); None before any."""
        n = self.spec_decode_num_drafts
        return 1 + self.spec_decode_num_accepted_tokens / n if n else None


def scheduler_config_for(args: EngineArgs, max_model_len: int, max_encoder_len: int,
                         model: Any = None) -> SchedulerConfig:
    """``model``: the loaded model, whose encoder a budget may split across steps
    (``num_encoder_layers``, ``encoder_row_granule``); None: passes run whole."""
    one_request = max_model_len + max_encoder_len
    return SchedulerConfig(
        encoder_layers=getattr(model, "num_encoder_layers", 0),
        encoder_row_granule=getattr(model, "encoder_row_granule", None),
        max_num_batched_tokens=args.max_num_batched_tokens or max(32768, one_request),
        max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
        max_encoder_len=max_encoder_len, preemption_mode=args.preemption(),
        policy=args.scheduling_policy, max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill)


def min_admission_for(args: EngineArgs, cuda_graphs: bool) -> int:
    """The user's, else max_num_seqs // 8 where decode steps replay CUDA graphs.
    There a step that admits requests runs eagerly; on an H100 BART-large dims
    at 512 requests (each admitted as another finished, so nearly every step
    admitted some) ran at 3932 tok/s against 7532 at 256 (all admitted at the
    start, then graph replays). On CPU every step runs the same way: 1."""
    if args.min_admission is not None:
        return args.min_admission
    return max(1, args.max_num_seqs // 8) if cuda_graphs else 1


class LLMEngine:
    """Requests in, one scheduled forward per ``step()``, outputs out.

    Not thread-safe: one thread drives an engine (``LLM`` serialises its
    callers with a lock). Building one changes no process-wide state: torch's
    threads, its global RNG and the allocator are the program's to set
    (``encdec.configure_cpu_runtime``); random sampling draws from the
    engine's own generator, seeded from ``EngineArgs.seed``.
    """

    def __init__(self, args: EngineArgs, *, check_precision: bool = True):
        # check_precision=False: platform.precision's probe engines (their run is the measurement)
        self.args = args
        self.worker = Worker(args.load_config(), check_precision=check_precision)
        mc = self.model_config = self.worker.model_config
        self.scheduler_config = scheduler_config_for(args, mc.max_model_len, mc.max_encoder_len, self.worker.model)
        spec = args.speculative_config  # a SpeculativeConfig (EngineArgs checked it) or None
        draft = self.worker.load_draft(spec) if spec is not None and spec.method == "draft_model" else None
        self.cache_config = self.worker.init_cache(
            args.cache_config(), args.max_num_seqs,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens, draft=draft)
        graphs = self.worker.use_cuda_graphs
        self.scheduler_config = replace(
            self.scheduler_config, min_admission=min_admission_for(args, graphs))
        self.worker.init_batch(self.scheduler_config, args.logits_processors, args.seed)
        self.processor = Processor(mc, self.scheduler_config, self.cache_config,
                                   vocab_size=self.worker.vocab_size,
                                   validate_params=self.worker.validate_params,
                                   feature_device=str(self.worker.device))
        self.tokenizer = self.processor.tokenizer
        self.eos_token_id = self.processor.eos_token_id
        self.seq_counter = itertools.count()
        self.output_processor = OutputProcessor(self.tokenizer, max_model_len=mc.max_model_len,
                                                eos_token_id=self.eos_token_id, seq_ids=self.seq_counter)
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config,
                                   stop_checker=self.output_processor.stop_checker,
                                   beams=self.output_processor.beams,
                                   structured=self.processor.structured_outputs,
                                   speculation=Speculation(spec, mc.max_model_len) if spec else None)
        if spec:
            self.worker.model_runner.drafter = DraftProposer(
                self.worker.draft_model(draft, self.cache_config, spec.draft_vocab_size) if draft is not None
                else NgramProposer.from_config(spec))
        self._num_request_ids = 0  # next id new_request_id() gives
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self._model_identity = f"{mc.architecture}\0{os.path.realpath(mc.model)}\0{mc.dtype}"
        self.async_scheduling = (args.async_scheduling if args.async_scheduling is not None
                                 else self.worker.device.type == "cuda" and not spec)
        self._ahead: tuple[SchedulerOutputs, StepPlan] | None = None  # the next step, planned ahead
        self.steps_planned_ahead = 0  # steps scheduled and packed while the one before ran

    # -- what callers read (the worker's parts are ``engine.worker.*``) ----------------
    @property
    def stats(self) -> SchedulerStats:
        """Live counters (encoder cache queries/hits/passes, preemptions, swaps,
        peak KV blocks): what a server's ``/metrics`` reports."""
        return self.scheduler.stats

    @property
    def hf_config(self) -> Any:
        return self.model_config.hf_config

    @property
    def generation_config(self) -> Any:
        return self.model_config.generation_config

    @property
    def model(self) -> Any:
        return self.worker.model

    @property
    def model_runner(self) -> Any:
        return self.worker.model_runner

    def new_request_id(self) -> str:
        """A request id not in use ("0", "1", ...), so callers keep no counter of
        their own and never collide with each other's ids."""
        while True:
            request_id = str(self._num_request_ids)
            self._num_request_ids += 1
            if self.scheduler.get_seq_group(request_id) is None:
                return request_id

    # -- requests ----------------------------------------------------------------
    def process_requests(self, prompts: Seq[PromptType],
                         params_list: Seq[SamplingParams | None]) -> list[tuple[dict, SamplingParams]]:
        """Validate and tokenize a whole call without touching engine state
        (``encdec.engine.processor.Processor.process_requests``); per-request
        options travel on the params (``truncate_prompt_tokens``)."""
        return self.processor.process_requests(prompts, params_list)

    def process_request(self, prompt: PromptType, params: SamplingParams | None) -> tuple[dict, SamplingParams]:
        """``process_requests`` for one prompt (errors carry no index)."""
        return self.processor.process_request(prompt, params)

    def add_processed_request(self, request_id: str, inputs: dict, params: SamplingParams,
                              arrival_time: float | None = None, priority: int = 0, *,
                              encoder_output: Any = None) -> None:
        """Queue what ``process_requests`` returned, at ``priority`` (the request's
        own, checked here before anything changes). ``encoder_output``: the encoder's
        output for ``inputs`` (a tensor (encoder tokens, d_model)) computed elsewhere,
        e.g. by an encoder worker; its prefill uses it instead of running the encoder."""
        if self.scheduler.get_seq_group(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.processor.check_priority(priority)
        if encoder_output is not None:
            want = (len(inputs["encoder_prompt_token_ids"]), self.hf_config.d_model)
            if tuple(getattr(encoder_output, "shape", ())) != want:
                raise ValueError(f"encoder_output must have shape {want}, got "
                                 f"{tuple(getattr(encoder_output, 'shape', ())) or type(encoder_output).__name__}")
            self.worker.model_runner.encoder_outputs[request_id] = encoder_output
        block_size = self.cache_config.block_size
        seqs = []
        for i in range(params.best_of):
            seq = Sequence(next(self.seq_counter), inputs, block_size, self.eos_token_id)
            seq.data.sample_index = i
            seqs.append(seq)
        encoder_seq = Sequence(seqs[0].seq_id, inputs, block_size, from_decoder_prompt=False)
        key = self.encoder_key(inputs)
        group = SequenceGroup(request_id, seqs, arrival_time or time.time(), params,
                              encoder_seq=encoder_seq, priority=priority, encoder_cache_key=key)
        if encoder_output is not None:  # its pass is run: the encoder budget neither counts nor splits it
            group.encoder_units_done = encoder_seq.get_len() * self.scheduler_config.encoder_layers
        self.scheduler.add_seq_group(group)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        inputs, params = self.process_request(prompt, params)
        self.add_processed_request(request_id, inputs, params, arrival_time, priority)

    def encoder_key(self, inputs: dict) -> str | None:
        """The encoder cache's content key of ``inputs`` (None with the cache off)."""
        return encoder_cache_key(inputs, self._model_identity) if self.cache_config.enable_encoder_cache else None

    def holds_encoder_output(self, key: str | None) -> bool:
        """Whether a device cross table holds (or a queued prefill will write) the KV
        of ``key``, so that a request with it now skips its encoder pass; a hint for
        callers that compute encoder outputs elsewhere (the table may be evicted
        before the request is admitted: its prefill then runs the encoder here)."""
        return key is not None and self.scheduler.block_manager.cross.device_blocks_needed(key, -1) >= 0

    def abort_request(self, request_id: str | list[str]) -> list[str]:
        """Abort unfinished requests (unknown ids are ignored); returns the ids aborted."""
        aborted = []
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.worker.model_runner.encoder_pieces.drop(rid)  # its encoder output or split pass
        for group in self.scheduler.abort_seq_group(request_id):
            aborted.append(group.request_id)
        self._drop_idle_plan()
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # -- step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled forward; returns the requests that finished in it.

        With ``async_scheduling`` the next step is scheduled and packed while
        this one runs (between queuing its kernels and waiting for its tokens),
        its rows one position further; this step's tokens are applied before the
        next one runs, so logits processors, stop strings and text see what they
        would see without it. Steps with beam search, grammar masks or the
        priority policy (whose preemption could take a row still running) and
        steps short of a free block per row are followed by an unplanned step."""
        if self._ahead is not None:
            sched, plan = self._ahead
            self._ahead = None
            step = self.worker.run_step(plan)
        else:
            metas, sched = self.scheduler.schedule()
            step = self.worker.execute_model(metas, sched)  # returns once its kernels are queued
        ahead = self._rows_ahead(sched)
        if ahead:
            metas, next_sched = self.scheduler.schedule(ahead)
            self._ahead = (next_sched, self.worker.plan_step(metas, next_sched, ahead))
            self.steps_planned_ahead += 1
        outs = self._update(sched, step.get_output())
        self._drop_idle_plan()
        return outs

    def _drop_idle_plan(self) -> None:
        """A planned step whose every row has finished or was aborted: nothing to run."""
        if self._ahead is not None and not self.scheduler.has_unfinished_seqs():
            self._ahead = None

    def _rows_ahead(self, sched: SchedulerOutputs) -> set[int] | None:
        """The step's decoder sequences, if the next step may be scheduled before
        their tokens are known (see ``step``); else None."""
        if not self.async_scheduling or sched.token_masks is not None or self.scheduler_config.policy == "priority":
            return None
        ids = set()
        for s in sched.scheduled_seq_groups:
            group = s.seq_group
            if len(group.seqs) != 1 or group.sampling_params.sampling_type is SamplingType.BEAM:
                return None
            ids.add(group.seqs[0].seq_id)
        if len(ids) > self.scheduler.block_manager.get_num_free_gpu_blocks():
            return None  # a row might need a block it could only get by preempting another
        return ids

    def _update(self, sched: SchedulerOutputs, output: ModelRunnerOutput) -> list[RequestOutput]:
        """Counters, then the scheduler applies the step; finished requests' outputs."""
        for s in sched.scheduled_seq_groups[: sched.num_prefill_groups]:
            self.num_prompt_tokens += s.token_chunk_size + s.seq_group.encoder_seq.get_len()
        if output.beam_candidates:  # one token per running beam, chosen by HF's beam rules
            self.num_generated_tokens += sum(s.seq_group.num_seqs(SequenceStatus.RUNNING)
                                             for s in sched.scheduled_seq_groups
                                             if s.seq_group.request_id in output.beam_candidates)
        finished = self.scheduler.update(sched, output)
        self.num_generated_tokens += self.scheduler.num_appended  # a spare row's sample is not one
        now, outs = time.time(), []
        for group in finished:
            group.metrics.finished_time = now
            self.worker.model_runner.encoder_pieces.drop(group.request_id)  # an output its prefill never took
            outs.append(self.output_processor.make_output(group))
        return outs

    def num_free_blocks(self) -> tuple[int, int]:
        bm = self.scheduler.block_manager
        return bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()

    # -- observation (servers, metrics) -----------------------------------------
    def get_stats(self) -> EngineStats:
        """Queue lengths and cache use now, for a server's /metrics."""
        sched, total = self.scheduler, self.cache_config.num_gpu_blocks
        free, _ = self.num_free_blocks()
        st = sched.stats
        return EngineStats(len(sched.running), len(sched.waiting), len(sched.swapped),
                           (total - free) / total if total else 0.0, st.num_preempted,
                           st.encoder_cache_queries, st.encoder_cache_hits,
                           *sched.block_manager.prefix_cache_stats(),
                           st.spec_draft_tokens, st.spec_accepted_tokens, st.spec_drafts)

    def get_partial_outputs(self, request_ids: Iterable[str]) -> dict[str, RequestOutput]:
        """What the given unfinished requests have produced so far (``step`` returns
        finished requests only); streaming servers read this after each step."""
        groups = [self.scheduler.get_seq_group(rid) for rid in request_ids]
        return self.output_processor.partial_outputs(g for g in groups if g is not None)

    def get_request_progress(self) -> dict[str, tuple[int, float]]:
        """(output tokens so far, arrival time) of every unfinished request, for
        token-latency metrics."""
        return {g.request_id: (sum(s.get_output_len() for s in g.get_seqs()), g.arrival_time)
                for g in self.scheduler.get_seq_groups()}
