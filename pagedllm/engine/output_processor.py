"""The engine's output side (vLLM v1's OutputProcessor): what each submitted request has produced so far, made
into RequestOutputs after a step: tokens detokenized, stop strings applied, logprob dicts built, finished
requests let go. It owns the requests' text state; the scheduler owns their place in the batch."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.engine.audio_inputs import AudioGeneration
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.request import FINISH_REASONS, Request, RequestStatus
from pagedllm.model_executor.model_runner import ModelRunnerOutput
from pagedllm.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class _Sequence:
    """One of a prompt's n samples: the engine request plus its text so far."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    num_seen: int = 0  # output tokens made into output so far


@dataclass
class _Group:
    """What the user submitted under one request id: a prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    stream: bool = False
    pooled: PoolingOutput | None = None  # a pooling request's output, once its prompt is computed

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


# How the output side ends a request a stop string ended (the scheduler frees its blocks).
FinishRequest = Callable[[Request, RequestStatus], None]


class OutputProcessor:
    def __init__(self, tokenizer, audio: AudioGeneration | None, finish_request: FinishRequest) -> None:
        self.tokenizer = tokenizer
        self.audio = audio
        self._finish_request = finish_request
        self._groups: dict[str, _Group] = {}
        self._seq_of: dict[str, tuple[_Group, _Sequence]] = {}  # engine request id -> its group and sample

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams | PoolingParams, requests: list[Request], stream: bool) -> None:
        """A submitted request's n samples (their engine requests), each with its detokenizer (none for audio
        outputs, a pooling request, or without a tokenizer)."""
        pooling = isinstance(params, PoolingParams)
        group = _Group(request_id, prompt, prompt_token_ids, [],
                       [None] if not pooling and params.prompt_logprobs is not None else None, stream and not pooling)
        for index, req in enumerate(requests):
            detok = None
            if self.tokenizer is not None and not req.generates_audio and not pooling:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                               params.spaces_between_special_tokens, params.stop,
                                               params.include_stop_str_in_output)
            seq = _Sequence(req, index, detok)
            group.sequences.append(seq)
            self._seq_of[req.request_id] = (group, seq)
        self._groups[request_id] = group

    def abort(self, request_id: str) -> list[Request]:
        """Forget a submitted request; its engine requests (for the scheduler to end), [] when unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        for seq in group.sequences:
            self._seq_of.pop(seq.request.request_id, None)
        return [seq.request for seq in group.sequences]

    def drop_ended(self, result: ModelRunnerOutput) -> ModelRunnerOutput:
        """Without the rows of requests that ended (a stop string, an abort) while their step ran."""
        def live(rid: str) -> bool:
            entry = self._seq_of.get(rid)
            return entry is not None and not entry[1].request.is_finished

        return ModelRunnerOutput({rid: row for rid, row in result.sampled.items() if live(rid)},
                                 {rid: c for rid, c in result.prompt_logprobs.items() if live(rid)},
                                 {rid: data for rid, data in result.pooled.items() if live(rid)},
                                 {rid: d for rid, d in result.spec_token_ids.items() if live(rid)})

    def process(self, result: ModelRunnerOutput) -> list[RequestOutput | PoolingRequestOutput]:
        """The step's outputs: tokens detokenized, stop strings applied, finished groups let go."""
        outputs = []
        for group in self._update(result):
            if group.finished or group.stream:
                outputs.append(self._make_output(group))
            if group.finished:
                self._groups.pop(group.request_id, None)
                for seq in group.sequences:
                    self._seq_of.pop(seq.request.request_id, None)
        return outputs

    def _update(self, result: ModelRunnerOutput) -> list[_Group]:
        touched: dict[str, _Group] = {}
        for rid, data in result.pooled.items():
            if rid in self._seq_of:
                group = self._seq_of[rid][0]
                group.pooled = PoolingOutput(data)
                touched[group.request_id] = group
        for rid, chunk in result.prompt_logprobs.items():
            if rid in self._seq_of:  # (an abort since the step ran drops its rows)
                self._add_prompt_logprobs(self._seq_of[rid][0], chunk)
        for rid, step_row in result.sampled.items():
            if rid not in self._seq_of:
                continue
            group, seq = self._seq_of[rid]
            touched[group.request_id] = group
            self._add_tokens(seq, step_row)
        return list(touched.values())

    def _add_tokens(self, seq: _Sequence, step_row) -> None:
        """A step's tokens of one sequence: one, or (speculative decoding) the kept drafts and the sampled token,
        as many as the scheduler appended (a stop token ends the run). A stop string met before the run's end
        drops the tokens after it."""
        req = seq.request
        rows = [*(step_row.accepted or ()), step_row][:req.num_output_tokens - seq.num_seen]
        seq.num_seen += len(rows)
        for i, row in enumerate(rows):
            if row.logprob is not None:
                entry = {row.token_id: Logprob(row.logprob, row.rank, self._decode_one(row.token_id))}
                for rank, (tid, lp) in enumerate(zip(row.top_ids, row.top_logprobs), start=1):
                    if tid not in entry:
                        entry[tid] = Logprob(lp, rank, self._decode_one(tid))
                req.output_logprobs.append(entry)
                req.cumulative_logprob += row.logprob
            if seq.detokenizer is None:
                continue
            last = i == len(rows) - 1
            stopped_by_token = last and req.status == RequestStatus.FINISHED_STOPPED and (
                row.token_id in req.eos_token_ids or row.token_id == req.stop_reason)
            if stopped_by_token and not req.sampling_params.include_stop_str_in_output:
                continue  # the EOS / stop token's own text is not part of the output
            _, stop = seq.detokenizer.add_token(row.token_id)
            if stop is None and req.is_finished and last:
                _, stop = seq.detokenizer.flush()
            if stop is not None:
                if not req.is_finished:
                    self._finish_request(req, RequestStatus.FINISHED_STOPPED)
                    req.stop_reason = stop
                elif req.status == RequestStatus.FINISHED_LENGTH or not last:
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                if not last:  # (speculative decoding) the run's tokens after the stop string are not output
                    del req.all_token_ids[len(req.all_token_ids) - (len(rows) - 1 - i):]
                    seq.num_seen = req.num_output_tokens
                break

    def _add_prompt_logprobs(self, group: _Group, chunk) -> None:
        if group.prompt_logprobs is None:
            return
        # After a preemption the prompt is recomputed: keep only positions not yet recorded.
        skip = len(group.prompt_logprobs) - chunk.first_position
        if skip < 0:
            raise RuntimeError(f"prompt logprobs arrived out of order for request {group.request_id}")
        rows = list(zip(chunk.token_logprobs, chunk.ranks, chunk.top_ids, chunk.top_logprobs))[skip:]
        for lp, rank, ids, lps in rows:
            target = group.prompt_token_ids[len(group.prompt_logprobs)]
            entry = {target: Logprob(lp, rank, self._decode_one(target))}
            for r, (tid, tlp) in enumerate(zip(ids, lps), start=1):
                entry.setdefault(tid, Logprob(tlp, r, self._decode_one(tid)))
            group.prompt_logprobs.append(entry)

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _make_output(self, group: _Group) -> RequestOutput | PoolingRequestOutput:
        if group.pooled is not None:
            return PoolingRequestOutput(group.request_id, group.prompt, group.prompt_token_ids, group.pooled,
                                        group.finished, self._metrics(group))
        outs = []
        for seq in group.sequences:
            req = seq.request
            want_lp = req.sampling_params.logprobs is not None
            outs.append(CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.output_text if seq.detokenizer else "",
                token_ids=list(req.output_token_ids),
                cumulative_logprob=req.cumulative_logprob if want_lp else None,
                logprobs=list(req.output_logprobs) if want_lp else None,
                finish_reason=FINISH_REASONS.get(req.status),
                stop_reason=req.stop_reason,
                audio_codes=self.audio.output_codes(req.audio_frames) if req.generates_audio else None,
            ))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             group.prompt_logprobs, outs, group.finished, self._metrics(group))

    @staticmethod
    def _metrics(group: _Group) -> dict:
        reqs = [seq.request for seq in group.sequences]
        scheduled = [r.first_scheduled_time for r in reqs if r.first_scheduled_time is not None]
        return {"arrival_time": min(r.arrival_time for r in reqs),
                "first_scheduled_time": min(scheduled) if scheduled else None}
